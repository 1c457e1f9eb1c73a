/// @file
/// Backend policy: where the device buffer lives and how asynchronous work is ordered.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>

namespace routing_replay {

/// @brief A backend: stream and event types plus the few asynchronous operations the library
/// issues (copies, fills, a bulk "kernel" launch, event record/wait/query).
///
/// Two backends ship: cuda_backend (routing_replay/cuda_backend.cuh, needs nvcc) and host_backend
/// (routing_replay/host_backend.hpp, plain C++20).
template <class B>
concept backend = requires(typename B::stream_ref stream,
                           typename B::event& event,
                           void* dst,
                           const void* src,
                           std::size_t bytes) {
  typename B::stream;
  typename B::template device_vector<int>;
  typename B::template pinned_vector<int>;
  { B::available() } -> std::same_as<bool>;
  B::copy_async(dst, src, bytes, stream);
  B::copy_2d_async(dst, bytes, src, bytes, bytes, bytes, stream);
  B::fill_2d_async(dst, bytes, static_cast<unsigned char>(0), bytes, bytes, stream);
  B::record(event, stream);
  B::wait(stream, event);
  { B::ready(event) } -> std::same_as<bool>;
  B::synchronize(event);
  B::synchronize(stream);
};

}  // namespace routing_replay
