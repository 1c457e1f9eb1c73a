/// @file
/// CUDA module: the int16 layer-major instantiations, the registration of every CUDA instantiation
/// and the few CUDA runtime calls the module makes. The other instantiations are in
/// cuda_int16_token_major.cu and cuda_other_index_types.cu: three nvcc translation units that a
/// machine's cores build at once (CI builds the host module only). No nanobind here:
/// module_cuda.cpp binds it with the host compiler.
#include "cuda_instances.hpp"
#include "cuda_stream_cast.cuh"
#include "instances.hpp"

#include <routing_replay/routing_replay.cuh>

#include <cuda_runtime_api.h>

namespace routing_replay::python {

void register_cuda(factory_table& table)
{
  add_int16<cuda_backend, layer_major>(table, "cuda");
  register_cuda_int16_token_major(table);
  register_cuda_other_index_types(table);
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
