/// @file
/// One combination per copy strategy (and two ring depths), varied over index type, layout and
/// storage, for the pipeline checks that run once per strategy rather than once per combination.
#pragma once

#include <routing_replay/routing_replay.hpp>

#include <cstdint>
#include <tuple>

namespace rr_test {

/// @brief Every copy strategy, each with a different index type, layout and storage.
template <class Backend>
using one_per_strategy = std::tuple<
  routing_replay::RoutingReplay<Backend, std::int16_t, routing_replay::layer_major, routing_replay::sync_copy,
                                routing_replay::per_request_storage>,
  routing_replay::RoutingReplay<Backend, std::uint8_t, routing_replay::token_major, routing_replay::async_event,
                                routing_replay::per_request_storage>,
  routing_replay::RoutingReplay<Backend, std::int16_t, routing_replay::layer_major,
                                routing_replay::double_buffered<2>, routing_replay::block_slot_storage>,
  routing_replay::RoutingReplay<Backend, std::int32_t, routing_replay::token_major,
                                routing_replay::double_buffered<4>, routing_replay::per_request_storage>,
  routing_replay::RoutingReplay<Backend, std::uint16_t, routing_replay::token_major,
                                routing_replay::device_scatter<2>, routing_replay::block_slot_storage>,
  routing_replay::RoutingReplay<Backend, std::int16_t, routing_replay::layer_major,
                                routing_replay::device_scatter<3>, routing_replay::block_slot_storage>>;

/// @brief The strategies that copy on a side stream (all but sync_copy), as above.
template <class Backend>
using side_stream_strategies = std::tuple<
  routing_replay::RoutingReplay<Backend, std::uint8_t, routing_replay::token_major, routing_replay::async_event,
                                routing_replay::per_request_storage>,
  routing_replay::RoutingReplay<Backend, std::int16_t, routing_replay::layer_major,
                                routing_replay::double_buffered<2>, routing_replay::block_slot_storage>,
  routing_replay::RoutingReplay<Backend, std::int32_t, routing_replay::token_major,
                                routing_replay::double_buffered<4>, routing_replay::per_request_storage>,
  routing_replay::RoutingReplay<Backend, std::uint16_t, routing_replay::token_major,
                                routing_replay::device_scatter<2>, routing_replay::block_slot_storage>>;

}  // namespace rr_test
