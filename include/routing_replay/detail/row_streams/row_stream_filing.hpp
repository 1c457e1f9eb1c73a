/// @file
/// What the row streams' filing thread does and owns: the tasks the engine's thread hands it (rows
/// into the tail pool, block keys into requests' key lists, one update of the block tier, which
/// copies the blocks), each request's keys in block order, and the block tier itself. The engine's
/// thread reads what it owns only while it is idle (after filing_worker::drain()).
#pragma once

#include <routing_replay/block_tier.hpp>
#include <routing_replay/errors.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace routing_replay {

/// @brief Host memory holding a step's rows (the output copy of a step) that the row streams read
/// after the call that handed it over: filing copies rows from it on its own thread. The row
/// streams call retain_rows() for each task that reads it and release_rows() when that task ran.
class step_rows_owner {
 public:
  /// @brief One more reader.
  virtual void retain_rows() noexcept = 0;
  /// @brief A reader is done (may be called on the filing thread).
  virtual void release_rows() noexcept = 0;

 protected:
  ~step_rows_owner() = default;
};

namespace detail {

/// @brief Keys a request gains: `count` hashes of `item_size` bytes at task.hashes[offset], each
/// the key (generation, hash).
struct key_append {
  std::int32_t request;      ///< request handle
  std::uint64_t generation;  ///< the key namespace
  std::size_t offset;        ///< into filing_task::hashes
  std::uint32_t count;       ///< hashes
  std::uint32_t item_size;   ///< bytes each
};

/// @brief A full block to store under key `block` of its request.
struct block_to_store {
  std::int32_t request;     ///< request handle
  std::int64_t block;       ///< index into the request's keys
  const std::byte* rows;    ///< its bytes
};

/// @brief Rows of a step copied into a tail-pool slot (a request's incomplete block, or a full block
/// waiting for its key): the filing thread moves them, so the engine's thread writes no rows.
struct row_copy {
  std::byte* to;          ///< in the pool
  const std::byte* from;  ///< in the step's rows
  std::size_t bytes;      ///< how many
};

/// @brief Keys retained or released: one hash of the task in a generation (request < 0), or keys
/// [first, first + count) of a request, in order or reversed.
struct key_range {
  std::int32_t request = -1;     ///< request handle; -1: a hash of the task
  std::uint64_t generation = 0;  ///< hash of the task: its namespace
  std::size_t offset       = 0;  ///< hash of the task: into filing_task::hashes
  std::uint32_t size       = 0;  ///< hash of the task: its bytes
  std::int64_t first       = 0;  ///< request range: first key
  std::int64_t count       = 0;  ///< request range: keys
  bool reversed            = false;  ///< request range: last key first
};

/// @brief One hand-over to the filing thread, run in this order: row copies into the pool, key
/// appends, the tier update (if `update`), then the requests whose keys are dropped.
struct filing_task {
  std::vector<row_copy> copies;          ///< rows into pool slots (also when the update is dropped)
  std::vector<key_append> appends;       ///< keys requests gain
  std::vector<std::byte> hashes;         ///< the hashes appends and key ranges name
  bool update = false;                   ///< whether the task updates the tier
  std::vector<block_to_store> objects;   ///< the update's blocks
  std::vector<key_range> retains;        ///< the update's retains
  std::vector<key_range> releases;       ///< the update's releases
  std::vector<std::int32_t> dropped;     ///< requests whose keys go after the update
  step_rows_owner* rows = nullptr;       ///< released once the task ran

  /// @brief Empties the task, keeping capacity.
  void clear() noexcept
  {
    copies.clear();
    appends.clear();
    hashes.clear();
    update = false;
    objects.clear();
    retains.clear();
    releases.clear();
    dropped.clear();
    rows = nullptr;
  }
  /// @brief Whether the task has anything to do.
  [[nodiscard]] bool empty() const noexcept
  {
    return copies.empty() && appends.empty() && !update && dropped.empty() && rows == nullptr;
  }
};

/// @brief One request's keys in block order: (generation, hash) as bytes, with their hashes.
class request_keys {
 public:
  /// @brief Keys.
  [[nodiscard]] std::int64_t size() const noexcept { return static_cast<std::int64_t>(hashes_.size()); }
  /// @brief Key `i`.
  [[nodiscard]] block_key key(std::int64_t i) const noexcept
  {
    const auto at = static_cast<std::size_t>(i);
    return {std::span<const std::byte>{bytes_.data() + ends_[at] - sizes_[at], sizes_[at]}, hashes_[at]};
  }
  /// @brief Appends the key (generation, hash).
  void append(std::uint64_t generation, const std::byte* hash, std::uint32_t size)
  {
    const std::size_t start = bytes_.size();
    bytes_.resize(start + sizeof generation + size);
    std::memcpy(bytes_.data() + start, &generation, sizeof generation);
    if (size > 0) { std::memcpy(bytes_.data() + start + sizeof generation, hash, size); }
    const std::uint32_t key_size = static_cast<std::uint32_t>(sizeof generation + size);
    hashes_.push_back(detail::xxhash64(std::span<const std::byte>{bytes_.data() + start, key_size}));
    sizes_.push_back(key_size);
    ends_.push_back(bytes_.size());
  }
  /// @brief Forgets every key, keeping capacity.
  void clear() noexcept
  {
    bytes_.clear();
    hashes_.clear();
    sizes_.clear();
    ends_.clear();
  }

