/// @file
/// The compiled set of instantiations: which policy combinations a backend module registers.
///
/// The same 28 on both backends, so every Python test runs on both:
/// - int16 (the default; FlashInfer's routing_replay_out type) with both layouts, every copy
///   strategy and every storage: 16;
/// - uint8, uint16 and int32 with layer_major and the two strategies engines run in production,
///   double_buffered and device_scatter, each with both storages: 12.
/// Copy strategies with a ring use depth 2. The host module builds them in three translation units
/// (so cores build them at once); the CUDA module in three nvcc translation units likewise.
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

/// @brief The int16 instantiations with one layout: every copy strategy and storage (8).
template <class Backend, class Layout>
void add_int16(factory_table& table, const char* backend)
{
  add_copy_and_storage<Backend, std::int16_t, Layout>(table, backend, "int16");
}

/// @brief One more index type with layer_major and the production strategies, double_buffered and
/// device_scatter, each with both storages (4).
template <class Backend, class Index>
void add_production_strategies(factory_table& table, const char* backend, const char* index)
{
  add_factory<Backend, Index, layer_major, double_buffered<2>, per_request_storage>(table, backend, index);
  add_factory<Backend, Index, layer_major, double_buffered<2>, block_slot_storage>(table, backend, index);
  add_factory<Backend, Index, layer_major, device_scatter<2>, per_request_storage>(table, backend, index);
  add_factory<Backend, Index, layer_major, device_scatter<2>, block_slot_storage>(table, backend, index);
}

/// @brief The uint8, uint16 and int32 instantiations (12).
template <class Backend>
void add_other_index_types(factory_table& table, const char* backend)
{
  add_production_strategies<Backend, std::uint8_t>(table, backend, "uint8");
  add_production_strategies<Backend, std::uint16_t>(table, backend, "uint16");
  add_production_strategies<Backend, std::int32_t>(table, backend, "int32");
}

/// @brief Host module: int16 with layer_major (host_int16_layer_major.cpp).
void register_host_int16_layer_major(factory_table& table);
/// @brief Host module: int16 with token_major (host_int16_token_major.cpp).
void register_host_int16_token_major(factory_table& table);
/// @brief Host module: uint8, uint16 and int32 (host_other_index_types.cpp).
void register_host_other_index_types(factory_table& table);

}  // namespace routing_replay::python
