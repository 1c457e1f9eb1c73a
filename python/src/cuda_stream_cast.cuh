/// @file
/// How the CUDA module's translation units turn integer stream handles into CUDA stream references.
#pragma once

#include "replay_impl.hpp"

#include <routing_replay/routing_replay.cuh>

#include <cstdint>

namespace routing_replay::python {

/// @brief CUDA backend: the handle is a cudaStream_t (0: the legacy default stream).
template <>
struct stream_cast<cuda_backend> {
  /// @brief The stream reference for a handle.
  static cuda::stream_ref from(std::uintptr_t handle)
  {
    return cuda::stream_ref{reinterpret_cast<cudaStream_t>(handle)};  // NOLINT: the handle protocol
  }
};

}  // namespace routing_replay::python
