/// @file
/// The parts of kept_rows_pool (kept_rows_pool.hpp): an extent (one allocation slices are carved
/// from, back to back) and the memory policies extents come from.
#pragma once

#include <routing_replay/errors.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>

namespace routing_replay::detail::kept_pool {

/// @brief One allocation of the pool: slices are carved from it in order (a bump pointer), and it
/// is reused whole once every slice carved from it has been let go.
struct extent {
  std::byte* base   = nullptr;  ///< its first byte
  std::size_t bytes = 0;        ///< its size
  std::size_t used  = 0;        ///< bytes carved so far
  std::size_t live  = 0;        ///< slices carved and not let go
  bool current      = false;    ///< slices are being carved from it (it is not reused while so)
  std::size_t index = 0;        ///< its place in the pool's list of extents
};

/// @brief Rounds `bytes` up to a multiple of `alignment` (a power of two).
[[nodiscard]] constexpr std::size_t round_up(std::size_t bytes, std::size_t alignment) noexcept
{
  return (bytes + alignment - 1) & ~(alignment - 1);
}

/// @brief The system's page size.
[[nodiscard]] inline std::size_t page_bytes() noexcept { return static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)); }

/// @brief Writes one byte of every page of [p, p + bytes): the page faults are taken now, on the
/// calling thread, rather than by whoever first writes the page.
inline void touch_pages(void* p, std::size_t bytes) noexcept
{
  const std::size_t page = page_bytes();
  for (std::size_t b = 0; b < bytes; b += page) { static_cast<volatile std::byte*>(p)[b] = std::byte{0}; }
}

}  // namespace routing_replay::detail::kept_pool

namespace routing_replay {

/// @brief Ordinary host memory for a kept_rows_pool: anonymous private mappings, faulted in by the
/// thread that allocates them (the pool's filling thread).
struct host_kept_memory {
  /// @brief `bytes` of memory (a multiple of the page size), every page faulted in.
  /// @throws error host_memory_exhausted if the system refuses the mapping
  [[nodiscard]] void* allocate(std::size_t bytes) const
  {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      throw error{errc::host_memory_exhausted, std::string{"mmap of kept rows failed: "} + std::strerror(errno)};
    }
    // page by page, not MAP_POPULATE: populating holds the process's mmap lock for the whole
    // extent, and an engine thread mapping memory of its own meanwhile would wait for it
    detail::kept_pool::touch_pages(p, bytes);
    return p;
  }
  /// @brief Gives memory of allocate() back to the system.
  void deallocate(void* p, std::size_t bytes) const noexcept { ::munmap(p, bytes); }
  /// @brief Nothing for the filling thread to adopt.
  void enter_filling_thread() const noexcept {}
};

/// @brief Memory for a kept_rows_pool through two functions (pinned memory of a backend, say: the
/// memory a copy from the device lands in), and what the filling thread runs first (a CUDA backend:
/// adopt the engine's device). `allocate` must return memory whose pages it has faulted in.
struct function_kept_memory {
  void* (*allocate_fn)(std::size_t)         = nullptr;  ///< allocates, pages faulted in
  void (*deallocate_fn)(void*, std::size_t) = nullptr;  ///< frees what allocate_fn returned
  std::function<void()> enter;                          ///< run first on the filling thread (may be empty)

  /// @brief allocate_fn(bytes).
  [[nodiscard]] void* allocate(std::size_t bytes) const { return allocate_fn(bytes); }
  /// @brief deallocate_fn(p, bytes).
  void deallocate(void* p, std::size_t bytes) const noexcept { deallocate_fn(p, bytes); }
  /// @brief enter(), where set.
  void enter_filling_thread() const
  {
    if (enter) { enter(); }
  }
};

}  // namespace routing_replay
