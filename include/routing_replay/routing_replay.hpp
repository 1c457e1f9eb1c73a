/// @file
/// RoutingReplay: the owning object an engine instantiates from policies to capture, move, file
/// and return routed experts. Plain C++20; include routing_replay/routing_replay.cuh for CUDA.
///
/// It composes the parts of the data path, each in its own header under data_path/; one row goes
/// through them in this order:
/// 1. request_registry (request_registry.hpp): requests that asked for their routing;
/// 2. step_planner (step_planner.hpp): an engine's step_plan → the step's record (rows, positions,
///    slots, drafts, claims);
/// 3. capture_buffer (capture_buffer.hpp): the device buffer D, written by capture(),
///    layer_view() and ref() during the forward; the end-of-step kernel checks, snapshots, resets;
/// 4. copy_pipeline (copy_pipeline.hpp): the snapshot leaves the device through a ring of slots,
///    as the copy strategy says;
/// 5. row_filer (row_filer.hpp): rows are filed into host storage, drafts resolved;
/// 6. row_reader (row_reader.hpp): a request's rows come back out, a view or a copy.
#pragma once

#include <routing_replay/backend.hpp>
#include <routing_replay/buffer_layout.hpp>
#include <routing_replay/copy_strategy.hpp>
#include <routing_replay/data_path/capture_buffer.hpp>
#include <routing_replay/data_path/copy_pipeline.hpp>
#include <routing_replay/data_path/row_filer.hpp>
#include <routing_replay/data_path/row_reader.hpp>
#include <routing_replay/data_path/step_planner.hpp>
#include <routing_replay/detail/thread_check.hpp>
#include <routing_replay/detail/validate_config.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/host_backend.hpp>
#include <routing_replay/host_storage.hpp>
#include <routing_replay/layer_map.hpp>
#include <routing_replay/routed_experts.hpp>
#include <routing_replay/step_plan.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

namespace routing_replay {

/// @brief Captures, per token and per MoE layer, the top-k experts a router chose; moves them off
/// the device; files them per request; hands them back when the request finishes. Policies: see
/// backend.hpp, index_type.hpp, buffer_layout.hpp, copy_strategy.hpp and host_storage.hpp.
///
/// One engine step: begin_step(plan) → forward with capture()/layer_view()/ref() → end_step().
/// With a deferred strategy a step's rows are filed at a later end_step(); extraction and the other
/// calls that read rows first file whatever is still in flight for them (and no more).
/// Owning and move-only; not thread-safe (one host thread drives it, as engines do); every
/// asynchronous operation takes the engine's stream explicitly.
template <backend Backend,
          expert_index Index   = std::int16_t,
          buffer_layout Layout = layer_major,
          copy_strategy Copy   = sync_copy,
          host_storage Storage = per_request_storage>
class RoutingReplay {
  using store_type    = host_store<Storage, Backend, Index, Copy::site == scatter_site::device>;
  using buffer_type   = capture_buffer<Backend, Index, Layout>;
  using pipeline_type = copy_pipeline<Backend, Index, Copy>;
  using filer_type    = row_filer<Index, store_type, Copy::site>;
  using reader_type   = row_reader<Index, store_type, filer_type::claims_when_planned>;

 public:
  using backend_type    = Backend;                              ///< the backend policy
  using index_type      = Index;                                ///< the stored id type
  using layout_type     = Layout;                               ///< the device-buffer layout
  using copy_type       = Copy;                                 ///< the copy strategy
  using storage_type    = Storage;                              ///< the host-storage policy
  using stream_ref      = typename Backend::stream_ref;         ///< stream handle taken by every call
  using ref_type        = device_ref<Index, Layout>;            ///< trivially copyable device reference
  using result_type     = routed_experts<Index>;                ///< what extract() returns
  using layer_view_type = typename buffer_type::layer_view_type;  ///< per-layer [rows, K] view of D

  /// @brief Validates the configuration and allocates D, the ring of Copy::ring_depth snapshots
  /// and stagings, and (block-slot) the pool. Strategies with a side stream create their own.
  /// @throws error invalid_config, index_type_too_narrow, host_memory_exhausted, backend_error
  explicit RoutingReplay(replay_config config) : RoutingReplay(std::move(config), std::nullopt) {}

  /// @brief As above, with copies on the engine's `copy_stream` (strategies with a side stream;
  /// the stream must outlive this object and should not be the compute stream).
  RoutingReplay(replay_config config, stream_ref copy_stream)
    requires(Copy::uses_side_stream)
    : RoutingReplay(std::move(config), std::optional<stream_ref>{copy_stream})
  {
  }

