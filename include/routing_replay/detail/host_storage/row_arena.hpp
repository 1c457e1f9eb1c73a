/// @file
/// The backing memory of per-request rows: blocks of one anonymous shared-memory file, each
/// reachable at two addresses. Its arena address, fixed for the arena's lifetime, is where kernels
/// write rows (device scatter); the same block is also mapped into a request's own reserved range,
/// so that the host sees the request's rows contiguous however many blocks they span. Growth never
/// moves a row, and neither the host nor a kernel ever copies rows to grow. Linux (memfd).
#pragma once

#include <routing_replay/config.hpp>
#include <routing_replay/errors.hpp>

#include <sys/mman.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
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
///
/// release() never allocates (a request's rows are freed by release and abort, which must not fail
/// half-way): the arena keeps a spare free-list node for every block handed out, made when the block
/// is allocated.
///
/// With `ahead` bytes asked for, a worker thread keeps that many (rounded up to superblocks, plus one,
/// since a step's blocks rarely fill superblocks exactly) mapped, faulted in and registered before
/// they are needed, and a step that runs out of free blocks takes one of them
/// instead of mapping fresh pages on the engine's thread (first touch of shared memory, and
/// registration, cost about as much as filing the rows). The worker touches nothing but those
/// superblocks; the free lists and the superblock table stay the engine thread's alone.
template <class RowMemory>
class row_arena {
 public:
  /// @brief A block: its offset in the file and its order.
  struct block {
    std::uint64_t offset = 0;  ///< bytes from the start of the file
    int order            = 0;  ///< the block holds base << order bytes
  };

  /// @brief An arena of blocks of `base` (a multiple of the page size) to `base << max_order` bytes,
  /// with `ahead` bytes of superblocks kept ready by a worker thread (0: none, no thread).
  row_arena(std::size_t base, int max_order, std::size_t ahead = 0)
    : base_(base),
      max_order_(max_order),
      free_(static_cast<std::size_t>(max_order) + 1),
      provision_(std::make_unique<provisioning>())
  {
    fd_ = ::memfd_create("routing_replay_rows", MFD_CLOEXEC);
    if (fd_ < 0) { throw_system_error("memfd_create"); }
    if (ahead > 0) {
      provision_->wanted = (ahead + superblock_bytes() - 1) / superblock_bytes() + 1;
      provision_->ready.reserve(provision_->wanted);
      worker_ = std::thread{[p = provision_.get(), fd = fd_, bytes = superblock_bytes(),
                             context = RowMemory::thread_context()] { provide(*p, fd, bytes, context); }};
    }
  }
  row_arena(row_arena&& other) noexcept
    : base_(other.base_),
      max_order_(other.max_order_),
      fd_(std::exchange(other.fd_, -1)),
      superblocks_(std::move(other.superblocks_)),
      free_(std::move(other.free_)),
      spare_(std::move(other.spare_)),
      nodes_(std::exchange(other.nodes_, 0)),
      blocks_out_(std::exchange(other.blocks_out_, 0)),
      in_use_(std::exchange(other.in_use_, 0)),
      provision_(std::move(other.provision_)),
      worker_(std::move(other.worker_)),
      taken_ready_(std::exchange(other.taken_ready_, 0)),
      made_here_(std::exchange(other.made_here_, 0))
  {
  }
  row_arena& operator=(row_arena&& other) noexcept
  {
    std::swap(base_, other.base_);
    std::swap(max_order_, other.max_order_);
    std::swap(fd_, other.fd_);
    std::swap(superblocks_, other.superblocks_);
    std::swap(free_, other.free_);
    std::swap(spare_, other.spare_);
    std::swap(nodes_, other.nodes_);
    std::swap(blocks_out_, other.blocks_out_);
    std::swap(in_use_, other.in_use_);
    std::swap(provision_, other.provision_);
    std::swap(worker_, other.worker_);
    std::swap(taken_ready_, other.taken_ready_);
    std::swap(made_here_, other.made_here_);
    return *this;
  }
  row_arena(const row_arena&)            = delete;
  row_arena& operator=(const row_arena&) = delete;
  ~row_arena()
  {
    if (worker_.joinable()) {  // before anything it maps into goes
      {
        const std::lock_guard lock{provision_->mutex};
        provision_->stop = true;
      }
      provision_->wake.notify_one();
      worker_.join();
    }
    for (std::byte* s : superblocks_) {
      if (s == nullptr) { continue; }  // a slot whose superblock was made ahead and never taken
      RowMemory::unregister_host(s);
      ::munmap(s, superblock_bytes());
    }
    if (provision_ != nullptr) {
      for (const auto& r : provision_->ready) {
        RowMemory::unregister_host(r.at);
        ::munmap(r.at, superblock_bytes());
      }
    }
    if (fd_ >= 0) { ::close(fd_); }
  }

