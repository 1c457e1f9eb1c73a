/// @file
/// The instantiations, by unit: one index type and layout with the four copy strategies (rings of
/// depth 2) and both storages, 8; 8 units, 64 combinations, per backend.
///
/// python/CMakeLists.txt generates the units compiled ahead of time (by default int16 with
/// layer_major; all with ROUTING_REPLAY_PYTHON_ALL_COMBINATIONS=ON) from host_instances.cpp.in and
/// cuda_instances_of.cu.in, and instance_registry.hpp, which registers them. routing_replay/_jit.py
/// compiles any other unit on first use, from the same templates with ROUTING_REPLAY_JIT_UNIT
/// defined, into a shared library the module loads (jit_loader.hpp).
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

/// @brief The entry point of a unit compiled on first use: registers its instantiations into the
/// factory table of the module that loads it (jit_loader.hpp). extern "C" and visible, the only
/// symbol such a library exports; the table is passed as void* so that the name is not mangled.
#define ROUTING_REPLAY_JIT_ENTRY(register_function)                                                      \
  extern "C" __attribute__((visibility("default"))) void routing_replay_register_instances(void* table) \
  {                                                                                                     \
    routing_replay::python::register_function(*static_cast<routing_replay::python::factory_table*>(table)); \
  }
