/// @file
/// A pool of host memory, faulted in ahead of need, for rows a consumer may keep: an engine's
/// outputs (vLLM's in-process output processor keeps every step's rows until the request
/// finishes), extraction copies. The engine's thread takes slices of it in a step and never
/// faults a page in, allocates memory or waits to do so; whoever holds a slice lets it go on any
/// thread, and its memory is reused. docs/kept_outputs.md says what the pool costs and when.
#pragma once

#include <routing_replay/detail/kept_pool/extent.hpp>
#include <routing_replay/errors.hpp>

#include <algorithm>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace routing_replay {

/// @brief Where a kept_rows_pool's extents come from: `allocate(bytes)` returns memory whose pages
/// are faulted in (it runs on the pool's filling thread), `deallocate` frees it, and
/// `enter_filling_thread()` runs first on that thread.
template <class M>
concept kept_memory = requires(const M& m, std::size_t bytes, void* p) {
  { m.allocate(bytes) } -> std::same_as<void*>;
  m.deallocate(p, bytes);
  m.enter_filling_thread();
};

/// @brief Sizes of a kept_rows_pool.
struct kept_pool_config {
  /// @brief Bytes of one extent, rounded up to pages: slices are carved from extents back to back,
  /// so an extent holds several; at least the largest slice (a larger one gets an extent of its
  /// own, made on the taking thread).
  std::size_t extent_bytes = std::size_t{4} << 20;
  /// @brief Bytes the pool faults in at construction and keeps when slices are let go; past it
  /// the pool grows (on its filling thread) and gives extents back as they empty.
  std::size_t budget_bytes = 0;
  /// @brief Free bytes the filling thread keeps ready beyond those in use, budget or not (0: two
  /// extents): what a burst of takes may use before the filling thread has caught up.
  std::size_t ahead_bytes = 0;
  /// @brief Whether extents emptied past the budget go back to the system. False keeps every
  /// extent made (pinned memory of a CUDA backend: cudaFreeHost synchronizes with the device, which
  /// the filling thread must not do while the engine may be capturing a CUDA graph).
  bool give_back = true;
};

/// @brief What a kept_rows_pool holds and has done.
struct kept_pool_stats {
  std::size_t size_bytes            = 0;  ///< bytes of extents held (faulted in)
  std::size_t size_high_water_bytes = 0;  ///< the most held at once
  std::size_t in_use_bytes          = 0;  ///< bytes of slices out (rounded up to the alignment)
  std::size_t high_water_bytes      = 0;  ///< the most out at once
  std::size_t budget_bytes          = 0;  ///< the budget
  std::size_t ahead_bytes           = 0;  ///< free bytes kept ready
  std::size_t extent_bytes          = 0;  ///< bytes of one extent
  std::uint64_t slices              = 0;  ///< slices taken so far
  std::uint64_t extents_made        = 0;  ///< extents the filling thread made
  std::uint64_t extents_over_budget = 0;  ///< of those, made while the pool held its budget or more
  std::uint64_t extents_in_step     = 0;  ///< extents a taking thread made itself: none was ready
  std::uint64_t extents_freed       = 0;  ///< extents given back to the system (over budget, empty)
  bool filling_failed               = false;  ///< the filling thread's allocation failed: takes make their own
};

/// @brief Slices of pre-faulted host memory for rows a consumer may keep.
///
/// Memory comes in extents of kept_pool_config::extent_bytes, made by a filling thread of the
/// pool's own (never by the thread that takes slices, unless nothing is ready: then that thread
/// makes one itself rather than wait, and kept_pool_stats::extents_in_step counts it). A slice is
/// carved from the current extent (a bump pointer under a mutex: no allocation, no page touched);
/// an extent whose slices have all been let go is reused whole, or, while the pool holds more than
/// its budget and the memory kept ahead, given back to the system by the filling thread.
///
/// Threads: take() from one thread at a time (the engine's); release() and the stats from any.
/// Every slice must be let go before the pool is destroyed.
/// @tparam Memory a kept_memory (host_kept_memory: ordinary memory; function_kept_memory: pinned
/// memory of a backend)
template <kept_memory Memory = host_kept_memory>
class kept_rows_pool {
 public:
  /// @brief Alignment of every slice (a cache line).
  static constexpr std::size_t alignment = 64;

  /// @brief One slice: `bytes` at `data`, from `owner`.
  struct slice {
    std::byte* data                    = nullptr;  ///< its first byte
    std::size_t bytes                  = 0;        ///< bytes asked for
    detail::kept_pool::extent* owner   = nullptr;  ///< the extent it was carved from
  };

