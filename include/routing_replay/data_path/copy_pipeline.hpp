/// @file
/// Data path, part 4: the copy pipeline. Moves each closed step's rows off the device through a
/// ring of slots (device snapshot, pinned staging, status, events), on the stream and with the
/// timing the copy strategy chooses, and hands each step to the filing side once its rows arrived.
#pragma once

#include <routing_replay/backend.hpp>
#include <routing_replay/copy_strategy.hpp>
#include <routing_replay/data_path/step_record.hpp>
#include <routing_replay/detail/data_path/copy_ring.hpp>
#include <routing_replay/detail/kernels.hpp>
#include <routing_replay/detail/step_status.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/index_type.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory_resource>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

namespace routing_replay {

/// @brief Where the copy pipeline hands the steps that leave its ring: `file(slot)` once a step's
/// rows and status have arrived (it may throw: a device-reported problem), `discard(step)` when
/// its rows never will (a backend failure), and `retired(step)` whenever a step leaves the ring,
/// oldest first, before either of them.
template <class Sink, class Slot>
concept step_sink = requires(Sink& sink, Slot& slot) {
  sink.file(slot);
  sink.discard(slot.step);
  sink.retired(slot.step);
};

/// @brief The ring of `Copy::ring_depth` steps in flight and the copy stream, driven by the copy
/// strategy.
///
/// No write-after-read: the end-of-step kernel snapshots D on the compute stream, copies read only
/// the snapshot, and a slot is reused only after the host has seen its copy complete, so the
/// compute stream never waits for a copy. No allocation per step: slots are allocated once.
/// Destruction (and move assignment) waits for every copy in flight; steps not yet filed are lost.
template <backend Backend, expert_index Index, copy_strategy Copy>
class copy_pipeline {
  static constexpr bool host_scatters = Copy::site == scatter_site::host;

 public:
  /// @brief Stream handle taken by every call that enqueues work.
  using stream_ref = typename Backend::stream_ref;
  /// @brief One step in flight: snapshot, staging (or op lists), status, events, record.
  using slot_type = detail::ring_slot<Backend, Index>;

  /// @brief Allocates the ring for steps of up to `max_rows` rows of `row_elems` ids. Strategies
  /// with a side stream copy on `copy_stream` (the engine's, which must outlive the pipeline), or
  /// create their own stream when it is empty; sync_copy ignores it.
  copy_pipeline(std::size_t max_rows, std::size_t row_elems, std::optional<stream_ref> copy_stream = std::nullopt)
    : snapshot_bytes_(static_cast<std::size_t>(Copy::ring_depth) * max_rows * row_elems * sizeof(Index)),
      row_elems_(static_cast<std::int64_t>(row_elems)),
      ring_(Copy::ring_depth, max_rows, row_elems, host_scatters)
  {
    if constexpr (Copy::uses_side_stream) {
      if (!copy_stream) {
        own_copy_stream_.emplace();
        copy_stream = own_copy_stream_->ref();
      }
      copy_stream_ = copy_stream;
    }
  }

  /// @brief Where the records pushed here keep their op lists: pinned memory where a kernel
  /// scatters the rows (it reads the list in place, so a record from elsewhere is refused), the
  /// heap where the host does.
  [[nodiscard]] static std::pmr::memory_resource* ops_memory() noexcept
  {
    return slot_type::ops_memory(host_scatters);
  }
  /// @brief The most ops a step of up to `max_rows` rows of `row_elems` ids has: the room a
  /// record's op list needs, reserved once so that no step reallocates it.
  [[nodiscard]] static std::size_t max_ops(std::size_t max_rows, std::size_t row_elems) noexcept
  {
    return slot_type::max_pieces(max_rows, row_elems);
  }