 private:
  std::vector<std::byte> bytes_;
  std::vector<std::uint64_t> hashes_;
  std::vector<std::uint32_t> sizes_;
  std::vector<std::size_t> ends_;
};

/// @brief The key (generation, hash) as bytes into `out` (which it appends to).
inline void append_key_bytes(std::vector<std::byte>& out, std::uint64_t generation, const std::byte* hash,
                             std::uint32_t size)
{
  const std::size_t start = out.size();
  out.resize(start + sizeof generation + size);
  std::memcpy(out.data() + start, &generation, sizeof generation);
  if (size > 0) { std::memcpy(out.data() + start + sizeof generation, hash, size); }
}

/// @brief What the filing thread owns: the tier, every request's keys, and the first failure.
class filing_state {
 public:
  /// @brief A tier of `block_bytes` blocks under `max_bytes`.
  filing_state(std::size_t block_bytes, std::size_t max_bytes, block_tier_options options)
    : tier_(block_bytes, max_bytes, options)
  {
  }

  /// @brief Runs a task (on the filing thread). A failed tier update is recorded, and every later
  /// update is skipped (keys still follow their requests).
  void run(filing_task& task) noexcept
  {
    for (const row_copy& c : task.copies) { std::memcpy(c.to, c.from, c.bytes); }
    try {
      for (const key_append& a : task.appends) {
        request_keys& keys = keys_of(a.request);
        for (std::uint32_t i = 0; i < a.count; ++i) {
          keys.append(a.generation, task.hashes.data() + a.offset + std::size_t{i} * a.item_size, a.item_size);
        }
      }
      if (task.update && !failed_.load(std::memory_order_relaxed)) { update(task); }
      for (const std::int32_t request : task.dropped) { keys_of(request).clear(); }
    } catch (const std::exception& e) {
      fail(e.what());
    } catch (...) {
      fail("unknown error");
    }
    if (task.rows != nullptr) { task.rows->release_rows(); }
  }

  /// @brief Whether a tier update failed.
  [[nodiscard]] bool failed() const noexcept { return failed_.load(std::memory_order_acquire); }
  /// @brief Why (read after failed() said so).
  [[nodiscard]] const std::string& failure() const noexcept { return failure_; }

  /// @brief The tier (the engine's thread: only while the filing thread is idle).
  [[nodiscard]] block_tier& tier() noexcept { return tier_; }
  /// @brief A request's keys (the engine's thread: only while the filing thread is idle).
  [[nodiscard]] request_keys& keys_of(std::int32_t request)
  {
    if (static_cast<std::size_t>(request) >= keys_.size()) { keys_.resize(static_cast<std::size_t>(request) + 1); }
    return keys_[static_cast<std::size_t>(request)];
  }

 private:
  void fail(const char* what)
  {
    if (failed_.load(std::memory_order_relaxed)) { return; }
    failure_ = what;
    failed_.store(true, std::memory_order_release);
  }

  void update(const filing_task& task)
  {
    objects_.clear();
    retains_.clear();
    releases_.clear();
    explicit_bytes_.clear();
    std::size_t explicit_total = 0;
    for (const auto* list : {&task.retains, &task.releases}) {
      for (const key_range& r : *list) {
        if (r.request < 0) { explicit_total += sizeof r.generation + r.size; }
      }
    }
    explicit_bytes_.reserve(explicit_total);  // spans into it stay valid while it fills
    for (const block_to_store& b : task.objects) { objects_.push_back({keys_of(b.request).key(b.block), b.rows}); }
    collect(task, task.retains, retains_);
    collect(task, task.releases, releases_);
    tier_.put(objects_, retains_, releases_);
  }

  void collect(const filing_task& task, const std::vector<key_range>& ranges, std::vector<block_key>& out)
  {
    for (const key_range& r : ranges) {
      if (r.request < 0) {
        const std::size_t start = explicit_bytes_.size();
        append_key_bytes(explicit_bytes_, r.generation, task.hashes.data() + r.offset, r.size);
        out.push_back(block_key_of({explicit_bytes_.data() + start, explicit_bytes_.size() - start}));
        continue;
      }
      const request_keys& keys = keys_of(r.request);
      for (std::int64_t i = 0; i < r.count; ++i) {
        out.push_back(keys.key(r.reversed ? r.first + r.count - 1 - i : r.first + i));
      }
    }
  }

  block_tier tier_;
  std::vector<request_keys> keys_;  // by request handle
  std::atomic<bool> failed_{false};
  std::string failure_;
  std::vector<block_object> objects_;  // scratch of update()
  std::vector<block_key> retains_;
  std::vector<block_key> releases_;
  std::vector<std::byte> explicit_bytes_;
};

}  // namespace detail
}  // namespace routing_replay
