/// @file
/// RoutingReplay: the owning object an engine instantiates from policies to capture, move, file
/// and return routed experts. Plain C++20; include routing_replay/routing_replay.cuh for CUDA.
#pragma once

#include <routing_replay/backend.hpp>
#include <routing_replay/buffer_layout.hpp>
#include <routing_replay/config.hpp>
#include <routing_replay/copy_strategy.hpp>
#include <routing_replay/detail/copy_ring.hpp>
#include <routing_replay/detail/kernels.hpp>
#include <routing_replay/detail/requests.hpp>
#include <routing_replay/detail/step_status.hpp>
#include <routing_replay/device_ref.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/host_backend.hpp>
#include <routing_replay/host_storage.hpp>
#include <routing_replay/index_type.hpp>
#include <routing_replay/routed_experts.hpp>
#include <routing_replay/step_plan.hpp>

#include <cuda/std/array>
#include <cuda/std/mdspan>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace routing_replay {

/// @brief Options of capture().
struct capture_options {
  /// @brief Elements between consecutive rows of the router output; 0 means K plus
  /// num_fused_shared_experts (the shared-expert columns that follow the first K are skipped).
  std::int64_t source_row_stride = 0;
  /// @brief Data parallel with naive dispatch: the router output holds every rank's tokens and
  /// this rank's rows start here.
  std::int64_t source_row_offset = 0;
  /// @brief Device map from physical expert (after EPLB replication) to logical expert; nullptr
  /// when the router already yields logical ids.
  const std::int32_t* physical_to_logical = nullptr;
  /// @brief Entries of physical_to_logical.
  std::int64_t num_physical_experts = 0;
};

/// @brief Captures, per token and per MoE layer, the top-k experts a router chose; moves them off
/// the device; files them per request; hands them back when the request finishes.
///
/// Compile-time policies:
/// - Backend: cuda_backend (routing_replay.cuh) or host_backend;
/// - Index: the integer type of stored ids (expert_index), with a sentinel for missing rows;
/// - Layout: layer_major or token_major order of the device buffer D (buffer_layout);
/// - Copy: how rows leave D and when they are filed (copy_strategy): sync_copy, async_event,
///   double_buffered<Depth>, device_scatter<Depth>;
/// - Storage: per_request_storage or block_slot_storage (host_storage).
///
/// One engine step: begin_step(plan) → forward with capture()/layer_view()/ref() → end_step().
/// With a deferred strategy a step's rows are filed at a later end_step(); extraction and the other
/// calls that read rows first file whatever is still in flight for them (and no more).
/// Owning and move-only; not thread-safe (one host thread drives it, as engines do); every
/// asynchronous operation takes the engine's stream explicitly, and the side stream copies run on
/// can be the engine's too.
template <backend Backend,
          expert_index Index     = std::int16_t,
          buffer_layout Layout   = layer_major,
          copy_strategy Copy     = sync_copy,
          host_storage Storage   = per_request_storage>
class RoutingReplay {
  static constexpr bool device_scatters = Copy::site == scatter_site::device;
  static_assert(!device_scatters || Storage::stable_row_addresses,
                "device_scatter has a kernel write rows straight into host storage while the host "
                "plans later steps, so row addresses must never move; per_request_storage grows "
                "each request's array by reallocation. Use block_slot_storage with device_scatter, "
                "or a host-scatter strategy (sync_copy, async_event, double_buffered) with "
                "per_request_storage.");

  using traits      = index_traits<Index>;
  using pool_vector = std::conditional_t<device_scatters,
                                         typename Backend::template pinned_vector<Index>,
                                         std::vector<Index>>;
  using store_type  = typename Storage::template store<Index, pool_vector>;
  using ring_type   = detail::copy_ring<Backend, Index>;
  // Slot-indexed rows are shared between requests through the prefix cache, and whether a row
  // follows its position to a new slot depends on the blocks as they were when the step was
  // planned: such stores claim rows when the step begins, and filing only moves data. Per-request
  // rows depend on nothing but their own request's earlier steps: they are claimed when filed.
  static constexpr bool claims_when_planned = store_type::slot_indexed;
  using slot_type   = detail::ring_slot<Backend, Index>;
  using step_type   = detail::step_record<Index>;
  using run_type    = detail::step_run;

 public:
  using backend_type  = Backend;   ///< the backend policy
  using index_type    = Index;     ///< the stored id type
  using layout_type   = Layout;    ///< the device-buffer layout
  using copy_type     = Copy;      ///< the copy strategy
  using storage_type  = Storage;   ///< the host-storage policy
  using stream_ref    = typename Backend::stream_ref;  ///< stream handle taken by every call
  using ref_type      = device_ref<Index, Layout>;     ///< trivially copyable device reference
  using result_type   = routed_experts<Index>;          ///< what extract() returns
  /// @brief Per-layer [rows, K] view of D: contiguous row-major for layer_major (meets FlashInfer's
  /// routing_replay_out contract when Index is int16_t), strided for token_major.
  using layer_view_type = cuda::std::mdspan<
    Index,
    cuda::std::dextents<std::int64_t, 2>,
    std::conditional_t<layout_traits<Layout>::token_rows_contiguous,
                       cuda::std::layout_stride,
                       cuda::std::layout_right>>;

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

  /// @brief Moves the buffers; device references handed out earlier stay valid (same memory), and
  /// so does the stream copies run on.
  RoutingReplay(RoutingReplay&&) noexcept = default;
  /// @brief Move assignment; first waits for every copy the replaced object has in flight (its
  /// unfiled steps are lost: drain() it first to keep them), then frees its buffers.
  RoutingReplay& operator=(RoutingReplay&& other) noexcept
  {
    if (this != &other) {
      // member-wise assignment would free buffers and the pool while copies still write them;
      // destruction waits for the copies first (the ring is destroyed first)
      std::destroy_at(this);
      std::construct_at(this, std::move(other));
    }
    return *this;
  }
  RoutingReplay(const RoutingReplay&)                = delete;
  RoutingReplay& operator=(const RoutingReplay&)     = delete;
  /// @brief Waits for every copy in flight (unfiled steps are dropped), then frees everything.
  ~RoutingReplay() = default;

  // ---------------------------------------------------------------------------------------------
  /// @name Shape
  /// @{