  /// @brief Steps in flight (closed, not yet filed).
  [[nodiscard]] std::size_t size() const noexcept { return ring_.size(); }
  /// @brief Bytes of the device snapshots: ring_depth buffers of `max_rows * row_elems` ids.
  [[nodiscard]] std::size_t snapshot_bytes() const noexcept { return snapshot_bytes_; }
  /// @brief The i-th step in flight, oldest first (i < size()).
  [[nodiscard]] const slot_type& in_flight(std::size_t i) noexcept { return ring_.in_flight(i); }

  /// @brief Closes a step: takes `step` into a ring slot (handing back the slot's old record, so
  /// records are recycled), enqueues `harvest(record, snapshot, status, compute)` (the capture
  /// buffer's end-of-step kernel for that step) and the copy, then retires what the strategy says:
  /// - sync_copy: waits for this step's copy and files it;
  /// - deferred strategies with one slot: nothing (filed by the next push, a drain, a read);
  /// - deeper rings: files every earlier step whose copy completed, without blocking.
  /// A full ring first retires its oldest step, waiting for its copy.
  /// @throws whatever `sink.file` throws for a step filed here (the first one; later ones stay in
  /// flight); error backend_error if enqueueing fails (the step is discarded)
  template <class Harvest, class Sink>
    requires step_sink<std::remove_cvref_t<Sink>, slot_type>
  void push(step_record<Index>& step, Harvest&& harvest, stream_ref compute, Sink&& sink)
  {
    std::exception_ptr earlier_step_error;
    if (ring_.full()) { retire_oldest_keeping(sink, earlier_step_error); }
    slot_type& slot = ring_.next();
    std::swap(slot.step, step);
    try {
      if (slot.status_dirty) {  // a failed step left its reports here
        constexpr std::size_t status_bytes = sizeof(detail::step_status);
        Backend::fill_2d_async(Backend::data(slot.device_status), status_bytes, 0, status_bytes, 1, compute);
        slot.status_dirty = false;
      }
      harvest(std::as_const(slot.step), Backend::data(slot.snapshot), Backend::data(slot.device_status), compute);
      if constexpr (Copy::uses_side_stream) {
        Backend::record(slot.snapshot_taken, compute);
        enqueue_copy(slot, *copy_stream_);
      } else {
        enqueue_copy(slot, compute);
      }
    } catch (...) {
      // the backend failed: the step's rows never arrive. What was enqueued for it before the
      // failure finishes before the slot is reused or freed, and its status is zeroed then.
      quiesce(compute);
      slot.status_dirty = true;
      sink.discard(slot.step);
      throw;
    }
    ring_.push();

    if constexpr (Copy::timing == scatter_timing::at_end_of_step) {
      retire_oldest(sink);
    } else if constexpr (Copy::ring_depth > 1) {
      // earlier steps only: this one's copy was enqueued a moment ago (a query of it is a wasted
      // driver call), and it is filed by a later push or a drain
      while (ring_.size() > 1 && earlier_step_error == nullptr && Backend::ready(ring_.oldest().copied)) {
        retire_oldest_keeping(sink, earlier_step_error, copy_checked);
      }
    }
    if (earlier_step_error) { std::rethrow_exception(earlier_step_error); }
  }

  /// @brief Files every step up to serial `last` (every step by default), oldest first, waiting
  /// for their copies, and no later one.
  /// @throws whatever `sink.file` throws (the steps after that one stay in flight); backend_error
  template <class Sink>
    requires step_sink<std::remove_cvref_t<Sink>, slot_type>
  void drain(Sink&& sink, std::uint64_t last = ~std::uint64_t{0})
  {
    while (ring_.size() > 0 && ring_.oldest().step.serial <= last) { retire_oldest(sink); }
  }

 private:
  // Waits for everything enqueued on the streams a step uses; their failures are the caller's to
  // report, so they are not reported again here.
  void quiesce(stream_ref compute) noexcept
  {
    try {
      Backend::synchronize(compute);
    } catch (...) {
    }
    if constexpr (Copy::uses_side_stream) {
      try {
        Backend::synchronize(*copy_stream_);
      } catch (...) {
      }
    }
  }

