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
///
/// Parts 1, 2, 5 and 6 and the request calls form host_side (host_side.hpp), which RoutingReplay
/// derives from; RoutingReplay adds the device side (parts 3 and 4) and the step calls.
#pragma once

#include <routing_replay/backend.hpp>
#include <routing_replay/buffer_layout.hpp>
#include <routing_replay/copy_strategy.hpp>
#include <routing_replay/data_path/capture_buffer.hpp>
#include <routing_replay/data_path/capture_paths.hpp>
#include <routing_replay/data_path/copy_pipeline.hpp>
#include <routing_replay/data_path/host_side.hpp>
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
/// asynchronous operation takes the engine's stream explicitly. The request calls (add_request,
/// extract, ...) come from host_side (data_path/host_side.hpp), the capture paths (capture(),
/// layer_view(), ref()) from capture_paths (data_path/capture_paths.hpp).
template <backend Backend,
          expert_index Index   = std::int16_t,
          buffer_layout Layout = layer_major,
          copy_strategy Copy   = sync_copy,
          host_storage Storage = per_request_storage>
class RoutingReplay
  : public host_side<RoutingReplay<Backend, Index, Layout, Copy, Storage>, Index,
                     host_store<Storage, Backend, Index, Copy::site == scatter_site::device>, Copy::site>,
    public capture_paths<RoutingReplay<Backend, Index, Layout, Copy, Storage>, Backend, Index, Layout> {
  using store_type    = host_store<Storage, Backend, Index, Copy::site == scatter_site::device>;
  using base          = host_side<RoutingReplay, Index, store_type, Copy::site>;
  using pipeline_type = copy_pipeline<Backend, Index, Copy>;
  friend base;                                                  // calls file_through()
  friend capture_paths<RoutingReplay, Backend, Index, Layout>;  // calls capture_target(), enter()

 public:
  using backend_type    = Backend;                              ///< the backend policy
  using layout_type     = Layout;                               ///< the device-buffer layout
  using copy_type       = Copy;                                 ///< the copy strategy
  using storage_type    = Storage;                              ///< the host-storage policy
  using stream_ref      = typename Backend::stream_ref;         ///< stream handle taken by every call
  using buffer_type     = capture_buffer<Backend, Index, Layout>;  ///< D and the capture paths

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

  /// @name Device shape
  /// @{

  /// @brief Bytes of the device buffer D: N_max * L * K * sizeof(Index) (capture paths write it).
  [[nodiscard]] std::size_t device_bytes() const noexcept { return buffer_.bytes(); }
  /// @brief Bytes of the device snapshots the copies read: Copy::ring_depth more buffers like D.
  [[nodiscard]] std::size_t snapshot_bytes() const noexcept { return pipeline_.snapshot_bytes(); }
  /// @brief Steps whose rows are still in flight (copied or scattered, not yet filed).
  [[nodiscard]] std::size_t steps_in_flight() const noexcept { return pipeline_.size(); }
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
    [[maybe_unused]] const auto inside = this->enter("begin_step");
    this->planner_.validate(plan, this->requests_, this->filer_);
    try {
      buffer_.begin_step(plan.num_rows(), compute);
    } catch (...) {
      this->planner_.abandon(this->requests_, this->filer_);  // the step does not open: as before the call
      throw;
    }
    this->planner_.open(plan, this->requests_, this->filer_);  // commits: nothing past validate() throws a library error
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
    end_step(compute, [](buffer_type& d, const step_record<Index>& closed, Index* snapshot,
                         detail::step_status* status, stream_ref s) {
      d.end_step(snapshot, status, closed.num_rows, closed.padded_rows, s);
    });
  }

  /// @brief end_step() with the end-of-step work enqueued by `harvest(buffer, step, snapshot,
  /// status, compute)` instead of buffer.end_step() alone: the parallel schemes (parallel/) gather or
  /// merge other ranks' rows there. When its work on `compute` is done, the step's rows must be in
  /// `snapshot` ([step.num_rows, L, K]) and its verdict in `status`, and D must be reset.
  /// @throws error as end_step()
  template <class Harvest>
  void end_step(stream_ref compute, Harvest&& harvest)
  {
    [[maybe_unused]] const auto inside = this->enter("end_step");
    auto enqueue = [&](const step_record<Index>& closed, Index* snapshot, detail::step_status* status,
                       stream_ref s) { harvest(buffer_, closed, snapshot, status, s); };
    pipeline_.push(this->planner_.close(), enqueue, compute, this->template filing<Backend>());
  }

  /// @brief Files every step still in flight, waiting for their copies.
  /// @throws error as end_step() for a device-reported problem in one of them (the steps after it
  /// stay in flight: call drain() again); backend_error
  void drain()
  {
    [[maybe_unused]] const auto inside = this->enter("drain");
    file_through(~std::uint64_t{0});
  }

  /// @brief Resets every row capture paths were handed to the sentinel, on `stream`. Needed only
  /// when an engine replays a recorded forward outside any step (a warm-up graph replay); capture
  /// calls made outside a step are reset automatically at the next begin_step().
  void reset_device_buffer(stream_ref stream)
  {
    [[maybe_unused]] const auto inside = this->enter("reset_device_buffer");
    if (this->planner_.is_open()) {
      throw error{errc::invalid_state, "reset_device_buffer inside an open step would erase it"};
    }
    buffer_.reset(stream);
  }
  /// @}

 private:
  RoutingReplay(replay_config config, std::optional<stream_ref> copy_stream)
    : base(std::move(config), pipeline_type::ops_memory()),
      buffer_(this->config_, layer_map{this->config_}),
      pipeline_(static_cast<std::size_t>(this->config_.max_tokens_per_step),
                static_cast<std::size_t>(this->row_size()),
                copy_stream)
  {
    if constexpr (Copy::site == scatter_site::device) {  // the scatter kernel reads the planner's op list
      this->planner_.reserve_ops(pipeline_type::max_ops(static_cast<std::size_t>(this->config_.max_tokens_per_step),
                                                        static_cast<std::size_t>(this->row_size())));
    }
  }

  [[nodiscard]] buffer_type& capture_target() noexcept { return buffer_; }

  // Files every step up to serial `last` in flight, and no later one.
  void file_through(std::uint64_t last) { pipeline_.drain(this->template filing<Backend>(), last); }

  buffer_type buffer_;  // D and the capture paths
  // Last: destroyed first (and before the host side), it waits for every copy in flight while what
  // they write (stagings, the storage of a device scatter) and the stream they run on still exist.
  pipeline_type pipeline_;
};

}  // namespace routing_replay
