/// @file
/// What device code reports about a step: invalid ids, unwritten rows, out-of-bounds records.
#pragma once

#include <routing_replay/detail/macros.hpp>

#include <cuda/atomic>
#include <cuda/std/cstdint>

#include <cstdint>

namespace routing_replay::detail {

/// @brief One kind of problem: how often it happened and where it happened first.
///
/// "First" is whichever thread counted first; the host only reads it after the step's copy.
struct problem_report {
  unsigned long long count = 0;
  std::int64_t value       = 0;  ///< offending value (expert id), if any
  std::int32_t layer       = 0;  ///< captured layer index
  std::int32_t row         = 0;  ///< row of the step
  std::int32_t column      = 0;  ///< top-k column

  /// @brief Counts one occurrence and keeps the details of the first one.
  ROUTING_REPLAY_HOST_DEVICE void report(std::int64_t v,
                                         std::int32_t l,
                                         std::int32_t r,
                                         std::int32_t c) noexcept
  {
    cuda::atomic_ref<unsigned long long, cuda::thread_scope_device> counter{count};
    if (counter.fetch_add(1ull, cuda::std::memory_order_relaxed) == 0ull) {
      value  = v;
      layer  = l;
      row    = r;
      column = c;
    }
  }

  /// @brief Adds the occurrences `other` counted, keeping its details if they are the first;
  /// safe beside concurrent report() calls.
  ROUTING_REPLAY_HOST_DEVICE void absorb(const problem_report& other) noexcept
  {
    if (other.count == 0ull) { return; }
    cuda::atomic_ref<unsigned long long, cuda::thread_scope_device> counter{count};
    if (counter.fetch_add(other.count, cuda::std::memory_order_relaxed) == 0ull) {
      value  = other.value;
      layer  = other.layer;
      row    = other.row;
      column = other.column;
    }
  }
};

/// @brief Device-side status of the step in flight; zeroed after each step's copy.
struct step_status {
  problem_report invalid_id;     ///< capture()/record() saw an id outside [0, E); stored sentinel
  problem_report out_of_bounds;  ///< record() with a layer, row or column outside the buffer
  problem_report unwritten;      ///< end-of-step check: a (layer, row) still holds the sentinel
  problem_report out_of_range;   ///< end-of-step check: a value outside [0, E) written by a view

  /// @brief Whether the step may be stored.
  [[nodiscard]] ROUTING_REPLAY_HOST_DEVICE bool clean() const noexcept
  {
    return invalid_id.count == 0 && out_of_bounds.count == 0 && unwritten.count == 0 &&
           out_of_range.count == 0;
  }
};

}  // namespace routing_replay::detail
