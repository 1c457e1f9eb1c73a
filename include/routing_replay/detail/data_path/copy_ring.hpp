/// @file
/// The copy pipeline's ring: per step in flight, a device snapshot of its rows, a pinned staging,
/// the step's status, its events and everything filing needs from its plan.
#pragma once

#include <routing_replay/data_path/step_record.hpp>
#include <routing_replay/detail/data_path/pinned_memory.hpp>
#include <routing_replay/detail/scatter_op.hpp>
#include <routing_replay/detail/step_status.hpp>

#include <cstddef>
#include <cstdint>
#include <memory_resource>
#include <utility>
#include <vector>

namespace routing_replay::detail {

/// @brief One step in flight: the snapshot the end-of-step kernel takes of D, where its rows and
/// status arrive, and the events that order the copy after the snapshot and the host after the copy.
template <class Backend, class Index>
struct ring_slot {
  /// @brief Allocates for `max_rows` rows of `row_elems` ids; stagings only where the host
  /// scatters; where a kernel does, the slot's record keeps its op list in pinned memory
  /// (ops_memory(false)), with room for the most pieces a step may have.
  ring_slot(std::size_t max_rows, std::size_t row_elems, bool host_scatters)
    : snapshot(max_rows * row_elems),
      device_status(1),
      staging(host_scatters ? max_rows * row_elems : 0),
      status(1),
      blocks_done(host_scatters ? 0 : 1),
      step(ops_memory(host_scatters))
  {
    if (!host_scatters) { step.ops.reserve(max_pieces(max_rows, row_elems)); }
  }

  /// @brief Where a slot's record keeps its op list: the heap where the host scatters the rows,
  /// the backend's pinned memory where a kernel does (it reads the list in place).
  [[nodiscard]] static std::pmr::memory_resource* ops_memory(bool host_scatters) noexcept
  {
    return host_scatters ? std::pmr::new_delete_resource() : pinned_memory_resource<Backend>::get();
  }

  /// @brief The most pieces a step of `max_rows` rows splits into: a row starts at most one piece
  /// and is cut at most once more (at the end of a storage segment), and pieces are at most
  /// max_piece_elems long.
  [[nodiscard]] static std::size_t max_pieces(std::size_t max_rows, std::size_t row_elems) noexcept
  {
    return 2 * max_rows + max_rows * row_elems / static_cast<std::size_t>(max_piece_elems) + 1;
  }

  typename Backend::template device_vector<Index> snapshot;             ///< [N, L, K] on the device
  typename Backend::template device_vector<step_status> device_status;  ///< the step's verdict
  typename Backend::template pinned_vector<Index> staging;              ///< [N, L, K] on the host
  typename Backend::template pinned_vector<step_status> status;         ///< the verdict, copied
  typename Backend::template device_vector<unsigned int> blocks_done;  ///< the scatter's last block
  typename Backend::event snapshot_taken;  ///< compute stream: D is snapshotted and reset
  typename Backend::event copied;          ///< copy stream: rows and status have arrived
  bool status_dirty = false;               ///< a step failed here: zero the status before reuse
  routing_replay::step_record<Index> step;                 ///< the step this slot holds
};

/// @brief A FIFO of `depth` ring slots. Destroying it (or assigning over it) first waits for every
/// copy in flight, so no copy ever writes freed memory.
template <class Backend, class Index>
class copy_ring {
 public:
  copy_ring() = default;
  /// @brief `depth` slots for steps of up to `max_rows` rows of `row_elems` ids.
  copy_ring(int depth, std::size_t max_rows, std::size_t row_elems, bool host_scatters)
  {
    slots_.reserve(static_cast<std::size_t>(depth));
    for (int i = 0; i < depth; ++i) { slots_.emplace_back(max_rows, row_elems, host_scatters); }
  }
  copy_ring(copy_ring&& other) noexcept
    : slots_(std::move(other.slots_)),
      head_(std::exchange(other.head_, 0)),
      count_(std::exchange(other.count_, 0))
  {
  }
  copy_ring& operator=(copy_ring&& other) noexcept
  {
    if (this != &other) {
      wait_all();
      slots_ = std::move(other.slots_);
      head_  = std::exchange(other.head_, 0);
      count_ = std::exchange(other.count_, 0);
    }
    return *this;
  }
  copy_ring(const copy_ring&)            = delete;
  copy_ring& operator=(const copy_ring&) = delete;
  ~copy_ring() { wait_all(); }

  /// @brief Steps in flight.
  [[nodiscard]] std::size_t size() const noexcept { return count_; }
  /// @brief Whether every slot holds a step in flight.
  [[nodiscard]] bool full() const noexcept { return count_ == slots_.size(); }
  /// @brief The oldest step in flight (size() > 0).
  [[nodiscard]] ring_slot<Backend, Index>& oldest() noexcept { return slots_[head_]; }
  /// @brief The slot the next step takes (!full()).
  [[nodiscard]] ring_slot<Backend, Index>& next() noexcept
  {
    return slots_[(head_ + count_) % slots_.size()];
  }
  /// @brief The next slot now holds a step in flight.
  void push() noexcept { ++count_; }
  /// @brief The oldest step has been retired.
  void pop() noexcept
  {
    head_ = (head_ + 1) % slots_.size();
    --count_;
  }
  /// @brief The i-th step in flight, oldest first.
  [[nodiscard]] ring_slot<Backend, Index>& in_flight(std::size_t i) noexcept
  {
    return slots_[(head_ + i) % slots_.size()];
  }

 private:
  void wait_all() noexcept
  {
    for (std::size_t i = 0; i < count_; ++i) {
      try {
        Backend::synchronize(in_flight(i).copied);
      } catch (...) {  // a failed copy wrote nothing more: nothing left to wait for
      }
    }
    count_ = 0;
  }

  std::vector<ring_slot<Backend, Index>> slots_;
  std::size_t head_  = 0;
  std::size_t count_ = 0;
};

}  // namespace routing_replay::detail
