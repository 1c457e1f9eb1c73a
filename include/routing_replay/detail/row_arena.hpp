/// @file
/// The backing memory of per-request rows: blocks of one anonymous shared-memory file, each
/// reachable at two addresses. Its arena address, fixed for the arena's lifetime, is where kernels
/// write rows (device scatter); the same block is also mapped into a request's own reserved range,
/// so that the host sees the request's rows contiguous however many blocks they span. Growth never
/// moves a row, and neither the host nor a kernel ever copies rows to grow. Linux (memfd).
#pragma once

#include <routing_replay/errors.hpp>

#include <sys/mman.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace routing_replay::detail {

/// @brief Throws host_memory_exhausted naming a failed system call and its errno.
[[noreturn]] inline void throw_system_error(const char* what)
{
  throw error{errc::host_memory_exhausted, std::string{what} + " failed: " + std::strerror(errno)};
}

/// @brief Blocks of `base << order` bytes (order in [0, max_order]) from a buddy allocator over a
/// memfd that grows by superblocks of `base << max_order` bytes. Superblocks are mapped once, at
/// addresses that never change, and registered through `RowMemory` when kernels write them. Freed
/// blocks keep their pages: the next request that takes them maps pages already there, instead of
/// faulting fresh ones in as it is filled (a page fault of shared memory costs about as much as
/// filing the page's rows).
template <class RowMemory>
class row_arena {
 public:
  /// @brief A block: its offset in the file and its order.
  struct block {
    std::uint64_t offset = 0;  ///< bytes from the start of the file
    int order            = 0;  ///< the block holds base << order bytes
  };

  /// @brief An arena of blocks of `base` (a multiple of the page size) to `base << max_order` bytes.
  row_arena(std::size_t base, int max_order)
    : base_(base), max_order_(max_order), free_(static_cast<std::size_t>(max_order) + 1)
  {
    fd_ = ::memfd_create("routing_replay_rows", MFD_CLOEXEC);
    if (fd_ < 0) { throw_system_error("memfd_create"); }
  }
  row_arena(row_arena&& other) noexcept
    : base_(other.base_),
      max_order_(other.max_order_),
      fd_(std::exchange(other.fd_, -1)),
      superblocks_(std::move(other.superblocks_)),
      free_(std::move(other.free_)),
      in_use_(std::exchange(other.in_use_, 0))
  {
  }
  row_arena& operator=(row_arena&& other) noexcept
  {
    std::swap(base_, other.base_);
    std::swap(max_order_, other.max_order_);
    std::swap(fd_, other.fd_);
    std::swap(superblocks_, other.superblocks_);
    std::swap(free_, other.free_);
    std::swap(in_use_, other.in_use_);
    return *this;
  }
  row_arena(const row_arena&)            = delete;
  row_arena& operator=(const row_arena&) = delete;
  ~row_arena()
  {
    for (std::byte* s : superblocks_) {
      RowMemory::unregister_host(s);
      ::munmap(s, superblock_bytes());
    }
    if (fd_ >= 0) { ::close(fd_); }
  }

  /// @brief Bytes of a block of `order`.
  [[nodiscard]] std::size_t block_bytes(int order) const noexcept { return base_ << order; }
  /// @brief The largest order.
  [[nodiscard]] int max_order() const noexcept { return max_order_; }
  /// @brief Bytes of blocks handed out and not released.
  [[nodiscard]] std::size_t bytes_in_use() const noexcept { return in_use_; }
  /// @brief The file, for mapping blocks elsewhere.
  [[nodiscard]] int fd() const noexcept { return fd_; }

  /// @brief The arena address of a byte of the file (fixed while the arena lives).
  [[nodiscard]] std::byte* address(std::uint64_t offset) const noexcept
  {
    const auto bytes = static_cast<std::uint64_t>(superblock_bytes());
    return superblocks_[static_cast<std::size_t>(offset / bytes)] + offset % bytes;
  }

  /// @brief A free block of `order`, splitting a larger one or adding a superblock.
  /// @throws error host_memory_exhausted if the system refuses memory
  [[nodiscard]] block allocate(int order)
  {
    int from = order;
    while (from <= max_order_ && free_[static_cast<std::size_t>(from)].empty()) { ++from; }
    if (from > max_order_) {
      add_superblock();
      from = max_order_;
    }
    auto& list                 = free_[static_cast<std::size_t>(from)];
    const std::uint64_t offset = *list.begin();
    list.erase(list.begin());
    for (int o = from; o > order; --o) {  // keep the upper halves
      free_[static_cast<std::size_t>(o - 1)].insert(offset + block_bytes(o - 1));
    }
    in_use_ += block_bytes(order);
    return {offset, order};
  }

  /// @brief Returns a block (no mapping of it may remain but the arena's own); it merges with its
  /// free buddies.
  void release(block b) noexcept
  {
    in_use_ -= block_bytes(b.order);
    while (b.order < max_order_) {
      // buddies differ in one bit of the offset counted in units of base (base need not be a
      // power of two; superblocks start at multiples of their size, so a buddy never leaves one)
      auto& list                = free_[static_cast<std::size_t>(b.order)];
      const std::uint64_t buddy = ((b.offset / base_) ^ (std::uint64_t{1} << b.order)) * base_;
      const auto it             = list.find(buddy);
      if (it == list.end()) { break; }
      list.erase(it);
      b.offset = std::min(b.offset, buddy);
      ++b.order;
    }
    free_[static_cast<std::size_t>(b.order)].insert(b.offset);
  }

 private:
  [[nodiscard]] std::size_t superblock_bytes() const noexcept { return block_bytes(max_order_); }

  void add_superblock()
  {
    const std::size_t bytes = superblock_bytes();
    const auto offset       = static_cast<off_t>(superblocks_.size() * bytes);
    if (::ftruncate(fd_, offset + static_cast<off_t>(bytes)) != 0) { throw_system_error("ftruncate"); }
    void* at = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, offset);
    if (at == MAP_FAILED) { throw_system_error("mmap of a row superblock"); }
    try {
      RowMemory::register_host(at, bytes);  // kernels write it at this address from now on
    } catch (...) {
      ::munmap(at, bytes);
      throw;
    }
    superblocks_.push_back(static_cast<std::byte*>(at));
    free_[static_cast<std::size_t>(max_order_)].insert(static_cast<std::uint64_t>(offset));
  }

  std::size_t base_;
  int max_order_;
  int fd_ = -1;
  std::vector<std::byte*> superblocks_;         // arena address of each superblock
  std::vector<std::set<std::uint64_t>> free_;  // per order: offsets of free blocks
  std::size_t in_use_ = 0;
};

}  // namespace routing_replay::detail