  /// @brief A pool of `config`'s sizes over `memory`; its filling thread starts faulting the budget
  /// in at once (wait_until_filled() waits for it).
  explicit kept_rows_pool(const kept_pool_config& config, Memory memory = Memory{})
    : memory_(std::move(memory)),
      extent_bytes_(detail::kept_pool::round_up(std::max<std::size_t>(config.extent_bytes, 1),
                                                detail::kept_pool::page_bytes())),
      budget_(config.budget_bytes),
      ahead_(config.ahead_bytes > 0 ? config.ahead_bytes : 2 * extent_bytes_),
      give_back_(config.give_back)
  {
    filler_ = std::thread{[this] { fill(); }};
  }
  kept_rows_pool(const kept_rows_pool&)            = delete;
  kept_rows_pool& operator=(const kept_rows_pool&) = delete;
  /// @brief Stops the filling thread and frees every extent (no slice may be out).
  ~kept_rows_pool()
  {
    {
      const std::lock_guard lock{mutex_};
      stop_ = true;
    }
    wake_.notify_one();
    filler_.join();
    for (const auto& e : all_) { memory_.deallocate(e->base, e->bytes); }
  }

  /// @brief A slice of `bytes` (0: an empty slice). From memory faulted in ahead; where none is
  /// ready, the calling thread makes an extent itself rather than wait (extents_in_step).
  /// @throws what Memory::allocate throws, only in that case
  [[nodiscard]] slice take(std::size_t bytes)
  {
    if (bytes == 0) { return {}; }
    const std::size_t rounded = detail::kept_pool::round_up(bytes, alignment);
    std::unique_lock lock{mutex_};
    bool retired = false;
    if (current_ == nullptr || current_->used + rounded > current_->bytes) {
      if (current_ != nullptr) { retired = retire_current(); }
      detail::kept_pool::extent* next = rounded <= extent_bytes_ ? pop_ready() : nullptr;
      if (next == nullptr) { next = make_here(lock, std::max(rounded, extent_bytes_)); }
      current_          = next;
      current_->current = true;
    }
    slice s{current_->base + current_->used, bytes, current_};
    current_->used += rounded;
    ++current_->live;
    in_use_ += rounded;
    high_water_ = std::max(high_water_, in_use_);
    ++slices_;
    const bool low = retired || wants_more();
    lock.unlock();
    if (low) { wake_.notify_one(); }
    return s;
  }

  /// @brief Lets `s` go (any thread); its extent is reused once all its slices are. Never allocates.
  void release(const slice& s) noexcept
  {
    if (s.owner == nullptr) { return; }
    bool wake = false;
    {
      const std::lock_guard lock{mutex_};
      in_use_ -= detail::kept_pool::round_up(s.bytes, alignment);
      if (--s.owner->live == 0 && !s.owner->current) { wake = recycle(s.owner); }
    }
    if (wake) { wake_.notify_one(); }
  }

  /// @brief Sets the budget: the filling thread faults in up to it, and keeps it when slices are let go.
  void set_budget(std::size_t bytes)
  {
    {
      const std::lock_guard lock{mutex_};
      budget_ = bytes;
    }
    wake_.notify_one();
  }

  /// @brief Waits until the filling thread holds the budget and the memory kept ahead (or failed).
  void wait_until_filled()
  {
    std::unique_lock lock{mutex_};
    made_.wait(lock, [&] { return failed_ || !wants_more(); });
  }

  /// @brief What the pool holds and has done.
  [[nodiscard]] kept_pool_stats stats() const
  {
    const std::lock_guard lock{mutex_};
    kept_pool_stats s;
    s.size_bytes            = size_;
    s.size_high_water_bytes = size_high_water_;
    s.in_use_bytes          = in_use_;
    s.high_water_bytes      = high_water_;
    s.budget_bytes          = budget_;
    s.ahead_bytes           = ahead_;
    s.extent_bytes          = extent_bytes_;
    s.slices                = slices_;
    s.extents_made          = made_count_;
    s.extents_over_budget   = over_budget_count_;
    s.extents_in_step       = in_step_count_;
    s.extents_freed         = freed_count_;
    s.filling_failed        = failed_;
    return s;
  }

 private:
  using extent = detail::kept_pool::extent;

  // Bytes free for takes: extents ready, and what is left of the current one.
  [[nodiscard]] std::size_t free_bytes() const noexcept
  {
    return ready_.size() * extent_bytes_ + (current_ != nullptr ? current_->bytes - current_->used : 0);
  }
  // Whether the filling thread should make an extent (under the mutex).
  [[nodiscard]] bool wants_more() const noexcept
  {
    return !failed_ && (size_ + extent_bytes_ <= budget_ || free_bytes() < ahead_);
  }

  // The current extent is full: it is reused once its slices are let go (at once if none is out).
  // Returns whether the filling thread must be woken (it went to be freed).
  [[nodiscard]] bool retire_current() noexcept
  {
    extent* e  = std::exchange(current_, nullptr);
    e->current = false;
    return e->live == 0 && recycle(e);
  }

