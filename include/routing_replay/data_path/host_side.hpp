/// @file
/// The host side of a replay: parts 1, 2, 5 and 6 of the data path (request_registry, step_planner,
/// row_filer, row_reader) composed, and every call an engine makes about requests: add them, serve cached
/// prefixes, resolve drafts, extract, move blocks, release, abort. Plain C++20, no backend.
///
/// RoutingReplay puts the device side (capture_buffer, copy_pipeline) under it; scheduler_replay
/// (parallel/scheduler_replay.hpp) puts packets from worker processes under it. Both file steps
/// through the same planner and filer and read them through the same reader, which is why they
/// return the same rows.
#pragma once

#include <routing_replay/copy_strategy.hpp>
#include <routing_replay/data_path/request_registry.hpp>
#include <routing_replay/data_path/row_filer.hpp>
#include <routing_replay/data_path/row_reader.hpp>
#include <routing_replay/data_path/step_planner.hpp>
#include <routing_replay/detail/thread_check.hpp>
#include <routing_replay/detail/validate_config.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/index_type.hpp>
#include <routing_replay/layer_map.hpp>
#include <routing_replay/routed_experts.hpp>
#include <routing_replay/step_plan.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory_resource>
#include <span>
#include <string>
#include <vector>

namespace routing_replay {

/// @brief Requests, plans and host storage, and the request calls of the public API.
///
/// `Derived` says where steps are in flight between end_step and filing: it provides
/// `file_through(serial)`, which files every step up to that serial (and no later one), and may
/// throw what filing throws. Calls that read rows file what they depend on first.
/// @tparam Store the host store (a host_storage policy's store)
/// @tparam Site who places rows: the host (from a staging or a packet) or a kernel
template <class Derived, expert_index Index, class Store, scatter_site Site>
class host_side {
 protected:
  /// @brief The row filer over the host store.
  using filer_type = row_filer<Index, Store, Site>;
  /// @brief The row reader over the host store.
  using reader_type = row_reader<Index, Store, filer_type::claims_when_planned>;

 public:
  /// @brief The stored id type.
  using index_type = Index;
  /// @brief What extract() returns.
  using result_type = routed_experts<Index>;

  /// @name Shape
  /// @{

  /// @brief The configuration, as validated.
  [[nodiscard]] const replay_config& config() const noexcept { return config_; }
  /// @brief L: captured MoE layers.
  [[nodiscard]] std::int32_t num_layers() const noexcept { return filer_.layers().num_layers(); }
  /// @brief K.
  [[nodiscard]] std::int32_t top_k() const noexcept { return config_.top_k; }
  /// @brief Ids per row (L * K).
  [[nodiscard]] std::int64_t row_size() const noexcept { return filer_.row_elems(); }
  /// @brief Bytes of host row storage in use.
  [[nodiscard]] std::size_t host_bytes() const noexcept { return filer_.store().bytes_in_use(); }
  /// @brief Live requests.
  [[nodiscard]] std::size_t num_requests() const noexcept { return requests_.size(); }
  /// @brief Blocks until the host row memory kept ahead of need (replay_config::host_memory_ahead)
  /// is mapped, faulted in and, for device scatter, registered. An engine calls it once at
  /// start-up, so that its first steps of new requests take memory that is ready instead of
  /// mapping it on the step's path. Returns at once for block-slot storage (its pool is allocated
  /// when the replay is built) and where nothing is kept ahead. Safe from any thread.
  void wait_for_host_memory_ahead() const { filer_.store().wait_until_ahead(); }
  /// @brief How per-request storage's row memory grew (superblocks made ahead by the background
  /// thread, and made on the engine's thread in a step); zeros for block-slot storage.
  [[nodiscard]] routing_replay::host_memory_growth host_memory_growth() const noexcept
  {
    if constexpr (requires { filer_.store().growth(); }) {
      return filer_.store().growth();
    } else {
      return {};
    }
  }
  /// @brief The captured index (layer slot) of a model layer.
  /// @throws error unknown_layer if the layer map does not capture it.
  [[nodiscard]] std::int32_t layer_slot(std::int32_t model_layer) const { return filer_.layers().slot(model_layer); }
  /// @}

  /// @name Requests
  /// @{