  /// @brief Bytes of a block of `order`.
  [[nodiscard]] std::size_t block_bytes(int order) const noexcept { return base_ << order; }
  /// @brief The largest order.
  [[nodiscard]] int max_order() const noexcept { return max_order_; }
  /// @brief Bytes of blocks handed out and not released.
  [[nodiscard]] std::size_t bytes_in_use() const noexcept { return in_use_; }
  /// @brief Superblocks taken ready from the worker and mapped by the allocating thread itself.
  [[nodiscard]] host_memory_growth growth() const noexcept
  {
    return {taken_ready_, made_here_, superblock_bytes()};
  }
  /// @brief Blocks until the worker holds every superblock it keeps ahead, or has ended (a refused
  /// mapping: the engine's thread then maps its own); returns at once without a worker.
  void wait_until_ahead() const
  {
    if (!worker_.joinable()) { return; }
    auto& p = *provision_;
    std::unique_lock lock{p.mutex};
    p.made.wait(lock, [&] { return p.stop || p.ready.size() >= p.wanted; });
  }
  /// @brief The file, for mapping blocks elsewhere.
  [[nodiscard]] int fd() const noexcept { return fd_; }

  /// @brief The arena address of a byte of the file (fixed while the arena lives).
  [[nodiscard]] std::byte* address(std::uint64_t offset) const noexcept
  {
    const auto bytes = static_cast<std::uint64_t>(superblock_bytes());
    return superblocks_[static_cast<std::size_t>(offset / bytes)] + offset % bytes;
  }

  /// @brief A free block of `order`, splitting a larger one or adding a superblock. Strong: a
  /// failure changes nothing observable.
  /// @throws error host_memory_exhausted if the system refuses memory; std::bad_alloc
  [[nodiscard]] block allocate(int order)
  {
    // every node this call inserts (a superblock, the halves a split keeps), and the one the
    // block's release will insert, before anything changes
    reserve_nodes(blocks_out_ + 2 + static_cast<std::size_t>(max_order_));
    int from = order;
    while (from <= max_order_ && free_[static_cast<std::size_t>(from)].empty()) { ++from; }
    if (from > max_order_) {
      add_superblock();
      from = max_order_;
    }
    auto& list                 = free_[static_cast<std::size_t>(from)];
    const std::uint64_t offset = *list.begin();
    spare_.push_back(list.extract(list.begin()));
    for (int o = from; o > order; --o) { insert_free(o - 1, offset + block_bytes(o - 1)); }  // the upper halves
    in_use_ += block_bytes(order);
    ++blocks_out_;
    return {offset, order};
  }

  /// @brief Returns a block (no mapping of it may remain but the arena's own); it merges with its
  /// free buddies. Never allocates.
  void release(block b) noexcept
  {
    in_use_ -= block_bytes(b.order);
    --blocks_out_;
    while (b.order < max_order_) {
      // buddies differ in one bit of the offset counted in units of base (base need not be a
      // power of two; superblocks start at multiples of their size, so a buddy never leaves one)
      auto& list                = free_[static_cast<std::size_t>(b.order)];
      const std::uint64_t buddy = ((b.offset / base_) ^ (std::uint64_t{1} << b.order)) * base_;
      const auto it             = list.find(buddy);
      if (it == list.end()) { break; }
      spare_.push_back(list.extract(it));
      b.offset = std::min(b.offset, buddy);
      ++b.order;
    }
    insert_free(b.order, b.offset);
  }

 private:
  using node_type = std::set<std::uint64_t>::node_type;

  [[nodiscard]] std::size_t superblock_bytes() const noexcept { return block_bytes(max_order_); }

  // At least `n` spare nodes; spare_ can hold every node there is, so pushing one back never
  // allocates. Its capacity grows geometrically: `n` grows by one with every block handed out, and
  // an exact reserve moved every node handle at every allocation (a decode step of requests that
  // started at different times allocates in almost every step).
  void reserve_nodes(std::size_t n)
  {
    if (spare_.size() >= n) { return; }
    const std::size_t nodes_after = nodes_ + (n - spare_.size());
    if (spare_.capacity() < nodes_after) { spare_.reserve(std::max(nodes_after, 2 * spare_.capacity())); }
    while (spare_.size() < n) {
      std::set<std::uint64_t> one{0};
      spare_.push_back(one.extract(one.begin()));
      ++nodes_;
    }
  }

  // Puts a free block in its order's list, in a spare node.
  void insert_free(int order, std::uint64_t offset) noexcept
  {
    node_type node = std::move(spare_.back());
    spare_.pop_back();
    node.value() = offset;
    free_[static_cast<std::size_t>(order)].insert(std::move(node));
  }

  // A superblock ready at `offset` (its slot in the file), mapped at `at`.
  struct ready_superblock {
    std::uint64_t offset = 0;
    std::byte* at        = nullptr;
  };

  // What the engine's thread and the worker share, under `mutex`; heap-held so that it stays put
  // when the arena moves.
  struct provisioning {
    std::mutex mutex;
    std::condition_variable wake;         // the engine's thread took a superblock, or the arena goes
    std::condition_variable made;         // the worker made one, or ended
    std::vector<ready_superblock> ready;  // made ahead, not yet in the free lists
    std::uint64_t file_bytes = 0;         // the file's size: superblock offsets below it are taken
    std::size_t wanted       = 0;         // superblocks to keep ready
    bool stop                = false;
  };

