/// @file
/// CUDA module: the slot_rows instantiations (slot_rows_impl.hpp), one nvcc translation unit.
#include "cuda_stream_cast.cuh"
#include "slot_rows_impl.hpp"

namespace routing_replay::python {

void register_cuda_slot_rows(slot_rows_factories& table) { add_slot_rows<cuda_backend>(table); }

}  // namespace routing_replay::python
