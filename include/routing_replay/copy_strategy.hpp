/// @file
/// Copy-strategy policy: how the step's rows leave the device buffer and when they are filed.
#pragma once

#include <concepts>

namespace routing_replay {

/// @brief When the host files (scatters) a step's rows into host storage.
enum class scatter_timing {
  at_end_of_step,  ///< end_step() waits for the copy and files the rows at once
  deferred,        ///< filed at a later end_step() (or drain) once the copy's event completed
};

/// @brief Copy the step on the compute stream and wait for it in end_step().
///
/// The simplest strategy and the reference for the others: the host pays the copy's latency every
/// step by design (report it, don't hide it). There is nothing in flight between steps, so the next
/// forward can never overwrite the device buffer while it is being read.
struct sync_copy {
  /// @brief Pinned stagings in the ring (one in-flight step at most).
  static constexpr int ring_depth = 1;
  /// @brief Whether copies run on a side stream that waits on the compute stream.
  static constexpr bool uses_side_stream = false;
  /// @brief When rows are filed.
  static constexpr scatter_timing timing = scatter_timing::at_end_of_step;
  /// @brief Human-readable name.
  static constexpr const char* name = "sync";
};

/// @brief A copy strategy: a ring of `ring_depth` pinned stagings, each with its event; copies on
/// the compute stream or on a side stream ordered by events; rows filed at end of step or deferred
/// until a staging's event has completed.
///
/// RoutingReplay's copy pipeline is written against these three facts; the compute stream always
/// waits on the event of the copy that reads the device buffer before the next forward writes it.
template <class C>
concept copy_strategy = requires {
  { C::ring_depth } -> std::convertible_to<int>;
  { C::uses_side_stream } -> std::convertible_to<bool>;
  { C::timing } -> std::convertible_to<scatter_timing>;
} && (C::ring_depth >= 1);

}  // namespace routing_replay