  /// @brief The configuration, as validated.
  [[nodiscard]] const replay_config& config() const noexcept { return config_; }
  /// @brief L: captured MoE layers.
  [[nodiscard]] std::int32_t num_layers() const noexcept { return num_layers_; }
  /// @brief K.
  [[nodiscard]] std::int32_t top_k() const noexcept { return config_.top_k; }
  /// @brief Ids per row (L * K).
  [[nodiscard]] std::int64_t row_size() const noexcept { return row_elems_; }
  /// @brief Bytes of the device buffer D: N_max * L * K * sizeof(Index) (capture paths write it).
  [[nodiscard]] std::size_t device_bytes() const noexcept { return buffer_.size() * sizeof(Index); }
  /// @brief Bytes of the device snapshots the copies read: Copy::ring_depth more buffers like D.
  [[nodiscard]] std::size_t snapshot_bytes() const noexcept
  {
    return static_cast<std::size_t>(Copy::ring_depth) * buffer_.size() * sizeof(Index);
  }
  /// @brief Steps whose rows are still in flight (copied or scattered, not yet filed).
  [[nodiscard]] std::size_t steps_in_flight() const noexcept { return ring_.size(); }
  /// @brief Bytes of host row storage in use.
  [[nodiscard]] std::size_t host_bytes() const noexcept { return store_.bytes_in_use(); }
  /// @brief Live requests.
  [[nodiscard]] std::size_t num_requests() const noexcept { return requests_.size(); }

  /// @brief The captured index (layer slot) of a model layer.
  /// @throws error unknown_layer if the layer map does not capture it.
  [[nodiscard]] std::int32_t layer_slot(std::int32_t model_layer) const
  {
    if (model_layer < 0 || model_layer >= static_cast<std::int32_t>(layer_slots_.size()) ||
        layer_slots_[static_cast<std::size_t>(model_layer)] < 0) {
      throw error{errc::unknown_layer,
                  "model layer " + std::to_string(model_layer) +
                    " is not captured (the layer map captures " + layer_list() + ")"};
    }
    return layer_slots_[static_cast<std::size_t>(model_layer)];
  }
  /// @}

  // ---------------------------------------------------------------------------------------------
  /// @name Requests
  /// @{

  /// @brief Registers a request that asked for its routing. Requests that did not ask are never
  /// added and their tokens are skip()ped in plans: they cost nothing on the host.
  /// @throws error duplicate_request, slot_out_of_range (cached slots), position_out_of_range
  void add_request(request_key id, const request_options& options = {})
  {
    check_cached_prefix(id, options.cached_slots);
    const std::uint32_t h = requests_.add(id);  // throws duplicate_request
    store_.open(h);
    auto& r         = requests_[h];
    r.prompt_length = options.prompt_length;
    bind_cached_prefix(h, options.cached_slots);
  }

  /// @brief A live request (re)starts with positions [0, cached_slots.size()) served from the
  /// prefix cache, e.g. when it is re-admitted after preemption. Block-slot storage binds those
  /// positions to the slots unless it already holds a valid row for them (first write wins);
  /// per-request storage has no rows for cached positions it never computed (they read as missing).
  /// @throws error unknown_request, slot_out_of_range, position_out_of_range
  void add_cached_prefix(request_key id, std::span<const std::int64_t> cached_slots)
  {
    const std::uint32_t h = requests_.find(id);
    check_cached_prefix(id, cached_slots);
    bind_cached_prefix(h, cached_slots);
  }

  /// @brief Whether a request is live.
  [[nodiscard]] bool contains(request_key id) const { return requests_.contains(id); }

  /// @brief T: one past the highest committed position of a request (files the request's steps
  /// still in flight first).
  /// @throws error unknown_request; as drain() for a step filed on the way
  [[nodiscard]] std::int64_t recorded_rows(request_key id)
  {
    const std::uint32_t h = requests_.find(id);
    drain_for(h);
    return readable_rows(h);
  }

  /// @brief Resolves the oldest pending draft group of a request: the first `num_accepted` drafts
  /// are committed, the rest are erased (their positions will be recomputed).
  /// @throws error unknown_request, draft_error
  void accept_draft(request_key id, std::int32_t num_accepted)
  {
    const std::uint32_t h = requests_.find(id);
    auto& r               = requests_[h];
    auto group            = std::find_if(
      r.drafts.begin(), r.drafts.end(), [](const detail::draft_group& g) { return g.accepted < 0; });
    if (group == r.drafts.end()) {
      throw error{errc::draft_error, "request " + id.to_string() + " has no pending draft tokens"};
    }
    if (num_accepted < 0 || num_accepted > group->count) {
      throw error{errc::draft_error,
                  "request " + id.to_string() + ": accepted " + std::to_string(num_accepted) +
                    " of " + std::to_string(group->count) + " draft tokens"};
    }
    group->accepted = num_accepted;
    if (group->filed) {
      resolve_filed_group(h, *group);
      r.drafts.erase(group);
    }
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
    const std::uint32_t h = requests_.find(id);
    drain_for(h);
    const auto [begin, end] = extraction_range(id, h, options);
    const std::int64_t prompt =
      options.prompt_length >= 0 ? options.prompt_length : requests_[h].prompt_length;
    if (!options.include_dense_layers) {
      if (const Index* rows = store_.contiguous(h, begin, end - begin)) {
        return result_type{rows, end - begin, num_layers_, config_.top_k, begin, prompt};
      }
    }
    std::vector<Index> copy(static_cast<std::size_t>((end - begin) * output_row_size(options)));
    copy_rows(h, begin, end, options, copy.data());
    return result_type{std::move(copy),
                       end - begin,
                       options.include_dense_layers ? num_model_layers() : num_layers_,
                       config_.top_k,
                       begin,
                       prompt};
  }

  /// @brief Copies a request's rows into a caller buffer; returns the number of rows written.
  /// @throws error as extract(), and invalid_argument if `out` is too small
  std::int64_t extract_into(request_key id, std::span<Index> out, const extract_options& options = {})
  {
    const std::uint32_t h = requests_.find(id);
    drain_for(h);
    const auto [begin, end] = extraction_range(id, h, options);
    const std::int64_t need = (end - begin) * output_row_size(options);
    if (static_cast<std::int64_t>(out.size()) < need) {
      throw error{errc::invalid_argument,
                  "extract_into: request " + id.to_string() + " needs " + std::to_string(need) +
                    " elements, the buffer has " + std::to_string(out.size())};
    }
    copy_rows(h, begin, end, options, out.data());
    return end - begin;
  }

  /// @brief Block-slot storage: copies the rows of whole KV blocks, block after block, into `out`
  /// ([blocks.size() * block_size, L, K]), so they can follow their KV to another tier or instance
  /// (prefill/decode disaggregation). Rows never recorded hold the sentinel.
  /// Files every step in flight first.
  /// @throws error slot_out_of_range (a block outside the pool), invalid_argument (`out` too small),
  /// invalid_state (a step is open); as drain()
  void export_blocks(std::span<const std::int64_t> blocks, std::span<Index> out)
    requires(store_type::slot_indexed)
  {
    check_block_transfer("export_blocks", blocks, out.size());
    drain();
    store_.export_blocks(blocks, out.data());
  }

  /// @brief Block-slot storage: fills whole KV blocks with rows exported by export_blocks()
  /// (here or on another instance). The blocks become fresh first, so older mappings to them go
  /// stale; requests reach the imported rows through prefix hits (cached_slots).
  /// @throws error as export_blocks()
  void import_blocks(std::span<const std::int64_t> blocks, std::span<const Index> rows)
    requires(store_type::slot_indexed)
  {
    check_block_transfer("import_blocks", blocks, rows.size());
    drain();  // rows still on their way to these blocks belong to their previous generation
    store_.import_blocks(blocks, rows.data());
  }

