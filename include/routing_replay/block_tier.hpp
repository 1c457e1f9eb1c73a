/// @file
/// The block tier: full blocks of routing rows kept by content, keyed by bytes the engine chooses
/// (vLLM: a generation namespace and the KV block's 32-byte hash), so that routing outlives the
/// request that computed it and serves every request whose prefix hits the same KV block.
///
/// Semantics are those of vLLM 0.33's auxiliary-output block store, eviction order included: a key
/// is stored once (a later put of an unreferenced stored key replaces its bytes; of a referenced one
/// keeps them), retained and released by reference count, and only blocks nobody references are
/// evicted, least recently used first (stored or read), when the stored blocks exceed the byte
/// budget. Where every block is referenced the arena grows instead (at least doubling, as the
/// store it mirrors does) and the budget grows with it.
#pragma once

#include <routing_replay/detail/block_tier/block_arena.hpp>
#include <routing_replay/detail/block_tier/block_tier_index.hpp>
#include <routing_replay/detail/xxhash64.hpp>
#include <routing_replay/errors.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace routing_replay {

/// @brief A key of the block tier: bytes of any length and their hash (block_key_of()).
struct block_key {
  std::span<const std::byte> bytes;  ///< the key
  std::uint64_t hash = 0;            ///< its hash, computed once by block_key_of()
};

/// @brief The key made of `bytes`, with its hash (XXH64).
[[nodiscard]] inline block_key block_key_of(std::span<const std::byte> bytes) noexcept
{
  return block_key{bytes, detail::xxhash64(bytes)};
}

/// @brief A block to store: its key and where its block_bytes() bytes are (read during put()).
struct block_object {
  block_key key;                     ///< what the block is stored under
  const std::byte* bytes = nullptr;  ///< its rows
};

/// @brief Options of a block_tier.
struct block_tier_options {
  /// @brief Blocks past the next fresh slot whose pages put() faults in ahead of need, so that
  /// storing a block touches memory that is already there.
  std::size_t fault_ahead_blocks = 256;
  /// @brief Keys the index has room for before it grows (0: twice the blocks the budget holds).
  std::size_t expected_keys = 0;
};

/// @brief Content-addressed, reference-counted blocks under a byte budget, least recently used
/// first out. Not thread-safe: one thread at a time (the row streams' filing thread stores, the
/// engine's thread reads while that thread is idle).
///
/// Memory: the arena (an anonymous mapping of the budget, pages faulted in ahead of the slots
/// handed out next), one index entry per key known (about 100 bytes, keys up to 48 bytes inline)
/// and an open-addressing table of 8 bytes a cell, at most half full. Nothing is allocated in a put
/// or a read once the index holds as many keys as are alive at once, unless every stored block is
/// referenced and the arena grows.
class block_tier {
 public:
  /// @brief A tier of blocks of `block_bytes` bytes under a budget of `max_bytes` (which must hold
  /// one block).
  /// @throws error invalid_config for a zero block size or a budget below one block
  block_tier(std::size_t block_bytes, std::size_t max_bytes, block_tier_options options = {})
    : block_bytes_(checked_block_bytes(block_bytes, max_bytes)),
      limit_blocks_(max_bytes / block_bytes),
      options_(options),
      arena_(block_bytes, limit_blocks_),
      index_(options.expected_keys != 0 ? options.expected_keys : 2 * std::min<std::size_t>(limit_blocks_, 1u << 20))
  {
    arena_.fault_in(static_cast<std::int64_t>(std::min(limit_blocks_, options_.fault_ahead_blocks)));
  }

  /// @brief Bytes of one block.
  [[nodiscard]] std::size_t block_bytes() const noexcept { return block_bytes_; }
  /// @brief Blocks the budget holds (it grows only where everything stored is referenced).
  [[nodiscard]] std::size_t limit_blocks() const noexcept { return limit_blocks_; }
  /// @brief Blocks stored.
  [[nodiscard]] std::size_t stored_blocks() const noexcept { return stored_; }
  /// @brief Bytes of the arena (the budget, or more after growth).
  [[nodiscard]] std::size_t arena_bytes() const noexcept { return arena_.bytes(); }
  /// @brief Keys known: stored, referenced, or both.
  [[nodiscard]] std::size_t known_keys() const noexcept { return index_.size(); }
  /// @brief Stored blocks nobody references (the eviction candidates).
  [[nodiscard]] std::size_t evictable_blocks() const noexcept { return index_.lru_size(); }
  /// @brief Whether a block is stored under `key`.
  [[nodiscard]] bool contains(const block_key& key) const noexcept
  {
    const detail::entry_index e = index_.find(key.bytes, key.hash);
    return e != detail::no_entry && index_[e].stored;
  }
  /// @brief References held on `key` (0 if unknown).
  [[nodiscard]] std::int32_t references(const block_key& key) const noexcept
  {
    const detail::entry_index e = index_.find(key.bytes, key.hash);
    return e == detail::no_entry ? 0 : index_[e].refs;
  }