  // An extent with no slice out: ready again, or, past what the pool keeps, given to the filling
  // thread to free. Returns whether that thread must be woken. Never allocates (room was made).
  [[nodiscard]] bool recycle(extent* e) noexcept
  {
    e->used = 0;
    // kept while the pool holds no more than its budget without it, or less than `ahead_` free:
    // the filling thread's own test (wants_more()), so that it never makes what was just freed.
    // Without give_back every extent is kept, one made for a large slice too (it serves any take)
    if (!give_back_ || (e->bytes == extent_bytes_ && (size_ - e->bytes < budget_ || free_bytes() < ahead_))) {
      ready_.push_back(e);
      return false;
    }
    retired_.push_back(e);
    return true;
  }

  [[nodiscard]] extent* pop_ready() noexcept
  {
    if (ready_.empty()) { return nullptr; }
    extent* e = ready_.back();  // the one let go last: its lines may still be cached
    ready_.pop_back();
    return e;
  }

  // Adds an extent of `bytes` at `at` to the lists, with room for it in every list it may join
  // (so that recycle() never allocates). Under the mutex.
  extent* add(std::byte* at, std::size_t bytes)
  {
    auto e   = std::make_unique<extent>();
    e->base  = at;
    e->bytes = bytes;
    e->index = all_.size();
    ready_.reserve(all_.size() + 1);
    retired_.reserve(all_.size() + 1);
    all_.push_back(std::move(e));
    size_ += bytes;
    size_high_water_ = std::max(size_high_water_, size_);
    return all_.back().get();
  }

  // Nothing is ready: the taking thread makes an extent itself (the pool never makes it wait).
  extent* make_here(std::unique_lock<std::mutex>& lock, std::size_t bytes)
  {
    const std::size_t paged = detail::kept_pool::round_up(bytes, detail::kept_pool::page_bytes());
    lock.unlock();
    auto* at = static_cast<std::byte*>(memory_.allocate(paged));
    lock.lock();
    try {
      extent* e = add(at, paged);
      ++in_step_count_;
      return e;
    } catch (...) {
      memory_.deallocate(at, paged);
      throw;
    }
  }

  // Drops `e` from the list of extents (under the mutex); the caller frees its memory.
  void forget(extent* e) noexcept
  {
    const std::size_t i = e->index;
    size_ -= e->bytes;
    if (i + 1 != all_.size()) {
      all_[i] = std::move(all_.back());
      all_[i]->index = i;
    }
    all_.pop_back();  // destroys `e`
  }

  // The filling thread: frees retired extents, and makes extents while the pool is below its
  // budget or has less than `ahead_` free. A failed allocation ends the making (takes then make
  // their own, and report it); freeing goes on.
  void fill() noexcept
  {
    bool entered = true;
    try {
      memory_.enter_filling_thread();
    } catch (...) {
      entered = false;
    }
    std::unique_lock lock{mutex_};
    if (!entered) { failed_ = true; }
    made_.notify_all();
    while (true) {
      wake_.wait(lock, [&] { return stop_ || !retired_.empty() || wants_more(); });
      if (stop_) { break; }
      if (!retired_.empty()) {
        extent* e = retired_.back();
        retired_.pop_back();
        std::byte* at           = e->base;
        const std::size_t bytes = e->bytes;
        forget(e);
        ++freed_count_;
        lock.unlock();
        memory_.deallocate(at, bytes);
        lock.lock();
        continue;
      }
      const bool over = size_ >= budget_;
      lock.unlock();
      std::byte* at = nullptr;
      try {
        at = static_cast<std::byte*>(memory_.allocate(extent_bytes_));  // the page faults: here
      } catch (...) {
      }
      lock.lock();
      if (at == nullptr) {
        failed_ = true;
      } else {
        try {
          ready_.push_back(add(at, extent_bytes_));  // add() made room in ready_
          ++made_count_;
          if (over) { ++over_budget_count_; }
        } catch (...) {
          memory_.deallocate(at, extent_bytes_);
          failed_ = true;
        }
      }
      made_.notify_all();
    }
  }  // extents still retired are in all_: the destructor frees them

  Memory memory_;
  std::size_t extent_bytes_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;  // for the filling thread: work, or stop
  std::condition_variable made_;  // from it: an extent made, or it failed
  std::vector<std::unique_ptr<extent>> all_;  // every extent held
  std::vector<extent*> ready_;                // free, reused whole
  std::vector<extent*> retired_;              // free, past what the pool keeps: to be given back
  extent* current_ = nullptr;                 // slices are carved from it
  std::size_t budget_;
  std::size_t ahead_;
  bool give_back_;
  std::size_t size_            = 0;
  std::size_t size_high_water_ = 0;
  std::size_t in_use_          = 0;
  std::size_t high_water_      = 0;
  std::uint64_t slices_            = 0;
  std::uint64_t made_count_        = 0;
  std::uint64_t over_budget_count_ = 0;
  std::uint64_t in_step_count_     = 0;
  std::uint64_t freed_count_       = 0;
  bool failed_ = false;
  bool stop_   = false;
  std::thread filler_;  // last: starts once every other member exists
};

}  // namespace routing_replay