  /// @brief Block-slot storage: the rows of block `source[i]` move with its KV to block
  /// `destination[i]` (offload and reload under a new block id). Destinations become fresh.
  /// @throws error as export_blocks(), and invalid_argument for lists of different lengths or a
  /// block that is both a source and a destination
  void copy_blocks(std::span<const std::int64_t> source, std::span<const std::int64_t> destination)
    requires(store_type::slot_indexed)
  {
    if (source.size() != destination.size()) {
      throw error{errc::invalid_argument, "copy_blocks: " + std::to_string(source.size()) +
                                            " sources for " + std::to_string(destination.size()) +
                                            " destinations"};
    }
    for (const std::int64_t d : destination) {
      if (std::find(source.begin(), source.end(), d) != source.end()) {
        throw error{errc::invalid_argument,
                    "copy_blocks: block " + std::to_string(d) + " is both a source and a destination"};
      }
    }
    std::vector<Index> rows(source.size() * static_cast<std::size_t>(store_.block_elems()));
    export_blocks(source, rows);
    import_blocks(destination, rows);
  }

  /// @brief Forgets a finished request and frees its rows (block-slot rows stay at their slots
  /// for later prefix hits).
  /// @throws error unknown_request, invalid_state if the open step schedules it (use abort)
  void release(request_key id)
  {
    const std::uint32_t h = requests_.find(id);
    if (in_step_ && requests_[h].open_step == step_serial_) {
      throw error{errc::invalid_state,
                  "request " + id.to_string() +
                    " is scheduled in the open step; end the step first, or abort it"};
    }
    retire(h);
  }

  /// @brief Drops a request at any time. Per-request storage drops its rows, including those of
  /// the open step and those still in flight; block-slot storage keeps the rows of every step that
  /// began at their slots, for other requests' prefix hits.
  /// @throws error unknown_request
  void abort(request_key id) { retire(requests_.find(id)); }
  /// @}

  // ---------------------------------------------------------------------------------------------
  /// @name Steps
  /// @{

  /// @brief Opens a step: validates the plan and reserves host storage. All host errors of a step
  /// surface here, before any change. Block-slot storage takes the step's fresh blocks now, and
  /// device_scatter decides where every row of the step will go.
  /// @throws error invalid_state, too_many_tokens, unknown_request, duplicate_request,
  /// position_out_of_range, slot_out_of_range, invalid_plan, host_memory_exhausted
  void begin_step(const step_plan& plan, stream_ref compute)
  {
    if (in_step_) {
      throw error{errc::invalid_state,
                  "begin_step: step " + std::to_string(step_serial_) +
                    " is still open; call end_step first"};
    }
    if (plan.num_rows() > config_.max_tokens_per_step) {
      throw error{errc::too_many_tokens,
                  "step plan has " + std::to_string(plan.num_rows()) +
                    " tokens, more than max_tokens_per_step " +
                    std::to_string(config_.max_tokens_per_step)};
    }
    validate_plan(plan);
    if (dirty_outside_steps_) {
      // a forward ran outside any step (warm-up, profiling): its rows must not pass for this step's
      reset_outside_rows(std::max(rows_outside_steps_, plan.num_rows()), compute);
    }

    // past this point nothing throws a library error: the step is committed
    build_step(plan, open_step_);
    rows_this_step_ = 0;
    in_step_        = true;
  }

  /// @brief Closes the step after its forward has been enqueued on `compute`.
  ///
  /// One kernel on `compute` checks rows [0, N) (unwritten rows, ids outside [0, E)), snapshots
  /// them and resets D, so the next forward may start at once; the copy (or, with device_scatter,
  /// the scatter kernel) reads the snapshot, on `compute` for sync_copy and on the side stream
  /// otherwise. Then sync_copy waits and files the step; async_event first files the previous step
  /// (waiting for its copy if needed); double_buffered and device_scatter file, without blocking,
  /// every earlier step whose copy has completed, and block only when the ring is full.
  /// @throws error invalid_state; invalid_expert_id, missing_routing, invalid_argument when the
  /// device reported a problem in the step filed (this one with sync_copy, an earlier one
  /// otherwise; the message names it, and it is discarded as a whole); backend_error
  void end_step(stream_ref compute)
  {
    if (!in_step_) {
      throw error{errc::invalid_state, "end_step without an open step; call begin_step first"};
    }
    in_step_ = false;
    std::exception_ptr earlier_step_error;
    if (ring_.full()) { retire_oldest_keeping(earlier_step_error); }

    slot_type& slot = ring_.next();
    std::swap(slot.step, open_step_);
    try {
      enqueue_snapshot(slot, compute);
      enqueue_copy(slot, Copy::uses_side_stream ? *copy_stream_ : compute);
    } catch (...) {
      discard(slot.step);  // the backend failed: the step's rows never arrive
      throw;
    }
    ring_.push();

    if constexpr (Copy::timing == scatter_timing::at_end_of_step) {
      retire_oldest();
    } else if constexpr (Copy::ring_depth > 1) {
      while (ring_.size() > 0 && earlier_step_error == nullptr && Backend::ready(ring_.oldest().copied)) {
        retire_oldest_keeping(earlier_step_error);
      }
    }
    if (earlier_step_error) { std::rethrow_exception(earlier_step_error); }
  }

  /// @brief Files every step still in flight, waiting for their copies.
  /// @throws error as end_step() for a device-reported problem in one of them (the steps after it
  /// stay in flight: call drain() again); backend_error
  void drain()
  {
    while (ring_.size() > 0) { retire_oldest(); }
  }

  /// @brief Resets every row capture paths were handed to the sentinel, on `stream`. Needed only
  /// when an engine replays a recorded forward outside any step (a warm-up graph replay); capture
  /// calls made outside a step are reset automatically at the next begin_step().
  void reset_device_buffer(stream_ref stream)
  {
    if (in_step_) {
      throw error{errc::invalid_state, "reset_device_buffer inside an open step would erase it"};
    }
    reset_outside_rows(std::max<std::int64_t>(rows_outside_steps_, config_.max_tokens_per_step), stream);
  }
  /// @}

