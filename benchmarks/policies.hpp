/// @file
/// The one list of policies the benchmark binaries instantiate, and their names on the command
/// line and in the results. Every binary dispatches runtime choices over these lists, so adding a
/// policy here adds it everywhere (and to the build time: nvcc pays per instantiation).
#pragma once

#include <routing_replay/routing_replay.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace rr_bench {

namespace rr = routing_replay;

/// @brief A list of types, walked at compile time.
template <class... T>
struct type_list {};

/// @brief A type carried as a value, so a generic lambda can name it.
template <class T>
struct type_tag {
  using type = T;
};

/// @brief Calls `f(type_tag<T>{})` for every T of the list, in order.
template <class... T, class F>
void for_each_type(type_list<T...>, F&& f)
{
  (f(type_tag<T>{}), ...);
}

/// @brief Stored id types. uint16_t moves the same bytes as int16_t, so it is left out to keep the
/// nvcc build short; the tests cover it.
using index_types = type_list<std::int16_t, std::uint8_t, std::int32_t>;

/// @brief Device-buffer layouts.
using layout_types = type_list<rr::layer_major, rr::token_major>;

/// @brief Copy strategies, rings of depth 2.
using copy_types =
  type_list<rr::sync_copy, rr::async_event, rr::double_buffered<2>, rr::device_scatter<2>>;

/// @brief Host storages.
using storage_types = type_list<rr::per_request_storage, rr::block_slot_storage>;

/// @brief Name of a policy on the command line and in results: int16, layer_major, sync,
/// per_request, ...
template <class Policy>
constexpr std::string_view name_of() noexcept
{
  if constexpr (std::is_same_v<Policy, std::uint8_t>) {
    return "uint8";
  } else if constexpr (std::is_same_v<Policy, std::uint16_t>) {
    return "uint16";
  } else if constexpr (std::is_same_v<Policy, std::int16_t>) {
    return "int16";
  } else if constexpr (std::is_same_v<Policy, std::int32_t>) {
    return "int32";
  } else if constexpr (rr::buffer_layout<Policy>) {
    return rr::layout_traits<Policy>::name;
  } else {
    return Policy::name;  // copy strategies and storages
  }
}

/// @brief The names of a list's policies, in order.
template <class... Policy>
std::vector<std::string_view> names_of(type_list<Policy...>)
{
  return {name_of<Policy>()...};
}

/// @brief index/layout/copy/storage, as the engine loop and the microbenchmarks print it.
template <class Index, class Layout, class Copy, class Storage>
std::string policy_name()
{
  std::string s{name_of<Index>()};
  for (const auto part : {name_of<Layout>(), name_of<Copy>(), name_of<Storage>()}) {
    s.append(1, '/').append(part);
  }
  return s;
}

}  // namespace rr_bench