  /// @brief Registers a request that asked for its routing. Requests that did not ask are never
  /// added and their tokens are skip()ped in plans: they cost nothing on the host.
  ///
  /// Returns the request's handle: every call that takes the id takes it too, and plans that name
  /// requests by handle cost no hashing per request and step (engines keep it beside their own
  /// request object).
  /// @throws error duplicate_request, slot_out_of_range (cached slots), position_out_of_range,
  /// invalid_argument (`id` is a handle)
  request_handle add_request(request_key id, const request_options& options = {})
  {
    [[maybe_unused]] const auto inside = threads_.enter("add_request");
    filer_.check_cached_prefix(id, options.cached_slots);
    const std::uint32_t h = requests_.add(id);  // throws duplicate_request
    try {
      filer_.store().open(h);
      filer_.bind_cached_prefix(h, options.cached_slots, requests_, planner_.latest_serial(), open_serial());
    } catch (...) {  // the store refused memory: the request was never added
      requests_.remove(h);  // never allocates
      throw;
    }
    requests_[h].prompt_length = options.prompt_length;
    return requests_.handle_of(h);
  }

  /// @brief The handle of a live request (as add_request() returned it).
  /// @throws error unknown_request
  [[nodiscard]] request_handle handle(request_key id) const { return requests_.handle_of(requests_.find(id)); }

  /// @brief A live request (re)starts with positions [0, cached_slots.size()) served from the
  /// prefix cache, e.g. when it is re-admitted after preemption. Block-slot storage binds those
  /// positions to the slots unless it already holds a valid row for them (first write wins);
  /// per-request storage has no rows for cached positions it never computed (they read as missing).
  /// @throws error unknown_request, slot_out_of_range, position_out_of_range
  void add_cached_prefix(request_key id, std::span<const std::int64_t> cached_slots)
  {
    [[maybe_unused]] const auto inside = threads_.enter("add_cached_prefix");
    const std::uint32_t h = requests_.find(id);
    filer_.check_cached_prefix(id, cached_slots);
    filer_.bind_cached_prefix(h, cached_slots, requests_, planner_.latest_serial(), open_serial());
    count_for_open_step(h, static_cast<std::int64_t>(cached_slots.size()));  // bound while its step is open
  }

  /// @brief Whether a request (id or handle) is live.
  [[nodiscard]] bool contains(request_key id) const { return requests_.contains(id); }

  /// @brief T: one past the highest committed position of a request (files the request's steps
  /// still in flight first).
  /// @throws error unknown_request; as drain() for a step filed on the way
  [[nodiscard]] std::int64_t recorded_rows(request_key id)
  {
    [[maybe_unused]] const auto inside = threads_.enter("recorded_rows");
    const std::uint32_t h = requests_.find(id);
    derived().file_through(requests_[h].reads_step);  // what the request's rows may still wait for
    return reader_.readable_rows(h, requests_, planner_.open_step());
  }

  /// @brief Resolves the oldest pending draft group of a request: the first `num_accepted` drafts
  /// are committed, the rest are erased (their positions will be recomputed).
  /// @throws error unknown_request, draft_error
  void accept_draft(request_key id, std::int32_t num_accepted)
  {
    [[maybe_unused]] const auto inside = threads_.enter("accept_draft");
    const std::uint32_t h        = requests_.find(id);
    const auto accepted   = filer_.accept_draft(id, h, num_accepted, requests_, planner_.ended_serial());
    // the open step's own drafts wait for it like the rest of its rows
    if (accepted.step < planner_.latest_serial()) { count_for_open_step(h, accepted.committed_through); }
  }

  /// @brief A request's routing, rows [start_position, end_position): typically at finish, but any
  /// live request may be extracted (rows of an open step are not included).
  ///
  /// First files the steps still in flight that the request's rows depend on, and no later ones
  /// (with block-slot storage, every step that has ended: slots are shared).
  /// Per-request storage returns a zero-copy view (valid until the next begin_step or release of
  /// the request) unless include_dense_layers; block-slot storage gathers a copy. Missing or stale
  /// rows hold the sentinel.
  /// @throws error unknown_request, draft_error (unresolved drafts), position_out_of_range; as
  /// drain() for a step filed on the way
  [[nodiscard]] result_type extract(request_key id, const extract_options& options = {})
  {
    [[maybe_unused]] const auto inside = threads_.enter("extract");
    const auto [h, begin, end] = select_rows(id, options);
    const std::int64_t prompt  = options.prompt_length >= 0 ? options.prompt_length : requests_[h].prompt_length;
    return reader_.extract(filer_.store(), h, begin, end, prompt, options);
  }