  /// @brief Moves the buffers: device references handed out and the copy stream stay valid.
  RoutingReplay(RoutingReplay&&) noexcept = default;
  /// @brief Move assignment; first waits for every copy the replaced object has in flight (its
  /// unfiled steps are lost: drain() it first to keep them), then frees its buffers.
  RoutingReplay& operator=(RoutingReplay&& other) noexcept
  {
    if (this != &other) {  // member-wise, buffers would go while copies still write them
      std::destroy_at(this);
      std::construct_at(this, std::move(other));
    }
    return *this;
  }
  RoutingReplay(const RoutingReplay&)            = delete;
  RoutingReplay& operator=(const RoutingReplay&) = delete;
  /// @brief Waits for every copy in flight (unfiled steps are dropped), then frees everything.
  ~RoutingReplay() = default;

  /// @name Shape
  /// @{
  /// @brief The configuration, as validated.
  [[nodiscard]] const replay_config& config() const noexcept { return config_; }
  /// @brief L: captured MoE layers.
  [[nodiscard]] std::int32_t num_layers() const noexcept { return buffer_.layers().num_layers(); }
  /// @brief K.
  [[nodiscard]] std::int32_t top_k() const noexcept { return config_.top_k; }
  /// @brief Ids per row (L * K).
  [[nodiscard]] std::int64_t row_size() const noexcept { return filer_.row_elems(); }
  /// @brief Bytes of the device buffer D: N_max * L * K * sizeof(Index) (capture paths write it).
  [[nodiscard]] std::size_t device_bytes() const noexcept { return buffer_.bytes(); }
  /// @brief Bytes of the device snapshots the copies read: Copy::ring_depth more buffers like D.
  [[nodiscard]] std::size_t snapshot_bytes() const noexcept { return pipeline_.snapshot_bytes(); }
  /// @brief Steps whose rows are still in flight (copied or scattered, not yet filed).
  [[nodiscard]] std::size_t steps_in_flight() const noexcept { return pipeline_.size(); }
  /// @brief Bytes of host row storage in use.
  [[nodiscard]] std::size_t host_bytes() const noexcept { return filer_.store().bytes_in_use(); }
  /// @brief Live requests.
  [[nodiscard]] std::size_t num_requests() const noexcept { return requests_.size(); }
  /// @brief The captured index (layer slot) of a model layer.
  /// @throws error unknown_layer if the layer map does not capture it.
  [[nodiscard]] std::int32_t layer_slot(std::int32_t model_layer) const { return buffer_.layers().slot(model_layer); }
  /// @}

  /// @name Requests
  /// @{
  /// @brief Registers a request that asked for its routing. Requests that did not ask are never
  /// added and their tokens are skip()ped in plans: they cost nothing on the host.
  /// @throws error duplicate_request, slot_out_of_range (cached slots), position_out_of_range
  void add_request(request_key id, const request_options& options = {})
  {
    [[maybe_unused]] const auto inside = threads_.enter("add_request");
    filer_.check_cached_prefix(id, options.cached_slots);
    const std::uint32_t h = requests_.add(id);  // throws duplicate_request
    filer_.store().open(h);
    requests_[h].prompt_length = options.prompt_length;
    filer_.bind_cached_prefix(h, options.cached_slots, requests_, planner_.latest_serial());
  }

  /// @brief A live request (re)starts with positions [0, cached_slots.size()) from the prefix cache
  /// (re-admitted after preemption): block-slot storage binds them to the slots unless it holds a
  /// row for them (first write wins); per-request storage has no rows for them (missing).
  /// @throws error unknown_request, slot_out_of_range, position_out_of_range
  void add_cached_prefix(request_key id, std::span<const std::int64_t> cached_slots)
  {
    [[maybe_unused]] const auto inside = threads_.enter("add_cached_prefix");
    const std::uint32_t h = requests_.find(id);
    filer_.check_cached_prefix(id, cached_slots);
    filer_.bind_cached_prefix(h, cached_slots, requests_, planner_.latest_serial());
  }

  /// @brief Whether a request is live.
  [[nodiscard]] bool contains(request_key id) const { return requests_.contains(id); }

