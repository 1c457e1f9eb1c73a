/// @file
/// engine_loop on CUDA, layer_major half (the other layout builds in parallel); also answers
/// whether a usable CUDA device is present.
#include "engine_loop_cuda.cuh"

namespace rr_bench {

bool cuda_device_available(std::string& description)
{
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    description = std::string{"cudaGetDeviceCount: "} + cudaGetErrorName(e) + ", " + cudaGetErrorString(e);
    return false;
  }
  if (count == 0) {
    description = "no CUDA device found";
    return false;
  }
  cudaDeviceProp properties{};
  if (cudaGetDeviceProperties(&properties, 0) == cudaSuccess) { description = properties.name; }
  return true;
}

int run_cuda_layer_major(const loop_options& o)
{
  return run_layout<cuda_platform, rr::layer_major>(o);
}

}  // namespace rr_bench
