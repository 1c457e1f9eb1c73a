/// @file
/// One combination per copy strategy (and two ring depths), varied over index type, layout and
/// storage, for the pipeline checks that run once per strategy rather than once per combination.
#pragma once

#include <routing_replay/routing_replay.hpp>

#include <cstdint>
#include <tuple>
#include <utility>

namespace rr_test::strategies {

namespace rr = routing_replay;

template <class B>
using sync_int16 = rr::RoutingReplay<B, std::int16_t, rr::layer_major, rr::sync_copy, rr::per_request_storage>;
template <class B>
using async_event_uint8 =
  rr::RoutingReplay<B, std::uint8_t, rr::token_major, rr::async_event, rr::per_request_storage>;
template <class B>
using double_buffered_int16 =
  rr::RoutingReplay<B, std::int16_t, rr::layer_major, rr::double_buffered<2>, rr::block_slot_storage>;
template <class B>
using double_buffered4_int32 =
  rr::RoutingReplay<B, std::int32_t, rr::token_major, rr::double_buffered<4>, rr::per_request_storage>;
template <class B>
using device_scatter_uint16 =
  rr::RoutingReplay<B, std::uint16_t, rr::token_major, rr::device_scatter<2>, rr::block_slot_storage>;
template <class B>
using device_scatter3_int16 =
  rr::RoutingReplay<B, std::int16_t, rr::layer_major, rr::device_scatter<3>, rr::per_request_storage>;

template <class B>
using sync_block_slot_uint8 =
  rr::RoutingReplay<B, std::uint8_t, rr::token_major, rr::sync_copy, rr::block_slot_storage>;
template <class B>
using async_event_block_slot_int16 =
  rr::RoutingReplay<B, std::int16_t, rr::layer_major, rr::async_event, rr::block_slot_storage>;

}  // namespace rr_test::strategies

namespace rr_test {

/// @brief Every copy strategy, each with a different index type, layout and storage.
template <class B>
using one_per_strategy =
  std::tuple<strategies::sync_int16<B>, strategies::async_event_uint8<B>, strategies::double_buffered_int16<B>,
             strategies::double_buffered4_int32<B>, strategies::device_scatter_uint16<B>,
             strategies::device_scatter3_int16<B>>;

/// @brief Every copy strategy with each storage it takes (one_per_strategy plus the pairings it
/// lacks), for the checks that run per strategy and storage on the GPU.
template <class B>
using every_strategy_and_storage =
  decltype(std::tuple_cat(std::declval<one_per_strategy<B>>(),
                          std::declval<std::tuple<strategies::sync_block_slot_uint8<B>,
                                                  strategies::async_event_block_slot_int16<B>>>()));

/// @brief The strategies that copy on a side stream (all but sync_copy).
template <class B>
using side_stream_strategies =
  std::tuple<strategies::async_event_uint8<B>, strategies::double_buffered_int16<B>,
             strategies::double_buffered4_int32<B>, strategies::device_scatter_uint16<B>>;

}  // namespace rr_test
