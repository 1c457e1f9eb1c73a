/// @file
/// The compiled set of instantiations: every policy combination of the index types a build
/// compiles, on both backends, so every Python test runs every combination on both.
///
/// Per index type (uint8, uint16, int16, int32; all four unless the CMake option
/// ROUTING_REPLAY_PYTHON_INDEX_TYPES names fewer): both layouts, the four copy strategies (rings of
/// depth 2) and both storages, 16; 64 in all. python/CMakeLists.txt generates the translation units
/// that instantiate them, so that a machine's cores build them at once: one per index type for the
/// host module (host_instances.cpp.in), one per index type and layout for the CUDA module, whose
/// nvcc units cost more each (cuda_instances_of.cu.in); and instance_registry.hpp, which registers
/// what was built.
#pragma once

#include "replay_impl.hpp"

#include <routing_replay/copy_strategy.hpp>
#include <routing_replay/host_storage.hpp>

#include <cstdint>

namespace routing_replay::python {

/// @brief Registers every copy strategy and storage for one index type and layout (8).
template <class Backend, class Index, class Layout>
void add_copy_and_storage(factory_table& table, const char* backend, const char* index)
{
  add_factory<Backend, Index, Layout, sync_copy, per_request_storage>(table, backend, index);
  add_factory<Backend, Index, Layout, sync_copy, block_slot_storage>(table, backend, index);
  add_factory<Backend, Index, Layout, async_event, per_request_storage>(table, backend, index);
  add_factory<Backend, Index, Layout, async_event, block_slot_storage>(table, backend, index);
  add_factory<Backend, Index, Layout, double_buffered<2>, per_request_storage>(table, backend, index);
  add_factory<Backend, Index, Layout, double_buffered<2>, block_slot_storage>(table, backend, index);
  add_factory<Backend, Index, Layout, device_scatter<2>, per_request_storage>(table, backend, index);
  add_factory<Backend, Index, Layout, device_scatter<2>, block_slot_storage>(table, backend, index);
}

}  // namespace routing_replay::python
