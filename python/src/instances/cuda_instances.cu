/// @file
/// CUDA module: the registration of every CUDA instantiation and the few CUDA runtime calls the
/// module makes. The instantiations are in the generated nvcc translation units of
/// cuda_instances_of.cu.in, one per index type and layout, which a machine's cores build at once
/// (instances.hpp; CI builds the host module only). No nanobind here: module_cuda.cpp binds it with
/// the host compiler.
#include "cuda_instances.hpp"
#include "instances/instance_registry.hpp"

#include <routing_replay/routing_replay.cuh>

#include <cuda_runtime_api.h>

namespace routing_replay::python {

void register_cuda(factory_table& table) { register_cuda_instances(table); }

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
