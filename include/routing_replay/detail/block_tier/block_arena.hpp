/// @file
/// The memory of the block tier: one anonymous mapping of equal-sized blocks that grows in place
/// where the kernel can move it (mremap), with its pages faulted in ahead of the slots the tier
/// hands out next, so that storing a fresh block touches memory that is already there.
#pragma once

#include <routing_replay/errors.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

namespace routing_replay::detail {

/// @brief `num_blocks` blocks of `block_bytes` in one private anonymous mapping.
///
/// Pages are not touched when the arena is made: fault_in() touches the pages of a range of slots,
/// and the tier calls it ahead of the next fresh slot, on the thread that stores blocks.
class block_arena {
 public:
  /// @brief Maps room for `num_blocks` blocks (at least one).
  /// @throws error host_memory_exhausted when the mapping is refused
  block_arena(std::size_t block_bytes, std::size_t num_blocks)
    : block_bytes_(block_bytes), bytes_(block_bytes * std::max<std::size_t>(num_blocks, 1))
  {
    base_ = map(bytes_);
  }
  block_arena(const block_arena&)            = delete;
  block_arena& operator=(const block_arena&) = delete;
  /// @brief Takes over another arena's mapping.
  block_arena(block_arena&& other) noexcept
    : block_bytes_(other.block_bytes_),
      bytes_(std::exchange(other.bytes_, 0)),
      faulted_(std::exchange(other.faulted_, 0)),
      base_(std::exchange(other.base_, nullptr))
  {
  }
  block_arena& operator=(block_arena&&) = delete;
  ~block_arena()
  {
    if (base_ != nullptr) { ::munmap(base_, bytes_); }
  }

  /// @brief Bytes of one block.
  [[nodiscard]] std::size_t block_bytes() const noexcept { return block_bytes_; }
  /// @brief Bytes mapped.
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  /// @brief Blocks that fit.
  [[nodiscard]] std::size_t capacity_blocks() const noexcept { return bytes_ / block_bytes_; }
  /// @brief The first byte of block `slot`.
  [[nodiscard]] std::byte* block(std::int64_t slot) const noexcept
  {
    return base_ + static_cast<std::size_t>(slot) * block_bytes_;
  }

  /// @brief Grows the mapping to `bytes` (more than now), keeping its contents; the address may
  /// change.
  /// @throws error host_memory_exhausted when the kernel refuses
  void grow(std::size_t bytes)
  {
#if defined(__linux__)
    void* moved = ::mremap(base_, bytes_, bytes, MREMAP_MAYMOVE);
    if (moved == MAP_FAILED) { fail("mremap", bytes); }
    base_ = static_cast<std::byte*>(moved);
#else
    std::byte* grown = map(bytes);
    std::memcpy(grown, base_, bytes_);
    ::munmap(base_, bytes_);
    base_ = grown;
#endif
    bytes_ = bytes;
  }

  /// @brief Touches every page of blocks [0, end_slot) not touched yet, so that later stores there
  /// take no page fault. Contents are kept: each page's first byte is written back as it was read.
  void fault_in(std::int64_t end_slot) noexcept
  {
    const std::size_t end = std::min(bytes_, static_cast<std::size_t>(std::max<std::int64_t>(end_slot, 0)) * block_bytes_);
    static const std::size_t page = page_size();
    std::size_t at = faulted_;  // a multiple of the page size: pages below it were touched
    for (; at < end; at += page) {
      // a write (a read alone maps the shared zero page, and the first store faults again), of the
      // byte already there: a store may have reached the page before this touch did
      auto* byte = reinterpret_cast<volatile unsigned char*>(base_ + at);  // NOLINT: touching the page is the point
      *byte      = *byte;
    }
    faulted_ = std::max(faulted_, at);
  }

 private:
  static std::size_t page_size() noexcept
  {
    const long size = ::sysconf(_SC_PAGESIZE);
    return size > 0 ? static_cast<std::size_t>(size) : 4096;
  }

  static std::byte* map(std::size_t bytes)
  {
    void* at = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (at == MAP_FAILED) { fail("mmap", bytes); }
    return static_cast<std::byte*>(at);
  }

  [[noreturn]] static void fail(const char* what, std::size_t bytes)
  {
    throw error{errc::host_memory_exhausted, std::string{"block tier: "} + what + " of " + std::to_string(bytes) +
                                               " bytes failed: " + std::strerror(errno)};
  }

  std::size_t block_bytes_;
  std::size_t bytes_;
  std::size_t faulted_ = 0;  // bytes from the start whose pages were touched (a multiple of the page size)
  std::byte* base_     = nullptr;
};

}  // namespace routing_replay::detail