  // The worker: keeps `wanted` superblocks ready until stopped. A failure (no memory, a refused
  // registration) ends it quietly: the engine's thread then maps superblocks itself, and reports.
  static void provide(provisioning& p, int fd, std::size_t bytes, typename RowMemory::thread_state context) noexcept
  {
    try {
      RowMemory::adopt_thread_context(context);
    } catch (...) {  // nothing is made ahead: the engine's thread makes every superblock itself
      const std::lock_guard lock{p.mutex};
      p.wanted = 0;
      p.made.notify_all();
      return;
    }
    std::unique_lock lock{p.mutex};
    while (true) {
      p.wake.wait(lock, [&] { return p.stop || p.ready.size() < p.wanted; });
      if (p.stop) { return; }
      const std::uint64_t offset = p.file_bytes;
      if (::ftruncate(fd, static_cast<off_t>(offset + bytes)) != 0) {  // under the lock: sizes only grow
        p.wanted = 0;
        p.made.notify_all();
        return;
      }
      p.file_bytes = offset + bytes;
      lock.unlock();
      // Faulted in here, off the engine's thread, and pinned for kernels where they write it. Page
      // by page, not with MAP_POPULATE: populating holds the process's mmap lock for the whole
      // superblock (391 us/MB of fresh shared pages on an H200 host), and the engine's thread, whose
      // next mmap of a request's range waits for that lock, would wait for the worker; a page fault
      // holds it for one page, or not at all where the kernel locks the VMA alone.
      void* at = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, static_cast<off_t>(offset));
      bool ok  = at != MAP_FAILED;
      if (ok) {
        const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
        for (std::size_t b = 0; b < bytes; b += page) {  // shared memory reads as zero: writing one keeps it so
          static_cast<volatile std::byte*>(at)[b] = std::byte{0};
        }
        try {
          RowMemory::register_host(at, bytes);
        } catch (...) {
          ::munmap(at, bytes);
          ok = false;
        }
      }
      lock.lock();
      if (!ok) {
        p.wanted = 0;
        p.made.notify_all();
        return;
      }
      p.ready.push_back({offset, static_cast<std::byte*>(at)});  // reserved up to `wanted`
      p.made.notify_all();
    }
  }

  void add_superblock()
  {
    const std::size_t bytes = superblock_bytes();
    superblocks_.reserve(superblocks_.size() + 1);  // the common case: the next slot
    ready_superblock made;
    {
      const std::lock_guard lock{provision_->mutex};
      auto& p = *provision_;
      if (!p.ready.empty()) {
        made = p.ready.front();
        p.ready.erase(p.ready.begin());
      } else {
        made.offset = p.file_bytes;
        if (::ftruncate(fd_, static_cast<off_t>(made.offset + bytes)) != 0) { throw_system_error("ftruncate"); }
        p.file_bytes = made.offset + bytes;  // the slot stays taken even if mapping it fails below
      }
    }
    if (made.at != nullptr) {
      provision_->wake.notify_one();  // make the next one
      ++taken_ready_;
    } else {
      ++made_here_;  // on this (the engine's) thread: its page faults and registration are the step's
      void* at = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, static_cast<off_t>(made.offset));
      if (at == MAP_FAILED) { throw_system_error("mmap of a row superblock"); }
      try {
        RowMemory::register_host(at, bytes);  // kernels write it at this address from now on
      } catch (...) {
        ::munmap(at, bytes);
        throw;
      }
      made.at = static_cast<std::byte*>(at);
    }
    // the table is indexed by slot (offset / bytes): slots the worker took may come in any order
    const auto slot = static_cast<std::size_t>(made.offset / bytes);
    try {
      if (superblocks_.size() <= slot) { superblocks_.resize(slot + 1, nullptr); }
    } catch (...) {
      RowMemory::unregister_host(made.at);
      ::munmap(made.at, bytes);
      throw;
    }
    superblocks_[slot] = made.at;
    insert_free(max_order_, made.offset);
  }

  std::size_t base_;
  int max_order_;
  int fd_ = -1;
  std::vector<std::byte*> superblocks_;         // arena address of each superblock
  std::vector<std::set<std::uint64_t>> free_;  // per order: offsets of free blocks
  std::vector<node_type> spare_;               // free-list nodes not in use (see reserve_nodes)
  std::size_t nodes_      = 0;                 // nodes made: in free_ or in spare_
  std::size_t blocks_out_ = 0;                 // blocks handed out and not released
  std::size_t in_use_ = 0;
  std::unique_ptr<provisioning> provision_;     // shared with the worker
  std::thread worker_;                          // keeps superblocks ready; none without `ahead`
  std::uint64_t taken_ready_ = 0;               // superblocks the worker made that were taken
  std::uint64_t made_here_   = 0;               // superblocks the allocating thread made itself
};

}  // namespace routing_replay::detail
