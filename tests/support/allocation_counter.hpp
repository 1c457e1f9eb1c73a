/// @file
/// Counts host allocations (allocation_counter.cpp replaces operator new), for the figure of a
/// capture-only rank's host memory.
#pragma once

#include <cstddef>

namespace rr_test {
/// @brief Turns counting of operator new's bytes (on every thread) on or off.
void count_allocations(bool on);
/// @brief The bytes counted since the last call.
std::size_t allocated_bytes_taken();
}  // namespace rr_test
