/// @file
/// CUDA module: the int16 token-major instantiations (instances.hpp lists the set).
#include "cuda_instances.hpp"
#include "cuda_stream_cast.cuh"
#include "instances.hpp"

namespace routing_replay::python {

void register_cuda_int16_token_major(factory_table& table) { add_int16<cuda_backend, token_major>(table, "cuda"); }

}  // namespace routing_replay::python