  // ---------------------------------------------------------------------------------------------
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
    const std::int32_t slot = layer_slot(model_layer);
    check_rows_argument(num_tokens, "capture");
    const std::int64_t stride = options.source_row_stride != 0
                                  ? options.source_row_stride
                                  : config_.top_k + config_.num_fused_shared_experts;
    if (stride < config_.top_k || options.source_row_offset < 0 ||
        (topk_ids == nullptr && num_tokens > 0) ||
        (options.physical_to_logical != nullptr && options.num_physical_experts <= 0)) {
      throw error{errc::invalid_argument,
                  "capture: layer " + std::to_string(model_layer) + " got source_row_stride " +
                    std::to_string(stride) + " (needs >= K = " + std::to_string(config_.top_k) +
                    "), source_row_offset " + std::to_string(options.source_row_offset) +
                    (topk_ids == nullptr ? ", a null id pointer" : "") +
                    (options.physical_to_logical != nullptr && options.num_physical_experts <= 0
                       ? ", a physical map without entries"
                       : "")};
    }
    if (num_tokens == 0) { return; }
    note_rows_written(num_tokens);
    Backend::bulk_async(num_tokens * config_.top_k,
                        detail::capture_layer<Index, Layout, Source>{
                          make_ref(static_cast<std::int32_t>(num_tokens)),
                          topk_ids + options.source_row_offset * stride,
                          stride,
                          options.physical_to_logical,
                          options.num_physical_experts,
                          slot,
                          config_.top_k},
                        stream);
  }

  /// @brief (b) The [num_rows, K] slab of D for a model layer, for kernels that write routing
  /// themselves (FlashInfer's routing_replay_out: pass layer_view(l, n).data_handle() with
  /// layer_major and Index = int16_t). No range check happens at the write; end_step() checks.
  /// @throws error unknown_layer, too_many_tokens
  [[nodiscard]] layer_view_type layer_view(std::int32_t model_layer, std::int64_t num_rows)
  {
    const std::int32_t slot = layer_slot(model_layer);
    check_rows_argument(num_rows, "layer_view");
    note_rows_written(num_rows);
    auto whole = buffer_view();
    Index* base = &whole(slot, 0, 0);
    if constexpr (layout_traits<Layout>::token_rows_contiguous) {
      using mapping = typename cuda::std::layout_stride::template mapping<
        cuda::std::dextents<std::int64_t, 2>>;
      return layer_view_type{
        base,
        mapping{cuda::std::dextents<std::int64_t, 2>{num_rows, config_.top_k},
                cuda::std::array<std::int64_t, 2>{row_elems_, 1}}};
    } else {
      return layer_view_type{base, num_rows, config_.top_k};
    }
  }

  /// @brief (c) A trivially copyable device reference whose record() an engine's own top-k kernel
  /// calls inline: zero extra launches. `num_rows` bounds the rows it may write.
  /// @throws error too_many_tokens
  [[nodiscard]] ref_type ref(std::int64_t num_rows)
  {
    check_rows_argument(num_rows, "ref");
    note_rows_written(num_rows);
    return make_ref(static_cast<std::int32_t>(num_rows));
  }
  /// @}

 private:
  // The delegated-to constructor: `copy_stream` empty means "create one if the strategy uses one".
  RoutingReplay(replay_config config, std::optional<stream_ref> copy_stream)
    : config_(validated(std::move(config))),
      num_layers_(static_cast<std::int32_t>(config_.moe_layers.size())),
      row_elems_(static_cast<std::int64_t>(num_layers_) * config_.top_k),
      layer_slots_(layer_slots_of(config_)),
      buffer_(static_cast<std::size_t>(config_.max_tokens_per_step) *
                static_cast<std::size_t>(row_elems_),
              traits::sentinel),
      device_status_(1),
      store_(config_, row_elems_),
      ring_(Copy::ring_depth,
            static_cast<std::size_t>(config_.max_tokens_per_step),
            static_cast<std::size_t>(row_elems_),
            !device_scatters)
  {
    if constexpr (Copy::uses_side_stream) {
      if (copy_stream) {
        copy_stream_ = copy_stream;
      } else {
        own_copy_stream_.emplace();
        copy_stream_.emplace(own_copy_stream_->ref());
      }
    }
  }

  // -- configuration ------------------------------------------------------------------------------

  static replay_config validated(replay_config c)
  {
    auto fail = [](const std::string& what) { throw error{errc::invalid_config, what}; };
    if (c.num_experts <= 0) { fail("num_experts must be > 0, got " + std::to_string(c.num_experts)); }
    if (c.top_k <= 0) { fail("top_k must be > 0, got " + std::to_string(c.top_k)); }
    if (c.num_fused_shared_experts < 0) {
      fail("num_fused_shared_experts must be >= 0, got " +
           std::to_string(c.num_fused_shared_experts));
    }
    if (c.max_tokens_per_step <= 0) {
      fail("max_tokens_per_step must be > 0, got " + std::to_string(c.max_tokens_per_step));
    }
    if (c.max_model_len <= 0) { fail("max_model_len must be > 0, got " + std::to_string(c.max_model_len)); }
    if (c.moe_layers.empty()) { fail("moe_layers (the layer map) must name at least one layer"); }
    const std::int32_t largest = *std::max_element(c.moe_layers.begin(), c.moe_layers.end());
    if (c.num_model_layers == 0) { c.num_model_layers = largest + 1; }
    std::vector<bool> seen(static_cast<std::size_t>(std::max(c.num_model_layers, largest + 1)), false);
    for (const std::int32_t layer : c.moe_layers) {
      if (layer < 0 || layer >= c.num_model_layers) {
        fail("moe_layers names model layer " + std::to_string(layer) + ", outside [0, " +
             std::to_string(c.num_model_layers) + ")");
      }
      if (seen[static_cast<std::size_t>(layer)]) {
        fail("moe_layers names model layer " + std::to_string(layer) + " twice");
      }
      seen[static_cast<std::size_t>(layer)] = true;
    }
    if (c.num_experts > traits::max_experts) {
      throw error{errc::index_type_too_narrow,
                  "index type of " + std::to_string(sizeof(Index)) + " byte(s) holds at most " +
                    std::to_string(traits::max_experts) + " experts plus the missing-row sentinel " +
                    std::to_string(static_cast<std::int64_t>(traits::sentinel)) + "; num_experts is " +
                    std::to_string(c.num_experts) + ": use a wider index type"};
    }
    const auto elems = static_cast<std::int64_t>(c.max_tokens_per_step) *
                       static_cast<std::int64_t>(c.moe_layers.size()) * c.top_k;
    if (elems > std::numeric_limits<std::int32_t>::max()) {
      fail("device buffer of " + std::to_string(elems) + " ids exceeds 2^31 - 1 elements");
    }
    return c;
  }

  static std::vector<std::int32_t> layer_slots_of(const replay_config& c)
  {
    std::vector<std::int32_t> slots(static_cast<std::size_t>(c.num_model_layers), -1);
    for (std::size_t i = 0; i < c.moe_layers.size(); ++i) {
      slots[static_cast<std::size_t>(c.moe_layers[i])] = static_cast<std::int32_t>(i);
    }
    return slots;
  }

  [[nodiscard]] std::string layer_list() const
  {
    std::string s = "model layers";
    for (std::size_t i = 0; i < config_.moe_layers.size() && i < 16; ++i) {
      s += (i == 0 ? " " : ", ") + std::to_string(config_.moe_layers[i]);
    }
    if (config_.moe_layers.size() > 16) { s += ", ..."; }
    return s;
  }

  [[nodiscard]] std::int32_t num_model_layers() const noexcept { return config_.num_model_layers; }

  void check_block_transfer(const char* what, std::span<const std::int64_t> blocks, std::size_t elems) const
  {
    if (in_step_) {
      throw error{errc::invalid_state, std::string{what} + " while a step is open; end the step first"};
    }
    store_.check_blocks(blocks, (std::string{what} + ":").c_str());
    const auto need = blocks.size() * static_cast<std::size_t>(store_.block_elems());
    if (elems < need) {
      throw error{errc::invalid_argument, std::string{what} + ": " + std::to_string(blocks.size()) +
                                            " blocks need " + std::to_string(need) + " ids, the buffer has " +
                                            std::to_string(elems)};
    }
  }

  void check_cached_prefix(request_key id, std::span<const std::int64_t> cached_slots) const
  {
    if (static_cast<std::int64_t>(cached_slots.size()) > config_.max_model_len) {
      throw error{errc::position_out_of_range,
                  "request " + id.to_string() + ": " + std::to_string(cached_slots.size()) +
                    " cached positions exceed max_model_len " + std::to_string(config_.max_model_len)};
    }
    try {
      store_.check_slot_range(cached_slots);
    } catch (const error& e) {
      throw error{e.code(), "request " + id.to_string() + ": cached " + e.what()};
    }
  }

  void bind_cached_prefix(std::uint32_t h, std::span<const std::int64_t> cached_slots)
  {
    const auto n = static_cast<std::int64_t>(cached_slots.size());
    store_.bind_cached(h, cached_slots);
    auto& r         = requests_[h];
    r.recorded_rows = std::max(r.recorded_rows, n);
    // the cached rows may still be on their way, from any step planned so far
    if (store_type::slot_indexed && n > 0) { r.reads_step = step_serial_; }
  }

  // -- device buffer ------------------------------------------------------------------------------

  [[nodiscard]] buffer_mdspan<Index, Layout> buffer_view() noexcept
  {
    return buffer_mdspan<Index, Layout>{
      Backend::data(buffer_), num_layers_, config_.max_tokens_per_step, config_.top_k};
  }

  [[nodiscard]] ref_type make_ref(std::int32_t num_rows) noexcept
  {
    return ref_type{buffer_view(), num_rows, config_.num_experts, Backend::data(device_status_)};
  }

  void check_rows_argument(std::int64_t num_rows, const char* what) const
  {
    if (num_rows < 0) {
      throw error{errc::invalid_argument,
                  std::string{what} + ": negative row count " + std::to_string(num_rows)};
    }
    if (num_rows > config_.max_tokens_per_step) {
      throw error{errc::too_many_tokens,
                  std::string{what} + ": " + std::to_string(num_rows) +
                    " rows, outside [0, max_tokens_per_step = " +
                    std::to_string(config_.max_tokens_per_step) + "]"};
    }
  }

  // Every row a capture path may write is reset after the step, so no stale row can ever pass for
  // a later step's routing. Rows handed out while no step is open (CUDA-graph recording, warm-up
  // forwards) are written by later replays that the host never sees: they count for every step
  // unless a plan declares its padded rows.
  void note_rows_written(std::int64_t num_rows) noexcept
  {
    if (in_step_) {
      rows_this_step_ = std::max(rows_this_step_, num_rows);
    } else {
      rows_outside_steps_ = std::max(rows_outside_steps_, num_rows);
      dirty_outside_steps_ = true;
    }
  }

  [[nodiscard]] std::int64_t rows_to_reset(const step_type& step) const noexcept
  {
    const std::int64_t replayed = step.padded_rows >= 0 ? step.padded_rows : rows_outside_steps_;
    return std::max({step.num_rows, rows_this_step_, replayed});
  }

  // Rows written while no step was open are reset, and whatever their capture paths reported is
  // forgotten, so neither can pass for the next step's.
  void reset_outside_rows(std::int64_t rows, stream_ref stream)
  {
    enqueue_reset(rows, stream);
    Backend::fill_2d_async(Backend::data(device_status_), sizeof(detail::step_status), 0,
                           sizeof(detail::step_status), 1, stream);
    dirty_outside_steps_ = false;
  }

  // Fills rows [0, rows) of every layer of D with the sentinel, on `stream`.
  void enqueue_reset(std::int64_t rows, stream_ref stream)
  {
    const std::size_t k_bytes = static_cast<std::size_t>(config_.top_k) * sizeof(Index);
    Index* d                  = Backend::data(buffer_);
    if constexpr (layout_traits<Layout>::token_rows_contiguous) {
      const std::size_t bytes = static_cast<std::size_t>(rows * row_elems_) * sizeof(Index);
      Backend::fill_2d_async(d, bytes, traits::sentinel_byte, bytes, 1, stream);
    } else {
      Backend::fill_2d_async(d, static_cast<std::size_t>(config_.max_tokens_per_step) * k_bytes,
                             traits::sentinel_byte, static_cast<std::size_t>(rows) * k_bytes,
                             static_cast<std::size_t>(num_layers_), stream);
    }
  }

  // -- planning -----------------------------------------------------------------------------------

  void validate_plan(const step_plan& plan)
  {
    ++attempt_;
    store_.begin_validation();
    std::size_t growth       = 0;
    std::size_t exact_growth = 0;
    planned_handles_.clear();
    for (const auto& entry : plan.entries()) {
      const scheduled_request& s = entry.request;
      if (s.num_tokens < 0) {
        throw error{errc::invalid_plan,
                    "step plan: negative token count " + std::to_string(s.num_tokens)};
      }
      if (entry.skipped) { continue; }
      const std::uint32_t h = requests_.find(s.id);
      planned_handles_.push_back(h);
      auto& r = requests_[h];
      if (r.planned_attempt == attempt_) {
        throw error{errc::duplicate_request,
                    "step plan schedules request " + s.id.to_string() + " twice"};
      }
      r.planned_attempt = attempt_;
      if (s.first_position < 0 || s.first_position + s.num_tokens > config_.max_model_len) {
        throw error{errc::position_out_of_range,
                    "request " + s.id.to_string() + ": positions [" +
                      std::to_string(s.first_position) + ", " +
                      std::to_string(s.first_position + s.num_tokens) +
                      ") are outside [0, max_model_len = " + std::to_string(config_.max_model_len) +
                      ")"};
      }
      if (s.num_draft_tokens < 0 || s.num_draft_tokens > s.num_tokens ||
          s.num_draft_tokens > detail::max_draft_tokens) {
        throw error{errc::invalid_plan,
                    "request " + s.id.to_string() + ": " + std::to_string(s.num_draft_tokens) +
                      " draft tokens among " + std::to_string(s.num_tokens) + " (at most " +
                      std::to_string(detail::max_draft_tokens) + ")"};
      }
      if constexpr (store_type::slot_indexed) {
        try {
          store_.check_slots(s.slots, s.num_tokens);
        } catch (const error& e) {
          throw error{e.code(), "request " + s.id.to_string() + ": " + e.what()};
        }
      }
      growth += store_.growth_bytes(h, s.first_position + s.num_tokens, false);
      exact_growth += store_.growth_bytes(h, s.first_position + s.num_tokens, true);
    }
    store_.check_blocks(plan.fresh_blocks(), "fresh");
    exact_growth_ = store_.bytes_in_use() + growth > store_.limit();
    if (exact_growth_ && store_.bytes_in_use() + exact_growth > store_.limit()) {
      throw error{errc::host_memory_exhausted,
                  "step needs " + std::to_string(exact_growth) + " more bytes of host storage; " +
                    std::to_string(store_.bytes_in_use()) + " bytes are in use of host_memory_limit " +
                    std::to_string(store_.limit()) + " (release finished requests, or raise the limit)"};
    }
  }

  void build_step(const step_plan& plan, step_type& out)
  {
    ++step_serial_;
    out.serial      = step_serial_;
    out.num_rows    = plan.num_rows();
    out.padded_rows = plan.padded_rows();
    out.runs.clear();
    out.slots.clear();
    out.generations.clear();
    out.ops.clear();
    out.fresh_blocks.assign(plan.fresh_blocks().begin(), plan.fresh_blocks().end());
    // the blocks are the engine's from this step on: later plans and prefix hits see the new
    // generation even while earlier steps' rows for the old one are still in flight
    store_.refresh_blocks(out.fresh_blocks);
    auto handle = planned_handles_.begin();
    for (const auto& entry : plan.entries()) {
      const scheduled_request& s = entry.request;
      if (entry.skipped) { continue; }
      const std::uint32_t h = *handle++;
      auto& r               = requests_[h];
      store_.reserve(h, s.first_position + s.num_tokens, exact_growth_);
      r.open_step                   = step_serial_;
      r.reads_step                  = step_serial_;
      const std::int64_t slot_begin = store_type::slot_indexed
                                        ? static_cast<std::int64_t>(out.slots.size())
                                        : std::int64_t{-1};
      if constexpr (store_type::slot_indexed) {
        out.slots.insert(out.slots.end(), s.slots.begin(), s.slots.end());
        for (const std::int64_t slot : s.slots) { out.generations.push_back(store_.generation_of(slot)); }
      }
      out.runs.push_back({h, r.generation, entry.first_row, s.first_position, s.num_tokens,
                          s.num_draft_tokens, slot_begin});
      if (s.num_draft_tokens > 0) {
        detail::draft_group g;
        g.step_serial    = step_serial_;
        g.first_position = s.first_position + (s.num_tokens - s.num_draft_tokens);
        g.count          = s.num_draft_tokens;
        if constexpr (store_type::slot_indexed) {
          std::copy(s.slots.end() - s.num_draft_tokens, s.slots.end(), g.slots.begin());
        }
        r.drafts.push_back(g);
      }
    }
    if constexpr (claims_when_planned) {
      for (auto& run : out.runs) {
        auto& r             = requests_[run.handle];
        run.recorded_before = r.recorded_rows;
        file_run(run, r, out, [&](detail::row_claim<Index> c, std::int64_t row) {
          out.ops.push_back(detail::scatter_op<Index>{c.dst, c.copy_from, row});
        });
        run.recorded_after = r.recorded_rows;
      }
    }
  }

  // -- copy pipeline ------------------------------------------------------------------------------

  // On the compute stream: one kernel checks rows [0, N), snapshots them token-major and resets
  // every row any capture path may have written; D is free for the next forward when it ends.
  void enqueue_snapshot(slot_type& slot, stream_ref compute)
  {
    const step_type& step        = slot.step;
    const std::int64_t reset_rows = rows_to_reset(step);
    if (reset_rows > 0) {
      Backend::bulk_async(reset_rows * num_layers_,
                          detail::harvest_rows<Index, Layout>{buffer_view(),
                                                              Backend::data(slot.snapshot),
                                                              Backend::data(slot.device_status),
                                                              Backend::data(device_status_),
                                                              config_.num_experts,
                                                              static_cast<std::int32_t>(step.num_rows),
                                                              static_cast<std::int32_t>(reset_rows)},
                          compute);
    }
    if constexpr (Copy::uses_side_stream) { Backend::record(slot.snapshot_taken, compute); }
  }

  // On the copy stream, after the snapshot: the rows to the pinned staging (or, with device
  // scatter, the planned rows straight to their places), then the step's status; the status is
  // zeroed for the slot's next step.
  void enqueue_copy(slot_type& slot, stream_ref stream)
  {
    const step_type& step = slot.step;
    if constexpr (Copy::uses_side_stream) { Backend::wait(stream, slot.snapshot_taken); }
    const auto elems = static_cast<std::size_t>(step.num_rows * row_elems_);
    if constexpr (device_scatters) {
      const std::size_t num_ops = step.ops.size();
      if (num_ops > 0) {
        std::copy(step.ops.begin(), step.ops.end(), Backend::data(slot.ops));
        Backend::copy_async(Backend::data(slot.device_ops), Backend::data(slot.ops),
                            num_ops * sizeof(detail::scatter_op<Index>), stream);
        Backend::bulk_async(static_cast<std::int64_t>(num_ops) * row_elems_,
                            detail::scatter_rows<Index>{Backend::data(slot.device_ops),
                                                        Backend::data(slot.snapshot),
                                                        Backend::data(slot.device_status),
                                                        row_elems_},
                            stream);
      }
    } else {
      Backend::copy_async(Backend::data(slot.staging), Backend::data(slot.snapshot),
                          elems * sizeof(Index), stream);
    }
    auto* status = Backend::data(slot.device_status);
    Backend::copy_async(Backend::data(slot.status), status, sizeof(detail::step_status), stream);
    Backend::fill_2d_async(status, sizeof(detail::step_status), 0, sizeof(detail::step_status), 1, stream);
    Backend::record(slot.copied, stream);
  }

  // Waits for the oldest step's copy, takes it out of the ring and files it.
  void retire_oldest()
  {
    slot_type& slot = ring_.oldest();
    try {
      Backend::synchronize(slot.copied);
      // the copy waited for the snapshot, so this returns at once; it reports what failed on the
      // compute stream (the host backend hands a stream's failure to the next event recorded)
      if constexpr (Copy::uses_side_stream) { Backend::synchronize(slot.snapshot_taken); }
    } catch (...) {
      ring_.pop();
      discard(slot.step);
      note_filed(slot.step);
      throw;
    }
    ring_.pop();  // filing may throw (a device-reported problem): the step leaves the ring anyway
    note_filed(slot.step);
    file(slot);
  }

  // Rows claimed when the step began are readable from now on (filing only moves data and cannot
  // fail; a discarded step's rows read as missing).
  void note_filed(const step_type& step) noexcept
  {
    if constexpr (claims_when_planned) { store_.set_filed_through(step.serial); }
  }

  void retire_oldest_keeping(std::exception_ptr& first_error)
  {
    try {
      retire_oldest();
    } catch (...) {
      if (!first_error) { first_error = std::current_exception(); }
    }
  }

  // Files every step up to `serial`, oldest first, and no later one.
  void drain_through(std::uint64_t serial)
  {
    while (ring_.size() > 0 && ring_.oldest().step.serial <= serial) { retire_oldest(); }
  }

  // Files what a request's rows may still be waiting for.
  void drain_for(std::uint32_t h) { drain_through(requests_[h].reads_step); }

  // -- filing -------------------------------------------------------------------------------------

  // A step whose rows will never be filed. Rows claimed when the step began (a device scatter's
  // kernel wrote the sentinel in their places) are unclaimed and the rows counted are undone, so a
  // recompute of those positions records them again.
  void discard(const step_type& step)
  {
    drop_drafts_of(step);
    if constexpr (claims_when_planned) {
      for (const auto& op : step.ops) {
        // a later step may already be planned to copy this row elsewhere (a position following
        // it): it must copy the sentinel, never what the slot held before
        if constexpr (!device_scatters) { std::fill_n(op.dst, row_elems_, traits::sentinel); }
        store_.unclaim_row(op.dst);
      }
      for (const auto& run : step.runs) {
        auto& r = requests_[run.handle];
        if (r.generation == run.generation && r.recorded_rows == run.recorded_after) {
          r.recorded_rows = run.recorded_before;
        }
      }
    }
  }

  // The step's rows and verdict have arrived; the verdict decides whether it is stored at all.
  // With device scatter the rows are already in place (or replaced by the sentinel if the verdict
  // is bad): only the verdict is left to deliver.
  void file(slot_type& slot)
  {
    const step_type& step             = slot.step;
    const detail::step_status& status = *Backend::data(slot.status);
    if (!status.clean()) {
      discard(step);
      throw error{status_error_code(status), describe(status, step)};
    }
    if constexpr (!device_scatters) {
      const Index* staging = Backend::data(slot.staging);
      const auto row_bytes = static_cast<std::size_t>(row_elems_) * sizeof(Index);
      auto place           = [&](detail::row_claim<Index> c, std::int64_t row) {
        std::memcpy(c.dst, c.copy_from != nullptr ? c.copy_from : staging + row * row_elems_, row_bytes);
      };
      if constexpr (claims_when_planned) {
        for (const auto& op : step.ops) { place({op.dst, op.copy_from}, op.row); }
      } else {
        for (const auto& run : step.runs) {
          auto& r = requests_[run.handle];
          if (r.generation == run.generation) { file_run(run, r, step, place); }  // else: gone
        }
      }
    }
  }

  // Claims the rows of one scheduled request and hands each claimed one to `place(claim, row)`.
  template <class Place>
  void file_run(const run_type& run, detail::request_state& r, const step_type& step, Place&& place)
  {
    detail::draft_group* group = nullptr;
    if (run.num_draft > 0) {
      for (auto& g : r.drafts) {
        if (g.step_serial == step.serial) { group = &g; }
      }
    }
    const std::int32_t committed = run.num_tokens - run.num_draft;
    for (std::int32_t i = 0; i < run.num_tokens; ++i) {
      const std::int64_t position = run.first_position + i;
      const auto at               = static_cast<std::size_t>(run.slots_begin + i);
      const std::int64_t slot     = run.slots_begin >= 0 ? step.slots[at] : -1;
      const std::uint32_t planned = run.slots_begin >= 0 ? step.generations[at] : 0u;
      const std::int32_t d        = i - committed;
      const bool draft            = d >= 0 && group != nullptr;
      if (draft && group->accepted >= 0 && d >= group->accepted) { continue; }  // already rejected
      const bool tentative = draft && group->accepted < 0;
      const bool taken     = take_over_draft(r, position);  // always: ownership must move
      const bool replace   = taken || config_.overwrite_recomputed_rows;
      const auto c         = store_.claim(run.handle, position, slot, planned, step.serial, replace);
      if (c.dst != nullptr) {
        place(c, run.first_row + i);
        // a tentative row owns its slot only if it is its own (not an earlier row that followed)
        if (tentative && c.copy_from == nullptr) { group->owned |= 1u << d; }
      }
      if (!tentative) { r.recorded_rows = std::max(r.recorded_rows, position + 1); }
    }
    if (group != nullptr) {
      group->filed = true;
      if (group->accepted >= 0) {  // accepted before its rows arrived: nothing left to resolve
        r.drafts.erase(r.drafts.begin() + (group - r.drafts.data()));
      }
    }
  }

  // A tentative draft row yields to any later write of its position.
  static bool take_over_draft(detail::request_state& r, std::int64_t position) noexcept
  {
    bool taken = false;
    for (auto& g : r.drafts) {
      if (g.filed && g.accepted < 0 && g.owns(position)) {
        g.owned &= ~(1u << (position - g.first_position));
        taken = true;
      }
    }
    return taken;
  }

  void resolve_filed_group(std::uint32_t h, const detail::draft_group& g)
  {
    auto& r = requests_[h];
    for (std::int32_t d = 0; d < g.count; ++d) {
      if (d >= g.accepted && ((g.owned >> d) & 1u) != 0) {
        store_.erase(h, g.first_position + d, g.slots[static_cast<std::size_t>(d)]);
      }
    }
    if (g.accepted > 0) { r.recorded_rows = std::max(r.recorded_rows, g.first_position + g.accepted); }
  }

  void drop_drafts_of(const step_type& step)
  {
    for (const auto& run : step.runs) {
      auto& r = requests_[run.handle];
      if (run.num_draft == 0 || r.generation != run.generation) { continue; }
      std::erase_if(r.drafts, [&](const detail::draft_group& g) { return g.step_serial == step.serial; });
    }
  }

  void retire(std::uint32_t h)
  {
    store_.close(h);
    requests_.remove(h);
  }

  // -- error reporting ----------------------------------------------------------------------------

  static errc status_error_code(const detail::step_status& s) noexcept
  {
    if (s.invalid_id.count != 0 || s.out_of_range.count != 0) { return errc::invalid_expert_id; }
    if (s.out_of_bounds.count != 0) { return errc::invalid_argument; }
    return errc::missing_routing;
  }

  [[nodiscard]] std::string describe_row(const step_type& plan, std::int64_t row) const
  {
    for (const auto& run : plan.runs) {
      if (row >= run.first_row && row < run.first_row + run.num_tokens) {
        const auto& r = requests_[run.handle];
        const std::string who =
          r.generation == run.generation && r.id ? r.id->to_string() : std::string{"(aborted)"};
        return "row " + std::to_string(row) + " (request " + who + ", position " +
               std::to_string(run.first_position + (row - run.first_row)) + ")";
      }
    }
    return "row " + std::to_string(row) + " (a request that did not opt in)";
  }

  [[nodiscard]] std::string describe_layer(std::int32_t slot) const
  {
    if (slot < 0 || slot >= num_layers_) { return "layer slot " + std::to_string(slot); }
    return "layer " + std::to_string(config_.moe_layers[static_cast<std::size_t>(slot)]) +
           " (slot " + std::to_string(slot) + ")";
  }

  [[nodiscard]] std::string describe(const detail::step_status& s,
                                     const step_type& plan) const
  {
    const std::string step = "step " + std::to_string(plan.serial) + ": ";
    const std::string tail = "; the step was discarded, nothing of it was stored";
    const std::string range = " outside [0, num_experts = " + std::to_string(config_.num_experts) + ")";
    if (s.invalid_id.count != 0) {
      const auto& p = s.invalid_id;
      return step + "expert id " + std::to_string(p.value) + range + " captured at " +
             describe_layer(p.layer) + ", " + describe_row(plan, p.row) + ", column " +
             std::to_string(p.column) + "; " + std::to_string(p.count) + " invalid id(s)" + tail;
    }
    if (s.out_of_range.count != 0) {
      const auto& p = s.out_of_range;
      return step + "value " + std::to_string(p.value) + range + " written through a view at " +
             describe_layer(p.layer) + ", " + describe_row(plan, p.row) + ", column " +
             std::to_string(p.column) + "; " + std::to_string(p.count) + " such value(s)" + tail;
    }
    if (s.out_of_bounds.count != 0) {
      const auto& p = s.out_of_bounds;
      return step + "device_ref::record outside the buffer: layer slot " + std::to_string(p.layer) +
             ", row " + std::to_string(p.row) + ", column " + std::to_string(p.column) + " (buffer: " +
             std::to_string(num_layers_) + " layers, " + std::to_string(config_.top_k) +
             " columns, rows bounded by ref(num_rows)); " + std::to_string(p.count) + " refused" + tail;
    }
    const auto& p = s.unwritten;
    return step + describe_layer(p.layer) + " left " + describe_row(plan, p.row) +
           " unwritten (it still holds the sentinel); " + std::to_string(p.count) +
           " (layer, row) pair(s) unwritten; every captured layer must write rows [0, " +
           std::to_string(plan.num_rows) + ") each step" + tail;
  }

  // -- extraction ---------------------------------------------------------------------------------

  // T without the open step: stores that claim rows when a step begins count them at once, but
  // they are not readable before the step is filed.
  [[nodiscard]] std::int64_t readable_rows(std::uint32_t h) const noexcept
  {
    const auto& r = requests_[h];
    if constexpr (claims_when_planned) {
      if (in_step_ && r.open_step == step_serial_) {
        for (const auto& run : open_step_.runs) {
          if (run.handle == h) { return run.recorded_before; }
        }
      }
    }
    return r.recorded_rows;
  }

  [[nodiscard]] std::int64_t output_row_size(const extract_options& o) const noexcept
  {
    return static_cast<std::int64_t>(o.include_dense_layers ? num_model_layers() : num_layers_) *
           config_.top_k;
  }

  [[nodiscard]] std::pair<std::int64_t, std::int64_t> extraction_range(request_key id,
                                                                       std::uint32_t h,
                                                                       const extract_options& o) const
  {
    const auto& r = requests_[h];
    for (const auto& g : r.drafts) {
      if (g.accepted < 0) {
        throw error{errc::draft_error,
                    "request " + id.to_string() + " has " + std::to_string(g.count) +
                      " unresolved draft token(s) from step " + std::to_string(g.step_serial) +
                      "; call accept_draft first"};
      }
    }
    const std::int64_t recorded = readable_rows(h);
    const std::int64_t end      = o.end_position < 0 ? recorded : o.end_position;
    if (o.start_position < 0 || o.start_position > end || end > recorded) {
      throw error{errc::position_out_of_range,
                  "request " + id.to_string() + ": rows [" + std::to_string(o.start_position) +
                    ", " + std::to_string(end) + ") requested, " + std::to_string(recorded) +
                    " recorded"};
    }
    return {o.start_position, end};
  }

  void copy_rows(std::uint32_t h,
                 std::int64_t begin,
                 std::int64_t end,
                 const extract_options& o,
                 Index* out) const
  {
    const std::int64_t count = end - begin;
    if (!o.include_dense_layers) {
      if (const Index* rows = store_.contiguous(h, begin, count)) {
        std::memcpy(out, rows, static_cast<std::size_t>(count * row_elems_) * sizeof(Index));
        return;
      }
      for (std::int64_t p = begin; p < end; ++p, out += row_elems_) {
        if (!store_.read(h, p, out)) { std::fill_n(out, row_elems_, traits::sentinel); }
      }
      return;
    }
    std::vector<Index> row(static_cast<std::size_t>(row_elems_));
    const auto k = static_cast<std::size_t>(config_.top_k);
    for (std::int64_t p = begin; p < end; ++p) {
      const bool present = store_.read(h, p, row.data());
      for (std::int32_t m = 0; m < num_model_layers(); ++m, out += k) {
        const std::int32_t slot = layer_slots_[static_cast<std::size_t>(m)];
        if (slot < 0 || !present) {
          std::fill_n(out, k, traits::sentinel);
        } else {
          std::memcpy(out, row.data() + static_cast<std::size_t>(slot) * k, k * sizeof(Index));
        }
      }
    }
  }

  // -- state --------------------------------------------------------------------------------------

  replay_config config_;
  std::int32_t num_layers_;
  std::int64_t row_elems_;
  std::vector<std::int32_t> layer_slots_;  // model layer -> captured slot, -1 if not captured
  typename Backend::template device_vector<Index> buffer_;                  // D
  typename Backend::template device_vector<detail::step_status> device_status_;
  std::vector<std::uint32_t> planned_handles_;  // handles of a plan's runs, found once per step
  store_type store_;
  detail::request_registry requests_;
  std::uint64_t step_serial_     = 0;
  std::uint64_t attempt_         = 0;
  std::int64_t rows_this_step_     = 0;  // rows capture paths were handed in the open step
  std::int64_t rows_outside_steps_ = 0;  // most rows handed out while no step was open
  bool dirty_outside_steps_        = false;
  bool exact_growth_             = false;
  bool in_step_                  = false;
  step_type open_step_;  // the open step's record, swapped into a ring slot at end_step
  std::optional<typename Backend::stream> own_copy_stream_;  // when the engine supplies none
  std::optional<stream_ref> copy_stream_;                   // strategies with a side stream
  // Last: destroyed first, it waits for every copy in flight while what they write (stagings,
  // the pool of a device scatter) and the stream they run on still exist.
  ring_type ring_;
};

}  // namespace routing_replay
