/// @file
/// Where host storage keeps its rows: memory only the host writes, or memory a kernel writes too
/// (device scatter), which is pinned and mapped through the backend.
#pragma once

#include <cstddef>
#include <type_traits>
#include <vector>

namespace routing_replay::detail {

/// @brief Rows only the host writes: ordinary memory.
struct host_written_rows {
  /// @brief Whether kernels write the rows.
  static constexpr bool device_writable = false;
  /// @brief A container for a pool of rows.
  template <class T>
  using vector = std::vector<T>;
  /// @brief Nothing to register.
  static void register_host(void*, std::size_t) noexcept {}
  /// @brief Nothing to unregister.
  static void unregister_host(void*) noexcept {}
  /// @brief Nothing a helper thread must adopt.
  struct thread_state {};
  /// @brief The calling thread's state: nothing.
  [[nodiscard]] static thread_state thread_context() noexcept { return {}; }
  /// @brief Nothing to adopt.
  static void adopt_thread_context(thread_state) noexcept {}
};

/// @brief Rows a kernel writes straight into host memory: pinned, and mapped for the device at the
/// host's addresses, through `Backend`.
template <class Backend>
struct device_written_rows {
  /// @brief Whether kernels write the rows.
  static constexpr bool device_writable = true;
  /// @brief A container for a pool of rows: the backend's pinned memory.
  template <class T>
  using vector = typename Backend::template pinned_vector<T>;
  /// @brief Pins and maps memory the store allocated itself.
  static void register_host(void* p, std::size_t bytes) { Backend::register_host(p, bytes); }
  /// @brief Undoes register_host().
  static void unregister_host(void* p) noexcept { Backend::unregister_host(p); }
  /// @brief What a helper thread that registers rows adopts (the engine's device).
  using thread_state = typename Backend::host_thread_state;
  /// @brief The calling thread's state.
  [[nodiscard]] static thread_state thread_context() { return Backend::host_thread_context(); }
  /// @brief Makes the calling helper thread register as the engine's thread would.
  static void adopt_thread_context(thread_state s) { Backend::adopt_host_thread_context(s); }
};

}  // namespace routing_replay::detail