  // On the copy stream, after the snapshot: the rows to the pinned staging (or, with device
  // scatter, the planned rows straight to their places), then the step's status; the status is
  // zeroed for the slot's next step.
  void enqueue_copy(slot_type& slot, stream_ref stream)
  {
    const step_record<Index>& step = slot.step;
    if constexpr (Copy::uses_side_stream) { Backend::wait(stream, slot.snapshot_taken); }
    if constexpr (host_scatters) {
      const auto bytes = static_cast<std::size_t>(step.num_rows * row_elems_) * sizeof(Index);
      Backend::copy_async(Backend::data(slot.staging), Backend::data(slot.snapshot), bytes, stream);
      constexpr std::size_t status_bytes = sizeof(detail::step_status);
      auto* status                       = Backend::data(slot.device_status);
      Backend::copy_async(Backend::data(slot.status), status, status_bytes, stream);
      Backend::fill_2d_async(status, status_bytes, 0, status_bytes, 1, stream);
    } else {
      // one launch: the kernel reads the pieces where the planner wrote them (the record's op
      // list, in pinned memory: nothing is copied), writes the rows, and its last block publishes
      // the status and zeroes it. The record stays in this slot until the step is retired.
      if (step.ops.get_allocator().resource() != ops_memory()) {
        throw error{errc::invalid_state, "device scatter: step " + std::to_string(step.serial) +
                                           "'s op list is not in pinned memory (use copy_pipeline::ops_memory())"};
      }
      const auto num_ops        = static_cast<std::int32_t>(step.ops.size());
      const std::int32_t blocks = std::max(1, num_ops);
      Backend::launch_async(blocks,
                            detail::kernel_block_threads,
                            detail::scatter_rows<Index>{step.ops.data(),
                                                        Backend::data(slot.snapshot),
                                                        Backend::data(slot.device_status),
                                                        Backend::data(slot.status),
                                                        Backend::data(slot.blocks_done),
                                                        num_ops,
                                                        blocks},
                            stream);
    }
    Backend::record(slot.copied, stream);
  }

  // Whether retire_oldest() finds the oldest step's copy already queried: a ready() that returned
  // true has reported any failure behind the copy's event, so the event is not queried again.
  enum copy_state : bool { copy_unchecked = false, copy_checked = true };

  // Waits for the oldest step's copy, takes it out of the ring and hands it to the sink.
  template <class Sink>
  void retire_oldest(Sink& sink, copy_state copy = copy_unchecked)
  {
    slot_type& slot = ring_.oldest();
    try {
      if (copy == copy_unchecked) { Backend::synchronize(slot.copied); }
      // the copy waited for the snapshot, so this returns at once; it reports what failed on the
      // compute stream (the host backend hands a stream's failure to the next event recorded),
      // which a backend whose failures are sticky has reported with the copy's event already
      if constexpr (Copy::uses_side_stream && !failures_are_sticky<Backend>) {
        Backend::synchronize(slot.snapshot_taken);
      }
    } catch (...) {
      ring_.pop();
      sink.discard(slot.step);
      sink.retired(slot.step);
      throw;
    }
    ring_.pop();  // filing may throw (a device-reported problem): the step leaves the ring anyway
    sink.retired(slot.step);
    sink.file(slot);
  }

  template <class Sink>
  void retire_oldest_keeping(Sink& sink, std::exception_ptr& first_error, copy_state copy = copy_unchecked)
  {
    try {
      retire_oldest(sink, copy);
    } catch (...) {
      if (!first_error) { first_error = std::current_exception(); }
    }
  }

  std::size_t snapshot_bytes_;
  std::int64_t row_elems_;
  std::optional<typename Backend::stream> own_copy_stream_;  // when the engine supplies none
  std::optional<stream_ref> copy_stream_;                   // strategies with a side stream
  // Last: destroyed first, it waits for every copy in flight while what they write (stagings, a
  // device scatter's destination) and the stream they run on still exist.
  detail::copy_ring<Backend, Index> ring_;
};

}  // namespace routing_replay
