/// @file
/// Every combination of index type x buffer layout x host storage for a backend and copy strategy,
/// as a doctest type list, so one TEST_CASE_TEMPLATE covers them all.
#pragma once

#include <routing_replay/routing_replay.hpp>

#include <cstdint>
#include <tuple>
#include <type_traits>

namespace rr_test {

template <class Backend, class Copy, class Index, class Layout>
using storages =
  std::tuple<routing_replay::RoutingReplay<Backend, Index, Layout, Copy, routing_replay::per_request_storage>,
             routing_replay::RoutingReplay<Backend, Index, Layout, Copy, routing_replay::block_slot_storage>>;

template <class... Tuples>
using concat = decltype(std::tuple_cat(std::declval<Tuples>()...));

template <class Backend, class Copy, class Index>
using layouts = concat<storages<Backend, Copy, Index, routing_replay::layer_major>,
                       storages<Backend, Copy, Index, routing_replay::token_major>>;

/// @brief The 8 combinations with unsigned index types.
template <class Backend, class Copy>
using unsigned_index_combinations =
  concat<layouts<Backend, Copy, std::uint8_t>, layouts<Backend, Copy, std::uint16_t>>;

/// @brief The 8 combinations with signed index types.
template <class Backend, class Copy>
using signed_index_combinations =
  concat<layouts<Backend, Copy, std::int16_t>, layouts<Backend, Copy, std::int32_t>>;

#if defined(RR_TEST_REPRESENTATIVE_COMBINATIONS)
/// @brief ROUTING_REPLAY_TEST_COMBINATIONS=representative (tests/CMakeLists.txt): 8 of the 16, each
/// index type with one layout, each layout with two index types, both storages.
template <class Backend, class Copy>
using all_combinations = concat<storages<Backend, Copy, std::uint8_t, routing_replay::layer_major>,
                                storages<Backend, Copy, std::uint16_t, routing_replay::token_major>,
                                storages<Backend, Copy, std::int16_t, routing_replay::layer_major>,
                                storages<Backend, Copy, std::int32_t, routing_replay::token_major>>;
#else
/// @brief The 16 combinations of one backend and one copy strategy.
template <class Backend, class Copy>
using all_combinations =
  concat<unsigned_index_combinations<Backend, Copy>, signed_index_combinations<Backend, Copy>>;
#endif

}  // namespace rr_test
