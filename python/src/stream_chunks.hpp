/// @file
/// Host memory the output copy of a step lands in: chunks of pinned memory (plain host memory on
/// the host backend), in power-of-two size classes, reused. A chunk is held by the step until it is
/// processed, by filing tasks that read it, and by the numpy views of its rows handed out; it
/// returns to its class when the last of them lets go, on whichever thread that is. So a steady
/// state allocates no chunk, and a consumer that keeps an output keeps its chunk.
#pragma once

#include <routing_replay/detail/row_stream_filing.hpp>

#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace routing_replay::python {

class chunk_pool;

/// @brief One chunk: its bytes and its holders.
class row_chunk final : public step_rows_owner {
 public:
  /// @brief `bytes` at `data`, of size class `size_class`, held by nobody yet.
  row_chunk(std::byte* data, std::size_t bytes, std::int32_t size_class) noexcept
    : data_(data), bytes_(bytes), size_class_(size_class)
  {
  }
  /// @brief The bytes.
  [[nodiscard]] std::byte* data() const noexcept { return data_; }
  /// @brief How many.
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  /// @brief Its size class (log2 of its bytes).
  [[nodiscard]] std::int32_t size_class() const noexcept { return size_class_; }
  /// @brief One more holder.
  void retain_rows() noexcept override { holders_.fetch_add(1, std::memory_order_relaxed); }
  /// @brief A holder lets go; the last one gives the chunk back to its pool.
  void release_rows() noexcept override;

 private:
  friend class chunk_pool;
  std::byte* data_;
  std::size_t bytes_;
  std::int32_t size_class_;
  std::atomic<std::int32_t> holders_{0};
  std::shared_ptr<chunk_pool> pool_;  // while held: the pool outlives its chunks in use
};

/// @brief Chunks by size class, allocated and freed through the backend's pinned memory calls.
class chunk_pool : public std::enable_shared_from_this<chunk_pool> {
 public:
  /// @brief The smallest class: 64 KiB.
  static constexpr std::int32_t min_class = 16;

  /// @brief A pool over `allocate` and `deallocate` (which must work after the device object is gone).
  chunk_pool(void* (*allocate)(std::size_t), void (*deallocate)(void*, std::size_t)) noexcept
    : allocate_(allocate), deallocate_(deallocate)
  {
  }
  chunk_pool(const chunk_pool&)            = delete;
  chunk_pool& operator=(const chunk_pool&) = delete;
  ~chunk_pool()
  {
    for (const auto& c : all_) { deallocate_(c->data_, c->bytes_); }
  }

  /// @brief A chunk of at least `bytes`, held once by the caller.
  [[nodiscard]] row_chunk* take(std::size_t bytes)
  {
    const auto size_class = std::max<std::int32_t>(min_class, static_cast<std::int32_t>(std::bit_width(bytes > 0 ? bytes - 1 : 0)));
    row_chunk* c          = nullptr;
    {
      std::lock_guard lock{mutex_};
      if (static_cast<std::size_t>(size_class) < free_.size() && !free_[static_cast<std::size_t>(size_class)].empty()) {
        c = free_[static_cast<std::size_t>(size_class)].back();
        free_[static_cast<std::size_t>(size_class)].pop_back();
      }
    }
    if (c == nullptr) { c = grow(size_class); }
    c->holders_.store(1, std::memory_order_relaxed);
    c->pool_ = shared_from_this();
    return c;
  }

  /// @brief Makes `count` chunks of `bytes` ready ahead of need.
  void reserve(std::size_t bytes, std::int32_t count)
  {
    std::vector<row_chunk*> taken;
    for (std::int32_t i = 0; i < count; ++i) { taken.push_back(take(bytes)); }
    for (row_chunk* c : taken) { c->release_rows(); }
  }

  /// @brief Chunks made so far.
  [[nodiscard]] std::size_t chunks() const
  {
    std::lock_guard lock{mutex_};
    return all_.size();
  }

 private:
  friend class row_chunk;

  row_chunk* grow(std::int32_t size_class)
  {
    const std::size_t bytes = std::size_t{1} << size_class;
    auto* data              = static_cast<std::byte*>(allocate_(bytes));
    std::lock_guard lock{mutex_};
    all_.push_back(std::make_unique<row_chunk>(data, bytes, size_class));
    return all_.back().get();
  }

  void give(row_chunk* c) noexcept
  {
    std::shared_ptr<chunk_pool> keep = std::move(c->pool_);  // the pool may go with the last chunk
    try {
      std::lock_guard lock{mutex_};
      if (free_.size() <= static_cast<std::size_t>(c->size_class_)) { free_.resize(static_cast<std::size_t>(c->size_class_) + 1); }
      free_[static_cast<std::size_t>(c->size_class_)].push_back(c);
    } catch (...) {  // no room to list it: it stays allocated, unused, until the pool goes
    }
  }

  void* (*allocate_)(std::size_t);
  void (*deallocate_)(void*, std::size_t);
  mutable std::mutex mutex_;
  std::vector<std::vector<row_chunk*>> free_;  // by size class
  std::vector<std::unique_ptr<row_chunk>> all_;
};

inline void row_chunk::release_rows() noexcept
{
  if (holders_.fetch_sub(1, std::memory_order_acq_rel) == 1) { pool_->give(this); }
}

}  // namespace routing_replay::python
