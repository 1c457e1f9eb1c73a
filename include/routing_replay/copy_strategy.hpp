/// @file
/// Copy-strategy policy: how the step's rows leave the device buffer and when they are filed.
#pragma once

#include <concepts>

namespace routing_replay {

/// @brief When the host files (scatters) a step's rows into host storage.
enum class scatter_timing {
  at_end_of_step,  ///< end_step() waits for the copy and files the rows at once
  deferred,        ///< filed at a later end_step() (or a drain) once the copy's event completed
};

/// @brief Who writes rows to their final place in host storage.
enum class scatter_site {
  host,    ///< rows arrive in a pinned staging; the host copies each one to its place
  device,  ///< a kernel writes each row straight to its place in mapped pinned host storage
};

/// @brief Copy the step on the compute stream and wait for it in end_step().
///
/// The simplest strategy and the reference for the others: the host pays the copy's latency every
/// step by design (report it, don't hide it). Nothing is in flight between steps.
struct sync_copy {
  /// @brief Steps that may be in flight at once (pinned stagings, device snapshots, events).
  static constexpr int ring_depth = 1;
  /// @brief Whether copies run on a side stream ordered after the compute stream by an event.
  static constexpr bool uses_side_stream = false;
  /// @brief When rows are filed.
  static constexpr scatter_timing timing = scatter_timing::at_end_of_step;
  /// @brief Who writes rows to their place.
  static constexpr scatter_site site = scatter_site::host;
  /// @brief Human-readable name.
  static constexpr const char* name = "sync";
};

/// @brief Copy on a side stream that waits on an event of the compute stream; file the step at the
/// next end_step() (or at a drain before extraction) once the copy's event has completed.
///
/// One pinned staging: the next step's copy is issued only after this one has been filed, so
/// end_step() waits when the previous copy has not finished yet (engines that synchronize on their
/// sampled tokens every step never see that wait; engines one step ahead do: use double_buffered).
struct async_event {
  /// @brief Steps that may be in flight at once.
  static constexpr int ring_depth = 1;
  /// @brief Whether copies run on a side stream.
  static constexpr bool uses_side_stream = true;
  /// @brief When rows are filed.
  static constexpr scatter_timing timing = scatter_timing::deferred;
  /// @brief Who writes rows to their place.
  static constexpr scatter_site site = scatter_site::host;
  /// @brief Human-readable name.
  static constexpr const char* name = "async_event";
};

/// @brief A ring of `Depth` pinned stagings, each with its event, on a side stream: a step's copy
/// is issued at once and never waits for the previous step's scatter; end_step() files every
/// earlier step whose copy has completed, without blocking, and blocks only when all `Depth`
/// stagings are still being copied into.
/// @tparam Depth stagings in the ring, at least 2
template <int Depth = 2>
struct double_buffered {
  static_assert(Depth >= 2, "double_buffered needs a ring of at least two stagings");
  /// @brief Steps that may be in flight at once.
  static constexpr int ring_depth = Depth;
  /// @brief Whether copies run on a side stream.
  static constexpr bool uses_side_stream = true;
  /// @brief When rows are filed.
  static constexpr scatter_timing timing = scatter_timing::deferred;
  /// @brief Who writes rows to their place.
  static constexpr scatter_site site = scatter_site::host;
  /// @brief Human-readable name.
  static constexpr const char* name = "double_buffered";
};

/// @brief A kernel on a side stream writes every row straight to its final place in mapped pinned
/// host storage: the host copies nothing. Where each row goes is decided when the step begins.
///
/// Needs storage whose row addresses never move while a kernel may write them: block_slot_storage
/// (one pool allocated up front) and per_request_storage (segments of registered row memory that
/// never move while their request lives; detail/host_storage/request_ranges.hpp) both qualify. A device-reported error (an invalid id, an unwritten row) cannot stop rows
/// already on their way: the kernel writes the sentinel instead of the step's rows, so they read as
/// missing, and the error surfaces when the step is retired.
/// @tparam Depth steps in flight at once, at least 1
template <int Depth = 2>
struct device_scatter {
  static_assert(Depth >= 1, "device_scatter needs at least one step in flight");
  /// @brief Steps that may be in flight at once.
  static constexpr int ring_depth = Depth;
  /// @brief Whether copies run on a side stream.
  static constexpr bool uses_side_stream = true;
  /// @brief When rows are filed (here: when the step's status is checked).
  static constexpr scatter_timing timing = scatter_timing::deferred;
  /// @brief Who writes rows to their place.
  static constexpr scatter_site site = scatter_site::device;
  /// @brief Human-readable name.
  static constexpr const char* name = "device_scatter";
};

/// @brief A copy strategy: a ring of `ring_depth` steps in flight (device snapshot, pinned staging
/// and event each), copies on the compute stream or on a side stream ordered by events, rows filed
/// at end of step or deferred until a step's event has completed, by the host or by a kernel.
///
/// Whatever the strategy, the end of a step snapshots D on the device and resets it in one kernel
/// on the compute stream, so the next forward may write D at once: only the snapshot is read by the
/// copy, and the compute stream waits on a snapshot's copy event before reusing that snapshot.
template <class C>
concept copy_strategy = requires {
  { C::ring_depth } -> std::convertible_to<int>;
  { C::uses_side_stream } -> std::convertible_to<bool>;
  { C::timing } -> std::convertible_to<scatter_timing>;
  { C::site } -> std::convertible_to<scatter_site>;
} && (C::ring_depth >= 1) && (C::site == scatter_site::host || C::uses_side_stream);

}  // namespace routing_replay
