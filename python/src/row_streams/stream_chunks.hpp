/// @file
/// Host memory the output copy of a step lands in: a slice of a kept_rows_pool of pinned memory
/// (plain host memory on the host backend) faulted in ahead of need by the pool's filling thread,
/// exactly the step's rows. A chunk is held by the step until it is processed, by filing tasks that
/// read it, and by the numpy views of its rows handed out (vLLM's in-process output processor keeps
/// them until the request finishes); its slice goes back to the pool when the last of them lets go,
/// on whichever thread that is. So a step takes no page fault and allocates no memory however long
/// the consumer keeps its outputs, while the pool holds enough (docs/kept_outputs.md).
#pragma once

#include <routing_replay/detail/row_streams/row_stream_filing.hpp>
#include <routing_replay/kept_rows_pool.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace routing_replay::python {

class chunk_pool;

/// @brief The pool of output memory: pinned memory of the device side, through two functions.
using output_pool = kept_rows_pool<function_kept_memory>;

/// @brief One chunk: a slice of the pool and its holders.
class row_chunk final : public step_rows_owner {
 public:
  /// @brief The bytes.
  [[nodiscard]] std::byte* data() const noexcept { return slice_.data; }
  /// @brief How many.
  [[nodiscard]] std::size_t bytes() const noexcept { return slice_.bytes; }
  /// @brief One more holder.
  void retain_rows() noexcept override { holders_.fetch_add(1, std::memory_order_relaxed); }
  /// @brief A holder lets go; the last one gives the slice back to the pool.
  void release_rows() noexcept override;

 private:
  friend class chunk_pool;
  output_pool::slice slice_;
  std::atomic<std::int32_t> holders_{0};
  std::shared_ptr<chunk_pool> pool_;  // while held: the pool outlives its chunks in use
};

/// @brief Chunks over an output_pool. The chunk records themselves are made in batches and reused,
/// so that a step allocates none (a consumer keeping its outputs keeps one a step).
class chunk_pool : public std::enable_shared_from_this<chunk_pool> {
 public:
  /// @brief Chunk records made at once when none is free.
  static constexpr std::size_t records_per_batch = 256;

  /// @brief A pool of `config`'s sizes over `memory` (whose functions must work after the device
  /// object is gone: the pool lives as long as a chunk is held).
  chunk_pool(function_kept_memory memory, const kept_pool_config& config) : pool_(config, std::move(memory)) {}
  chunk_pool(const chunk_pool&)            = delete;
  chunk_pool& operator=(const chunk_pool&) = delete;

  /// @brief A chunk of `bytes` (> 0), held once by the caller.
  /// @throws what the pool's memory throws, where nothing was ready (see kept_rows_pool::take)
  [[nodiscard]] row_chunk* take(std::size_t bytes)
  {
    row_chunk* c = nullptr;
    {
      const std::lock_guard lock{mutex_};
      if (free_.empty()) { make_records(); }
      c = free_.back();
      free_.pop_back();
    }
    try {
      c->slice_ = pool_.take(bytes);
    } catch (...) {
      const std::lock_guard lock{mutex_};
      free_.push_back(c);  // room: it was there
      throw;
    }
    c->holders_.store(1, std::memory_order_relaxed);
    c->pool_ = shared_from_this();
    return c;
  }

  /// @brief The memory pool (its stats, its budget).
  [[nodiscard]] output_pool& memory() noexcept { return pool_; }

  /// @brief Chunk records made so far.
  [[nodiscard]] std::size_t chunks() const
  {
    const std::lock_guard lock{mutex_};
    return records_.size() * records_per_batch;
  }

 private:
  friend class row_chunk;

  // A batch of records, with room in free_ for every record there is (give() never allocates).
  void make_records()
  {
    auto batch = std::make_unique<row_chunk[]>(records_per_batch);
    free_.reserve((records_.size() + 1) * records_per_batch);
    for (std::size_t i = 0; i < records_per_batch; ++i) { free_.push_back(&batch[i]); }
    records_.push_back(std::move(batch));
  }

  void give(row_chunk* c) noexcept
  {
    std::shared_ptr<chunk_pool> keep = std::move(c->pool_);  // the pool may go with the last chunk
    pool_.release(std::exchange(c->slice_, {}));
    const std::lock_guard lock{mutex_};
    free_.push_back(c);
  }

  output_pool pool_;
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<row_chunk[]>> records_;
  std::vector<row_chunk*> free_;
};

inline void row_chunk::release_rows() noexcept
{
  if (holders_.fetch_sub(1, std::memory_order_acq_rel) == 1) { pool_->give(this); }
}

}  // namespace routing_replay::python
