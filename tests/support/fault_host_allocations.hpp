/// @file
/// Replaces the global operator new and delete so that host allocations made by the library on the
/// driving thread, inside a library call, are failure points of rr_test::fault_injector
/// (fault_source::host_new): the armed one throws std::bad_alloc (or returns null for the nothrow
/// forms), every other allocation goes to malloc, which the sanitizers still watch.
///
/// Include in exactly one translation unit of an executable: replacement functions are global.
#pragma once

#include "fault_injection.hpp"

#include <cstdlib>
#include <new>

namespace rr_test::detail_fault {

inline void* allocate_or_fail(std::size_t size, std::size_t alignment)
{
  if (fault_injector::get().host_allocation_fails()) { return nullptr; }
  if (size == 0) { size = 1; }
  if (alignment <= alignof(std::max_align_t)) { return std::malloc(size); }
  return std::aligned_alloc(alignment, (size + alignment - 1) / alignment * alignment);
}

inline void* allocate_or_throw(std::size_t size, std::size_t alignment)
{
  void* p = allocate_or_fail(size, alignment);
  if (p == nullptr) { throw std::bad_alloc{}; }
  return p;
}

}  // namespace rr_test::detail_fault

// NOLINTBEGIN: the replaceable global allocation functions, as the standard names them
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
// every form allocates with malloc, so every form frees with free
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void* operator new(std::size_t size) { return rr_test::detail_fault::allocate_or_throw(size, 0); }
void* operator new[](std::size_t size) { return rr_test::detail_fault::allocate_or_throw(size, 0); }
void* operator new(std::size_t size, std::align_val_t a)
{
  return rr_test::detail_fault::allocate_or_throw(size, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t size, std::align_val_t a)
{
  return rr_test::detail_fault::allocate_or_throw(size, static_cast<std::size_t>(a));
}
void* operator new(std::size_t size, const std::nothrow_t&) noexcept
{
  return rr_test::detail_fault::allocate_or_fail(size, 0);
}
void* operator new[](std::size_t size, const std::nothrow_t&) noexcept
{
  return rr_test::detail_fault::allocate_or_fail(size, 0);
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
// NOLINTEND
