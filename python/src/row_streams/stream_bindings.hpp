/// @file
/// Registration of routing_replay.vllm's native classes: called from the modules' NB_MODULE.
#pragma once

#include <nanobind/nanobind.h>

namespace routing_replay::python {

/// @brief Binds _StreamDevice, VllmStreams, PendingAuxOutput, AuxRequestOutput and
/// BlockObjectStoreError into _core, and create_stream_device() for the host backend.
void register_vllm_streams(nanobind::module_& m);

/// @brief Adds KeptPool to the host module (bind_kept.cpp): host memory faulted in ahead of need
/// for copies a consumer keeps (Replay's extraction copies, routing_replay.sglang's reads).
void bind_kept(nanobind::module_& m);

/// @brief Binds create_stream_device() for the CUDA backend into _core_cuda (stream_module_cuda.cpp).
void register_cuda_stream_device(nanobind::module_& m);

}  // namespace routing_replay::python
