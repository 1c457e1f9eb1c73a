// The replaceable global operator new, counting the bytes it hands out while counting is on; linked
// into the programs that report a capture-only rank's host allocations (parallel_tests,
// parallel_bench). A host translation unit: nvcc would also compile a replacement for the device.
#include "allocation_counter.hpp"

#include <atomic>
#include <cstdlib>
#include <new>

namespace {
std::atomic<bool> counting{false};
std::atomic<std::size_t> counted{0};
}  // namespace

namespace rr_test {
void count_allocations(bool on) { counting.store(on); }
std::size_t allocated_bytes_taken() { return counted.exchange(0); }
}  // namespace rr_test

void* operator new(std::size_t n)
{
  if (counting.load(std::memory_order_relaxed)) { counted.fetch_add(n, std::memory_order_relaxed); }
  if (void* p = std::malloc(n == 0 ? 1 : n)) { return p; }
  throw std::bad_alloc{};
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