  /// @brief One update, in this order: blocks of `objects` (a key named twice stores its last
  /// bytes) drop their unreferenced stored copies; `retain` adds a reference per key; `release`
  /// removes one (keys reaching zero references become evictable, newest); the objects are stored
  /// (newest unless referenced); then, while more blocks are stored than the budget holds, the
  /// oldest evictable ones go, never an object of this update unless this update released it;
  /// where nothing evictable is left, the arena grows. A key already stored and referenced keeps
  /// its bytes.
  /// @throws error invalid_state when a released key holds no reference (the tier is then in an
  /// unspecified but valid state); error host_memory_exhausted when the arena cannot grow
  void put(std::span<const block_object> objects, std::span<const block_key> retain,
           std::span<const block_key> release)
  {
    const std::uint64_t mark = ++put_marks_;
    unique_.clear();
    for (const block_object& object : objects) {
      const detail::entry_index e = index_.find_or_add(object.key.bytes, object.key.hash);
      detail::tier_entry& entry   = index_[e];
      if (entry.put_mark != mark) {
        entry.put_mark = mark;
        unique_.push_back(e);
      }
      entry.payload = object.bytes;  // a key named twice stores its last bytes
    }
    for (const detail::entry_index e : unique_) {  // an unreferenced stored copy is replaced
      if (index_[e].in_lru) { unstore(e); }
    }
    for (const block_key& key : retain) {
      const detail::entry_index e = index_.find_or_add(key.bytes, key.hash);
      detail::tier_entry& entry   = index_[e];
      if (entry.refs == 0) { index_.lru_remove(e); }
      ++entry.refs;
    }
    terminal_.clear();
    for (const block_key& key : release) {
      const detail::entry_index e = index_.find(key.bytes, key.hash);
      if (e == detail::no_entry || index_[e].refs == 0) {
        throw error{errc::invalid_state, "block tier: a key was released more often than it was retained (" +
                                           std::to_string(key.bytes.size()) + "-byte key " + hex_prefix(key.bytes) + ")"};
      }
      detail::tier_entry& entry = index_[e];
      if (--entry.refs > 0) { continue; }
      if (entry.stored) { index_.lru_add(e); }
      entry.terminal_mark = mark;
      terminal_.push_back(e);
    }
    for (const detail::entry_index e : unique_) {
      detail::tier_entry& entry = index_[e];
      if (!entry.stored) {
        entry.stored = true;
        entry.slot   = -1;
        ++stored_;
      }
      if (entry.refs == 0) { index_.lru_touch(e); }
    }
    for (const detail::entry_index e : terminal_) {
      if (index_[e].in_lru) { index_.lru_touch(e); }
    }
    evict_to_fit(mark);
    if (stored_ * block_bytes_ > arena_.bytes()) {
      arena_.grow(std::max(stored_ * block_bytes_, 2 * arena_.bytes()));
      limit_blocks_ = arena_.bytes() / block_bytes_;
      ++growths_;
    }
    for (const detail::entry_index e : unique_) {
      detail::tier_entry& entry = index_[e];
      if (!entry.stored || entry.slot >= 0) { continue; }  // evicted meanwhile, or kept its bytes
      entry.slot = allocate_slot();
      std::memcpy(arena_.block(entry.slot), entry.payload, block_bytes_);
    }
    for (const detail::entry_index e : unique_) { forget_if_unused(e); }
    for (const detail::entry_index e : terminal_) { forget_if_unused(e); }
    arena_.fault_in(next_slot_ + static_cast<std::int64_t>(options_.fault_ahead_blocks));
  }

