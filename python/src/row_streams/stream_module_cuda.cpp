/// @file
/// routing_replay._core_cuda's part of routing_replay.vllm: create_stream_device() for the CUDA
/// backend, returning the _StreamDevice class that _core binds.
#include "instances/cuda_instances.hpp"
#include "stream_bindings.hpp"
#include "stream_connector.hpp"

#include <nanobind/nanobind.h>

#include <memory>

namespace nb = nanobind;
using namespace nb::literals;

namespace routing_replay::python {

std::unique_ptr<stream_device_base> make_cuda_stream_device(std::int32_t layers, std::int32_t top_k, std::int32_t experts,
                                                            std::int32_t max_rows, std::int32_t depth, std::int32_t device);

void register_cuda_stream_device(nb::module_& m)
{
  m.def("create_stream_device",
        [](std::int32_t layers, std::int32_t top_k, std::int32_t experts, std::int32_t max_rows, std::int32_t depth) {
          return stream_device_handle{make_cuda_stream_device(layers, top_k, experts, max_rows, depth, cuda_current_device()),
                                      layers, top_k, experts, max_rows};
        },
        "num_layers"_a, "top_k"_a, "num_experts"_a, "max_rows"_a, "ring_depth"_a,
        "A CUDA-backend device side for routing_replay.vllm on the current device (internal).");
}

}  // namespace routing_replay::python
