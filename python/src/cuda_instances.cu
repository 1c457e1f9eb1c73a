/// @file
/// CUDA module: the compiled CUDA instantiations (one nvcc translation unit) and the few CUDA
/// runtime calls the module makes. No nanobind here: module_cuda.cpp binds it with the host
/// compiler.
#include "cuda_instances.hpp"
#include "instances.hpp"

#include <routing_replay/routing_replay.cuh>

#include <cuda_runtime_api.h>

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

void register_cuda(factory_table& table)
{
  add_int16<cuda_backend, layer_major>(table, "cuda");
  add_int16<cuda_backend, token_major>(table, "cuda");
  add_other_index_types<cuda_backend>(table, "cuda");
}

bool cuda_available() noexcept { return cuda_backend::available(); }

std::int32_t cuda_device_count() noexcept
{
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

std::int32_t cuda_current_device()
{
  int device = 0;
  detail::check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

void cuda_set_device(std::int32_t device) { detail::check_cuda(cudaSetDevice(device), "cudaSetDevice"); }

std::string cuda_runtime_version()
{
  int version = 0;
  if (cudaRuntimeGetVersion(&version) != cudaSuccess) { return "unknown"; }
  return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
}

}  // namespace routing_replay::python
