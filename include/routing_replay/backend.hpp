/// @file
/// Backend policy: where the device buffer lives and how asynchronous work is ordered.
#pragma once

#include <routing_replay/detail/macros.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>

namespace routing_replay {

namespace detail {
/// @brief A do-nothing kernel body, to check that a backend can launch functors.
struct probe_kernel {
  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t) const noexcept {}
};
/// @brief A do-nothing block-shaped kernel body.
struct probe_block_kernel {
  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int32_t, std::int32_t) const noexcept {}
};
}  // namespace detail

/// @brief A backend: stream and event types plus the few asynchronous operations the library
/// issues (copies, fills, "kernel" launches, event record/wait/query), and the registration of
/// host memory that kernels write directly (device scatter).
///
/// Kernels are functors: `bulk_async(n, op)` calls `op(i)` for i in [0, n) (one thread each);
/// `launch_async(blocks, threads, op)` calls `op(block, thread)` for every pair, for kernels whose
/// threads share a unit of work by block, then, if `op` has one, `op.block_done(block)` once per
/// block after all its threads (the hook for a last block that finishes the step);
/// `launch_dependent_async` does the same for a kernel that only reads what the kernel before it
/// wrote, letting the device overlap the two launches. Kernels may not assume that blocks run
/// concurrently or in any order.
///
/// Host memory a kernel writes is pinned through `register_host`, also from a helper thread of the
/// library's own: `host_thread_context()` (on the engine's thread) names what such a thread must
/// adopt first (`adopt_host_thread_context`), so that its calls address the engine's device. Host
/// memory a kernel reads where the host wrote it, without a copy (the device scatter's op lists), comes
/// from `allocate_pinned` and goes back through `free_pinned`, which may wait for the device.
///
/// Two backends ship: cuda_backend (routing_replay/cuda_backend.cuh, needs nvcc) and host_backend
/// (routing_replay/host_backend.hpp, plain C++20).
template <class B>
concept backend = requires(typename B::stream_ref stream,
                           typename B::event& event,
                           typename B::template device_vector<int>& device,
                           typename B::template pinned_vector<int>& pinned,
                           void* dst,
                           const void* src,
                           std::size_t bytes) {
  typename B::stream;
  { B::available() } -> std::same_as<bool>;
  { B::data(device) } -> std::same_as<int*>;
  { B::data(pinned) } -> std::same_as<int*>;
  B::bulk_async(std::int64_t{1}, detail::probe_kernel{}, stream);
  B::launch_async(std::int32_t{1}, std::int32_t{32}, detail::probe_block_kernel{}, stream);
  B::launch_dependent_async(std::int32_t{1}, std::int32_t{32}, detail::probe_block_kernel{}, stream);
  B::register_host(dst, bytes);
  B::unregister_host(dst);
  { B::allocate_pinned(bytes) } -> std::same_as<void*>;
  B::free_pinned(dst, bytes);
  B::adopt_host_thread_context(B::host_thread_context());
  B::copy_async(dst, src, bytes, stream);
  B::copy_2d_async(dst, bytes, src, bytes, bytes, bytes, stream);
  B::fill_2d_async(dst, bytes, static_cast<unsigned char>(0), bytes, bytes, stream);
  B::record(event, stream);
  B::wait(stream, event);
  { B::ready(event) } -> std::same_as<bool>;
  B::synchronize(event);
  B::synchronize(stream);
};

/// @brief Whether every later event query of backend `B` reports a failure of earlier work on any
/// of its streams, so that the host learns of a failed step from the last event behind it alone.
/// CUDA's asynchronous errors are sticky (a failed kernel leaves the context unusable, and every
/// later call returns the error); a backend says so with a member `static constexpr bool
/// failures_are_sticky = true`. Otherwise the event recorded behind each stream's work is queried
/// too (host_backend hands a stream's failure to the next event recorded on that stream).
template <class B>
inline constexpr bool failures_are_sticky = requires { requires B::failures_are_sticky; };

}  // namespace routing_replay
