/// @file
/// The compiled set of instantiations: which policy combinations a backend module registers.
///
/// Host module: every combination (4 index types x 2 layouts x 4 copy strategies x 2 storages,
/// less device_scatter with per_request storage: 56), one translation unit per copy strategy.
/// CUDA module (cuda_instances.cu, one nvcc translation unit): every copy strategy and storage
/// for int16 with both layouts, and for int32 and uint8 with layer_major: 28.
#pragma once

#include "replay_impl.hpp"

#include <routing_replay/copy_strategy.hpp>
#include <routing_replay/host_storage.hpp>

#include <cstdint>

namespace routing_replay::python {

/// @brief Registers <Backend, Index, Layout, Copy, Storage> for every index type the module offers.
template <class Backend, class Layout, class Copy, class Storage>
void add_index_types(factory_table& table, const char* backend)
{
  add_factory<Backend, std::uint8_t, Layout, Copy, Storage>(table, backend, "uint8");
  add_factory<Backend, std::uint16_t, Layout, Copy, Storage>(table, backend, "uint16");
  add_factory<Backend, std::int16_t, Layout, Copy, Storage>(table, backend, "int16");
  add_factory<Backend, std::int32_t, Layout, Copy, Storage>(table, backend, "int32");
}

/// @brief Registers every index type, layout and storage for one copy strategy (device_scatter
/// takes block_slot storage only: with per_request storage it does not compile, by design).
template <class Backend, class Copy>
void add_copy_strategy(factory_table& table, const char* backend)
{
  if constexpr (Copy::site == scatter_site::host) {
    add_index_types<Backend, layer_major, Copy, per_request_storage>(table, backend);
    add_index_types<Backend, token_major, Copy, per_request_storage>(table, backend);
  }
  add_index_types<Backend, layer_major, Copy, block_slot_storage>(table, backend);
  add_index_types<Backend, token_major, Copy, block_slot_storage>(table, backend);
}

/// @brief Registers every copy strategy and storage for one index type and layout (the 7 valid
/// combinations).
template <class Backend, class Index, class Layout>
void add_copy_and_storage(factory_table& table, const char* backend, const char* index)
{
  add_factory<Backend, Index, Layout, sync_copy, per_request_storage>(table, backend, index);
  add_factory<Backend, Index, Layout, sync_copy, block_slot_storage>(table, backend, index);
  add_factory<Backend, Index, Layout, async_event, per_request_storage>(table, backend, index);
  add_factory<Backend, Index, Layout, async_event, block_slot_storage>(table, backend, index);
  add_factory<Backend, Index, Layout, double_buffered<2>, per_request_storage>(table, backend, index);
  add_factory<Backend, Index, Layout, double_buffered<2>, block_slot_storage>(table, backend, index);
  add_factory<Backend, Index, Layout, device_scatter<2>, block_slot_storage>(table, backend, index);
}

/// @brief Host module: sync_copy instantiations (host_sync.cpp).
void register_host_sync(factory_table& table);
/// @brief Host module: async_event instantiations (host_async_event.cpp).
void register_host_async_event(factory_table& table);
/// @brief Host module: double_buffered<2> instantiations (host_double_buffered.cpp).
void register_host_double_buffered(factory_table& table);
/// @brief Host module: device_scatter<2> instantiations (host_device_scatter.cpp).
void register_host_device_scatter(factory_table& table);

}  // namespace routing_replay::python