  /// @brief T: one past the highest committed position of a request (files the request's steps
  /// still in flight first).
  /// @throws error unknown_request; as drain() for a step filed on the way
  [[nodiscard]] std::int64_t recorded_rows(request_key id)
  {
    [[maybe_unused]] const auto inside = threads_.enter("recorded_rows");
    const std::uint32_t h = requests_.find(id);
    pipeline_.drain(filing(), requests_[h].reads_step);  // what the request's rows may wait for
    return reader_.readable_rows(h, requests_, planner_.open_step());
  }

  /// @brief Resolves the oldest pending draft group of a request: the first `num_accepted` drafts
  /// are committed, the rest are erased (their positions will be recomputed).
  /// @throws error unknown_request, draft_error
  void accept_draft(request_key id, std::int32_t num_accepted)
  {
    [[maybe_unused]] const auto inside = threads_.enter("accept_draft");
    filer_.accept_draft(id, requests_.find(id), num_accepted, requests_);
  }

  /// @brief A request's routing, rows [start_position, end_position): typically at finish, but any
  /// live request may be extracted (rows of an open step are not included).
  ///
  /// First files the steps still in flight that the request's rows depend on, and no later ones.
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

  /// @brief Block-slot storage: files every step in flight, then copies whole KV blocks' rows into
  /// `out` ([blocks.size() * block_size, L, K]; the sentinel where none), so they can follow their
  /// KV to another tier or instance (prefill/decode disaggregation).
  /// @throws error slot_out_of_range, invalid_argument (`out` too small), invalid_state; as drain()
  void export_blocks(std::span<const std::int64_t> blocks, std::span<Index> out)
    requires(store_type::slot_indexed)
  {
    [[maybe_unused]] const auto inside = threads_.enter("export_blocks");
    filer_.check_block_transfer("export_blocks", blocks, out.size(), planner_.is_open());
    drain();
    filer_.store().export_blocks(blocks, out.data());
  }

  /// @brief Block-slot storage: fills whole KV blocks with rows exported by export_blocks()
  /// (here or on another instance). The blocks become fresh first, so older mappings to them go
  /// stale; requests reach the imported rows through prefix hits (cached_slots).
  /// @throws error as export_blocks()
  void import_blocks(std::span<const std::int64_t> blocks, std::span<const Index> rows)
    requires(store_type::slot_indexed)
  {
    [[maybe_unused]] const auto inside = threads_.enter("import_blocks");
    filer_.check_block_transfer("import_blocks", blocks, rows.size(), planner_.is_open());
    drain();  // rows still on their way to these blocks belong to their previous generation
    filer_.store().import_blocks(blocks, rows.data());
  }

  /// @brief Block-slot storage: the rows of block `source[i]` move with its KV to block
  /// `destination[i]` (offload and reload under a new block id). Destinations become fresh.
  /// @throws error as export_blocks(), and invalid_argument for lists of different lengths or a
  /// block that is both a source and a destination
  void copy_blocks(std::span<const std::int64_t> source, std::span<const std::int64_t> destination)
    requires(store_type::slot_indexed)
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

  /// @name Steps
  /// @{
  /// @brief Opens a step: validates the plan and reserves host storage. All host errors of a step
  /// surface here, before any change. Block-slot storage takes the step's fresh blocks now, and
  /// device_scatter decides where every row of the step will go.
  /// @throws error invalid_state, too_many_tokens, unknown_request, duplicate_request,
  /// position_out_of_range, slot_out_of_range, invalid_plan, host_memory_exhausted
  void begin_step(const step_plan& plan, stream_ref compute)
  {
    [[maybe_unused]] const auto inside = threads_.enter("begin_step");
    planner_.validate(plan, requests_, filer_);
    buffer_.begin_step(plan.num_rows(), compute);
    planner_.open(plan, requests_, filer_);  // commits: nothing past validate() throws a library error
  }

  /// @brief Closes the step after its forward has been enqueued on `compute`: one kernel on
  /// `compute` checks rows [0, N), snapshots them and resets D (the next forward may start at
  /// once); the copy reads the snapshot; then steps are filed as the copy strategy says
  /// (copy_pipeline::push: sync_copy waits and files this step, the others file earlier ones).
  /// @throws error invalid_state; invalid_expert_id, missing_routing, invalid_argument when the
  /// device reported a problem in the step filed (this one with sync_copy, an earlier one
  /// otherwise; the message names it, and it is discarded as a whole); backend_error
  void end_step(stream_ref compute)
  {
    [[maybe_unused]] const auto inside = threads_.enter("end_step");
    auto harvest = [this](const step_record<Index>& closed, Index* snapshot, detail::step_status* status,
                          stream_ref s) { buffer_.end_step(snapshot, status, closed.num_rows, closed.padded_rows, s); };
    pipeline_.push(planner_.close(), harvest, compute, filing());
  }

