/// @file
/// A prefetch of an array element by an index not checked yet.
#pragma once

#include <cstddef>
#include <cstdint>

namespace routing_replay::detail {

/// @brief Asks the processor for element `i` of the array at `first`, to be written, whatever `i`
/// is. The address is formed as an integer, so an index past the array makes no out-of-bounds
/// pointer, and a prefetch of an address nothing maps is dropped, never a fault. Where a planner
/// prefetches the next requests of a plan, this saves the bounds check (two loads, a subtraction
/// and a shift) that each of them would otherwise repeat.
template <class T>
[[gnu::always_inline]] inline void prefetch_for_write(const T* first, std::size_t i) noexcept
{
  const std::uintptr_t address = reinterpret_cast<std::uintptr_t>(first) + i * sizeof(T);
  __builtin_prefetch(reinterpret_cast<const void*>(address), 1);
}

}  // namespace routing_replay::detail