  /// @brief Copies a request's rows into a caller buffer; returns the number of rows written.
  /// @throws error as extract(), and invalid_argument if `out` is too small
  std::int64_t extract_into(request_key id, std::span<Index> out, const extract_options& options = {})
  {
    [[maybe_unused]] const auto inside = threads_.enter("extract_into");
    const auto [h, begin, end] = select_rows(id, options);
    reader_.copy_rows_into(filer_.store(), id, h, begin, end, options, out);
    return end - begin;
  }

  /// @brief Hands a request's rows [start_position, end_position) over where they lie in host
  /// storage, in position order, without copying them: `on_rows(const Index* first, std::int64_t n)`
  /// for n rows stored back to back (row_size() ids a row, top_k() ids a layer, captured layers
  /// only), `on_missing(std::int64_t n)` for n positions without a row (never recorded, or stale).
  /// The rows are valid during the call only. What a route record (extract_record.hpp) and any
  /// other format written from storage are made of; files first what extract() files.
  /// @return the positions handed over
  /// @throws error as extract(), invalid_argument for include_dense_layers; what the callables throw
  template <class OnRows, class OnMissing>
  row_range for_each_row_run(request_key id, const extract_options& options, OnRows&& on_rows, OnMissing&& on_missing)
  {
    [[maybe_unused]] const auto inside = threads_.enter("for_each_row_run");
    if (options.include_dense_layers) {
      throw error{errc::invalid_argument, "request " + id.to_string() +
                                            ": rows are handed over as stored, captured layers only; "
                                            "include_dense_layers needs extract()"};
    }
    const auto [h, begin, end] = select_rows(id, options);
    filer_.store().for_each_run(h, begin, end - begin, on_rows, on_missing);
    return {begin, end};
  }

  /// @brief Block-slot storage: files every step in flight, then copies the rows of whole KV blocks
  /// into `out` ([blocks.size() * block_size, L, K]; rows never recorded hold the sentinel), so
  /// they can follow their KV to another tier or instance (prefill/decode disaggregation).
  /// @throws error slot_out_of_range, invalid_argument (`out` too small), invalid_state (a step is
  /// open); as drain()
  void export_blocks(std::span<const std::int64_t> blocks, std::span<Index> out)
    requires(Store::slot_indexed)
  {
    [[maybe_unused]] const auto inside = threads_.enter("export_blocks");
    filer_.check_block_transfer("export_blocks", blocks, out.size(), planner_.is_open());
    derived().file_through(~std::uint64_t{0});
    filer_.store().export_blocks(blocks, out.data());
  }

  /// @brief Block-slot storage: fills whole KV blocks with rows exported by export_blocks()
  /// (here or on another instance). The blocks become fresh first, so older mappings to them go
  /// stale; requests reach the imported rows through prefix hits (cached_slots).
  /// @throws error as export_blocks()
  void import_blocks(std::span<const std::int64_t> blocks, std::span<const Index> rows)
    requires(Store::slot_indexed)
  {
    [[maybe_unused]] const auto inside = threads_.enter("import_blocks");
    filer_.check_block_transfer("import_blocks", blocks, rows.size(), planner_.is_open());
    derived().file_through(~std::uint64_t{0});  // rows on their way to these blocks are older
    filer_.store().import_blocks(blocks, rows.data());
  }

  /// @brief Block-slot storage: the rows of block `source[i]` move with its KV to block
  /// `destination[i]` (offload and reload under a new block id). Destinations become fresh.
  /// @throws error as export_blocks(), and invalid_argument for lists of different lengths or a
  /// block that is both a source and a destination
  void copy_blocks(std::span<const std::int64_t> source, std::span<const std::int64_t> destination)
    requires(Store::slot_indexed)
  {
    [[maybe_unused]] const auto inside = threads_.enter("copy_blocks");
    filer_.check_block_copy(source, destination);
    std::vector<Index> rows(source.size() * static_cast<std::size_t>(filer_.store().block_elems()));
    export_blocks(source, rows);
    import_blocks(destination, rows);
  }