  /// @brief Files every step still in flight, waiting for their copies.
  /// @throws error as end_step() for a device-reported problem in one of them (the steps after it
  /// stay in flight: call drain() again); backend_error
  void drain()
  {
    [[maybe_unused]] const auto inside = threads_.enter("drain");
    pipeline_.drain(filing());
  }

  /// @brief Resets every row capture paths were handed to the sentinel, on `stream`. Needed only
  /// when an engine replays a recorded forward outside any step (a warm-up graph replay); capture
  /// calls made outside a step are reset automatically at the next begin_step().
  void reset_device_buffer(stream_ref stream)
  {
    [[maybe_unused]] const auto inside = threads_.enter("reset_device_buffer");
    if (planner_.is_open()) {
      throw error{errc::invalid_state, "reset_device_buffer inside an open step would erase it"};
    }
    buffer_.reset(stream);
  }
  /// @}

  /// @name Capture paths (all CUDA-graph safe: fixed addresses, no host sync, no allocation)
  /// @{
  /// @brief (a) Records a layer's router output: the first K columns of `topk_ids`, a row-major
  /// [num_tokens, K + num_fused_shared_experts] device array of any integer type, narrowed once to
  /// Index. One small kernel on `stream`.
  /// @throws error unknown_layer, too_many_tokens, invalid_argument
  template <source_index Source>
  void capture(std::int32_t model_layer,
               const Source* topk_ids,
               std::int64_t num_tokens,
               stream_ref stream,
               const capture_options& options = {})
  {
    [[maybe_unused]] const auto inside = threads_.enter("capture");
    buffer_.capture(model_layer, topk_ids, num_tokens, stream, options);
  }

  /// @brief (b) The [num_rows, K] slab of D for a model layer, for kernels that write routing
  /// themselves (FlashInfer's routing_replay_out: pass layer_view(l, n).data_handle() with
  /// layer_major and Index = int16_t). No range check happens at the write; end_step() checks.
  /// @throws error unknown_layer, too_many_tokens
  [[nodiscard]] layer_view_type layer_view(std::int32_t model_layer, std::int64_t num_rows)
  {
    [[maybe_unused]] const auto inside = threads_.enter("layer_view");
    return buffer_.layer_view(model_layer, num_rows);
  }

  /// @brief (c) A trivially copyable device reference whose record() an engine's own top-k kernel
  /// calls inline: zero extra launches. `num_rows` bounds the rows it may write.
  /// @throws error too_many_tokens
  [[nodiscard]] ref_type ref(std::int64_t num_rows)
  {
    [[maybe_unused]] const auto inside = threads_.enter("ref");
    return buffer_.ref(num_rows);
  }
  /// @}

 private:
  // Where the copy pipeline hands the steps that leave its ring: the filer, over the live requests.
  [[nodiscard]] auto filing() noexcept { return filer_.template sink<Backend>(requests_); }

  RoutingReplay(replay_config config, std::optional<stream_ref> copy_stream)
    : config_(detail::validated_config<Index>(std::move(config))),
      buffer_(config_, layer_map{config_}),
      filer_(config_, buffer_.layers()),
      reader_(config_, buffer_.layers()),
      planner_(config_),
      pipeline_(static_cast<std::size_t>(config_.max_tokens_per_step),
                static_cast<std::size_t>(filer_.row_elems()),
                copy_stream)
  {
  }

  // The rows an extraction returns: the request's handle and positions [begin, end).
  struct row_selection { std::uint32_t handle; std::int64_t begin, end; };
  row_selection select_rows(request_key id, const extract_options& options)
  {
    const std::uint32_t h   = requests_.find(id);
    pipeline_.drain(filing(), requests_[h].reads_step);  // what the request's rows may wait for
    const auto [begin, end] = reader_.extraction_range(id, h, options, requests_, planner_.open_step());
    return {h, begin, end};
  }

  replay_config config_;
  detail::thread_check threads_;  // debug builds: one thread at a time inside
  buffer_type buffer_;          // D and the capture paths
  request_registry requests_;   // live requests
  filer_type filer_;            // host storage (with device scatter, what the pipeline writes)
  reader_type reader_;          // reads rows back
  step_planner<Index> planner_;  // the open step
  // Last: destroyed first, it waits for every copy in flight while what they write (stagings, the
  // storage of a device scatter) and the stream they run on still exist.
  pipeline_type pipeline_;
};

}  // namespace routing_replay
