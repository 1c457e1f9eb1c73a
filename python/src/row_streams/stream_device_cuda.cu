/// @file
/// CUDA module: the device side of routing_replay.vllm on the CUDA backend (stream_device.hpp), one
/// nvcc translation unit. No nanobind here: stream_module_cuda.cpp binds it with the host compiler.
#include "cuda_stream_cast.cuh"
#include "stream_device.hpp"

#include <memory>

namespace routing_replay::python {

/// @brief A CUDA-backend device side on the current device.
std::unique_ptr<stream_device_base> make_cuda_stream_device(std::int32_t layers, std::int32_t top_k, std::int32_t experts,
                                                            std::int32_t max_rows, std::int32_t depth, std::int32_t device)
{
  return make_stream_device<cuda_backend>(layers, top_k, experts, max_rows, depth, device);
}

}  // namespace routing_replay::python