  /// @brief Forgets a finished request and frees its rows (block-slot rows stay at their slots
  /// for later prefix hits).
  /// @throws error unknown_request, invalid_state if the open step schedules it (use abort)
  void release(request_key id)
  {
    [[maybe_unused]] const auto inside = threads_.enter("release");
    const std::uint32_t h = requests_.find(id);
    if (planner_.schedules(requests_[h])) {
      throw error{errc::invalid_state, "request " + id.to_string() +
                                         " is scheduled in the open step; end the step first, or abort it"};
    }
    filer_.close(h, requests_);
  }

  /// @brief Drops a request at any time. Per-request storage drops its rows, including those of
  /// the open step and those still in flight; block-slot storage keeps the rows of every step that
  /// began at their slots, for other requests' prefix hits.
  /// @throws error unknown_request
  void abort(request_key id)
  {
    [[maybe_unused]] const auto inside = threads_.enter("abort");
    filer_.close(requests_.find(id), requests_);
  }
  /// @}

 protected:
  /// @brief Validates the configuration for `Index` and creates the host store; the planner's
  /// records keep their op lists in `ops_memory` (see step_planner).
  /// @throws error invalid_config, index_type_too_narrow, host_memory_exhausted
  explicit host_side(replay_config config, std::pmr::memory_resource* ops_memory = std::pmr::new_delete_resource())
    : config_(detail::validated_config<Index>(std::move(config))),
      filer_(config_, layer_map{config_}),
      reader_(config_, filer_.layers()),
      planner_(config_, ops_memory)
  {
  }

  /// @brief Marks the calling thread inside the object until the returned guard goes (debug
  /// builds: one thread drives it); every public call of the object takes one.
  /// @throws error invalid_state if another thread is inside
  [[nodiscard]] auto enter(const char* what) { return threads_.enter(what); }

  /// @brief The filing sink a copy pipeline hands its steps to (Backend names its stagings).
  template <class Backend>
  [[nodiscard]] auto filing() noexcept
  {
    return filer_.template sink<Backend>(requests_, accepted_drafts_committed());
  }

  /// @brief What filing calls when a step it files commits drafts accepted before (rows claimed
  /// when a step begins): readers of an open step that schedules the request count them too.
  [[nodiscard]] auto accepted_drafts_committed() noexcept
  {
    return [this](std::uint32_t h, std::int64_t committed_through) noexcept { count_for_open_step(h, committed_through); };
  }

  /// @brief Rows of request `h` through `committed_through` were committed outside the open step
  /// (a prefix bound, drafts accepted): where that step schedules the request, its readers count
  /// them at once.
  void count_for_open_step(std::uint32_t h, std::int64_t committed_through) noexcept
  {
    if (planner_.schedules(requests_[h])) { planner_.count_committed_rows(h, committed_through); }
  }

  replay_config config_;         ///< the validated configuration
  detail::thread_check threads_;  ///< debug builds: one thread at a time inside
  request_registry requests_;    ///< live requests
  filer_type filer_;             ///< host storage (with device scatter, what a kernel writes)
  reader_type reader_;           ///< reads rows back
  step_planner<Index> planner_;  ///< the open step

 private:
  [[nodiscard]] Derived& derived() noexcept { return static_cast<Derived&>(*this); }

  // The open step's serial, 0 when none is open.
  [[nodiscard]] std::uint64_t open_serial() const noexcept { return planner_.is_open() ? planner_.latest_serial() : 0; }

  // The last step whose rows reading request `h` must see filed. Per-request rows are written by
  // the request's own steps only. Slots are shared through the prefix cache, and any ended step may
  // have claimed one this request reads (a recompute that replaces its row, or the first row of a
  // slot it bound empty), so all of them are filed (CORE-BUG-15); the open step's claims read as
  // before it (block_slot_store::valid_row).
  [[nodiscard]] std::uint64_t rows_read_through(std::uint32_t h) const noexcept
  {
    if constexpr (Store::slot_indexed) {
      return std::max(requests_[h].reads_step, planner_.ended_serial());
    } else {
      return requests_[h].reads_step;
    }
  }

  // The rows an extraction returns: the request's handle and positions [begin, end).
  struct row_selection { std::uint32_t handle; std::int64_t begin, end; };
  [[nodiscard]] row_selection select_rows(request_key id, const extract_options& options)
  {
    const std::uint32_t h = requests_.find(id);
    derived().file_through(rows_read_through(h));
    const auto [begin, end] = reader_.extraction_range(id, h, options, requests_, planner_.open_step());
    return {h, begin, end};
  }
};

}  // namespace routing_replay
