/// @file
/// CUDA module: the uint8, uint16 and int32 instantiations (instances.hpp lists the set).
#include "cuda_instances.hpp"
#include "cuda_stream_cast.cuh"
#include "instances.hpp"

namespace routing_replay::python {

void register_cuda_other_index_types(factory_table& table) { add_other_index_types<cuda_backend>(table, "cuda"); }

}  // namespace routing_replay::python
