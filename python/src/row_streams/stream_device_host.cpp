/// @file
/// Host module: the device side of routing_replay.vllm on the host backend (stream_device.hpp).
#include "stream_connector.hpp"

namespace routing_replay::python {

std::unique_ptr<stream_device_base> make_host_stream_device(std::int32_t layers, std::int32_t top_k, std::int32_t experts,
                                                            std::int32_t max_rows, std::int32_t depth)
{
  return make_stream_device<host_backend>(layers, top_k, experts, max_rows, depth, 0);
}

}  // namespace routing_replay::python