  /// @brief Copies the blocks of `keys`, in order, to `out` (keys.size() * block_bytes() bytes)
  /// and makes them the most recently used, in that order; or, if one is not stored, copies
  /// nothing, changes nothing and returns the position of the first missing key.
  [[nodiscard]] std::optional<std::size_t> read(std::span<const block_key> keys, std::byte* out)
  {
    found_.clear();
    for (std::size_t i = 0; i < keys.size(); ++i) {
      const detail::entry_index e = index_.find(keys[i].bytes, keys[i].hash);
      if (e == detail::no_entry || !index_[e].stored) { return i; }
      found_.push_back(e);
    }
    for (std::size_t i = 0; i < found_.size(); ++i) {
      std::memcpy(out + i * block_bytes_, arena_.block(index_[found_[i]].slot), block_bytes_);
    }
    for (const detail::entry_index e : found_) {
      if (index_[e].in_lru) { index_.lru_touch(e); }
    }
    return std::nullopt;
  }

  /// @brief The stored keys nobody references, oldest first (for tests and diagnostics).
  template <class F>
  void for_each_evictable(F&& f) const
  {
    for (detail::entry_index e = index_.lru_oldest(); e != detail::no_entry; e = index_[e].lru_next) {
      f(index_[e].key());
    }
  }

  /// @brief Times the arena grew because everything stored was referenced.
  [[nodiscard]] std::size_t growths() const noexcept { return growths_; }

 private:
  static std::size_t checked_block_bytes(std::size_t block_bytes, std::size_t max_bytes)
  {
    if (block_bytes == 0) { throw error{errc::invalid_config, "block tier: the block size must be positive"}; }
    if (max_bytes < block_bytes) {
      throw error{errc::invalid_config, "block tier: a budget of " + std::to_string(max_bytes) +
                                          " bytes holds no block of " + std::to_string(block_bytes) + " bytes"};
    }
    return block_bytes;
  }

  static std::string hex_prefix(std::span<const std::byte> key)
  {
    static constexpr char digits[] = "0123456789abcdef";
    std::string s;
    for (std::size_t i = 0; i < key.size() && i < 48; ++i) {
      const auto b = std::to_integer<unsigned>(key[i]);
      s += digits[b >> 4];
      s += digits[b & 15];
    }
    return key.size() > 48 ? s + "..." : s;
  }

  // Drops the block of a stored entry (its slot goes back).
  void unstore(detail::entry_index e) noexcept
  {
    detail::tier_entry& entry = index_[e];
    index_.lru_remove(e);
    if (entry.slot >= 0) { free_slots_.push_back(entry.slot); }
    entry.slot   = -1;
    entry.stored = false;
    --stored_;
  }

  // The oldest evictable blocks go until the budget holds the rest; this put's objects stay unless
  // it also released them.
  void evict_to_fit(std::uint64_t mark)
  {
    if (stored_ <= limit_blocks_) { return; }
    std::size_t excess = stored_ - limit_blocks_;
    for (detail::entry_index e = index_.lru_oldest(); e != detail::no_entry && excess > 0;) {
      const detail::entry_index next = index_[e].lru_next;
      const detail::tier_entry& entry = index_[e];
      if (entry.put_mark != mark || entry.terminal_mark == mark) {
        unstore(e);
        if (entry.put_mark != mark) { forget_if_unused(e); }  // this put's own are forgotten after it
        --excess;
      }
      e = next;
    }
  }

  std::int64_t allocate_slot()
  {
    if (!free_slots_.empty()) {
      const std::int64_t slot = free_slots_.back();
      free_slots_.pop_back();
      return slot;
    }
    return next_slot_++;
  }

  void forget_if_unused(detail::entry_index e) noexcept
  {
    const detail::tier_entry& entry = index_[e];
    if (entry.live && entry.refs == 0 && !entry.stored) { index_.erase(e); }
  }

  std::size_t block_bytes_;
  std::size_t limit_blocks_;
  block_tier_options options_;
  detail::block_arena arena_;
  detail::tier_index index_;
  std::vector<std::int64_t> free_slots_;  // slots freed by evictions and replacements, reused first
  std::int64_t next_slot_ = 0;            // slots [0, next_slot_) were handed out at least once
  std::size_t stored_     = 0;
  std::size_t growths_    = 0;
  std::uint64_t put_marks_ = 0;
  std::vector<detail::entry_index> unique_;    // scratch of put(): its objects' entries, first occurrence order
  std::vector<detail::entry_index> terminal_;  // scratch of put(): keys it took to zero references
  std::vector<detail::entry_index> found_;     // scratch of read()
};

}  // namespace routing_replay
