/// @file
/// Appending an aggregate to a vector, built where it lives.
#pragma once

#include <utility>

namespace routing_replay::detail {

/// @brief Appends `T{args...}` to `v`, a vector of the aggregate T, and returns it. Built in place
/// (each field written once) where the compiler has C++20's parenthesized initialization of
/// aggregates (GCC 10, Clang 16); elsewhere (Clang 14 and 15) a temporary is moved in. A run or a
/// piece built aside and copied in is reloaded wide from its narrow stores, a store-forwarding
/// stall (step_plan::entry explains it), on every run of a step.
template <class Vector, class... Args>
[[gnu::always_inline]] inline auto& emplace_aggregate(Vector& v, Args&&... args)
{
#if defined(__cpp_aggregate_paren_init) && __cpp_aggregate_paren_init >= 201902L
  return v.emplace_back(std::forward<Args>(args)...);
#else
  return v.emplace_back(typename Vector::value_type{std::forward<Args>(args)...});
#endif
}

}  // namespace routing_replay::detail
