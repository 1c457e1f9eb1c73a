/// @file
/// The block tier's bookkeeping: one entry per key the tier knows (stored, referenced, or both),
/// found through an open-addressing table, and the least-recently-used order of the stored blocks
/// nobody references, as a list threaded through the entries. Nothing here allocates once the
/// entry pool and the table are as large as the keys alive at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <utility>
#include <vector>

namespace routing_replay::detail {

/// @brief Entry index; `no_entry` where there is none.
using entry_index                      = std::int32_t;
/// @brief No entry.
inline constexpr entry_index no_entry = -1;

/// @brief What the tier knows about one key.
struct tier_entry {
  /// @brief Keys up to this many bytes live in the entry; longer ones in `spilled`.
  static constexpr std::size_t inline_key_bytes = 48;

  std::uint64_t hash     = 0;           ///< the key's hash
  std::uint32_t key_size = 0;           ///< bytes of the key
  std::int32_t refs      = 0;           ///< retains minus releases
  std::int64_t slot      = -1;          ///< arena slot of the block; -1 while none is allocated
  bool live              = false;       ///< the entry holds a key (false once erased)
  bool stored            = false;       ///< the key has a block (or one is being stored by the put in progress)
  bool in_lru            = false;       ///< stored, unreferenced, and so evictable
  entry_index lru_prev   = no_entry;    ///< older neighbour in the LRU order
  entry_index lru_next   = no_entry;    ///< newer neighbour
  std::uint64_t put_mark      = 0;      ///< the put whose objects include this key
  std::uint64_t terminal_mark = 0;      ///< the put whose releases took this key to zero references
  const std::byte* payload    = nullptr;  ///< the put in progress: where its block's bytes are
  std::byte key_inline[inline_key_bytes]{};  ///< the key, when short enough
  std::unique_ptr<std::byte[]> spilled;      ///< the key, when longer

  /// @brief The key's bytes.
  [[nodiscard]] std::span<const std::byte> key() const noexcept
  {
    return {spilled ? spilled.get() : key_inline, key_size};
  }
};

/// @brief Entries, the table that finds them by key, and the LRU list.
class tier_index {
 public:
  /// @brief Room for `expected_keys` keys before anything grows.
  explicit tier_index(std::size_t expected_keys)
  {
    entries_.reserve(expected_keys);
    std::size_t capacity = 16;
    while (capacity < 2 * expected_keys) { capacity *= 2; }
    table_.assign(capacity, empty);
  }

  /// @brief The entry of index `e`.
  [[nodiscard]] tier_entry& operator[](entry_index e) noexcept { return entries_[static_cast<std::size_t>(e)]; }
  /// @brief The entry of index `e`.
  [[nodiscard]] const tier_entry& operator[](entry_index e) const noexcept
  {
    return entries_[static_cast<std::size_t>(e)];
  }
  /// @brief Keys known.
  [[nodiscard]] std::size_t size() const noexcept { return live_; }

  /// @brief The entry of a key, or no_entry.
  [[nodiscard]] entry_index find(std::span<const std::byte> key, std::uint64_t hash) const noexcept
  {
    const std::size_t mask = table_.size() - 1;
    for (std::size_t at = hash & mask;; at = (at + 1) & mask) {
      const std::uint64_t cell = table_[at];
      if (cell == empty) { return no_entry; }
      if (tag_of(cell) == tag(hash)) {
        const entry_index e = index_of(cell);
        const tier_entry& entry = (*this)[e];
        if (entry.hash == hash && equal(entry.key(), key)) { return e; }
      }
    }
  }

  /// @brief The entry of a key, made (unstored, unreferenced) if there is none.
  entry_index find_or_add(std::span<const std::byte> key, std::uint64_t hash)
  {
    if (const entry_index e = find(key, hash); e != no_entry) { return e; }
    if (2 * (live_ + 1) > table_.size()) { rehash(2 * table_.size()); }
    entry_index e = no_entry;
    if (!free_.empty()) {
      e = free_.back();
      free_.pop_back();
    } else {
      entries_.emplace_back();
      e = static_cast<entry_index>(entries_.size() - 1);
    }
    tier_entry& entry = (*this)[e];
    entry.live        = true;
    entry.hash        = hash;
    entry.key_size    = static_cast<std::uint32_t>(key.size());
    if (key.size() > tier_entry::inline_key_bytes) {
      entry.spilled = std::make_unique<std::byte[]>(key.size());
      std::memcpy(entry.spilled.get(), key.data(), key.size());
    } else if (!key.empty()) {
      std::memcpy(entry.key_inline, key.data(), key.size());
    }
    insert(e, hash);
    ++live_;
    return e;
  }

  /// @brief Forgets an entry (neither stored nor referenced any more); its index may be reused.
  void erase(entry_index e) noexcept
  {
    tier_entry& entry = (*this)[e];
    const std::size_t mask = table_.size() - 1;
    std::size_t at = entry.hash & mask;
    while (table_[at] == empty || index_of(table_[at]) != e) { at = (at + 1) & mask; }
    // backward-shift deletion: no tombstones, so probes stay as short as the load allows
    for (std::size_t next = (at + 1) & mask;; next = (next + 1) & mask) {
      const std::uint64_t cell = table_[next];
      if (cell == empty) { break; }
      const std::size_t home = (*this)[index_of(cell)].hash & mask;
      if (((next - home) & mask) >= ((next - at) & mask)) {
        table_[at] = cell;
        at         = next;
      }
    }
    table_[at] = empty;
    entry.spilled.reset();
    entry = tier_entry{};
    free_.push_back(e);
    --live_;
  }

  // ---- the LRU order: oldest first -------------------------------------------------------------

  /// @brief The oldest entry of the LRU order, or no_entry.
  [[nodiscard]] entry_index lru_oldest() const noexcept { return lru_head_; }
  /// @brief Entries in the LRU order.
  [[nodiscard]] std::size_t lru_size() const noexcept { return lru_size_; }

  /// @brief Puts `e` at the newest end (appending it, or moving it there).
  void lru_touch(entry_index e) noexcept
  {
    tier_entry& entry = (*this)[e];
    if (entry.in_lru) {
      if (lru_tail_ == e) { return; }
      lru_unlink(e);
    }
    entry.lru_prev = lru_tail_;
    entry.lru_next = no_entry;
    if (lru_tail_ != no_entry) { (*this)[lru_tail_].lru_next = e; }
    lru_tail_ = e;
    if (lru_head_ == no_entry) { lru_head_ = e; }
    entry.in_lru = true;
    ++lru_size_;
  }

  /// @brief Appends `e` at the newest end unless it is in the order already (where it stays).
  void lru_add(entry_index e) noexcept
  {
    if (!(*this)[e].in_lru) { lru_touch(e); }
  }

  /// @brief Takes `e` out of the LRU order if it is there.
  void lru_remove(entry_index e) noexcept
  {
    if ((*this)[e].in_lru) { lru_unlink(e); }
  }

 private:
  static constexpr std::uint64_t empty = ~std::uint64_t{0};
  // a cell: the entry index in the low half, the hash's high half beside it (a cheap first compare)
  static std::uint32_t tag(std::uint64_t hash) noexcept { return static_cast<std::uint32_t>(hash >> 32); }
  static std::uint32_t tag_of(std::uint64_t cell) noexcept { return static_cast<std::uint32_t>(cell >> 32); }
  static entry_index index_of(std::uint64_t cell) noexcept { return static_cast<entry_index>(cell & 0xFFFFFFFFu); }
  static std::uint64_t cell_of(entry_index e, std::uint64_t hash) noexcept
  {
    return (static_cast<std::uint64_t>(tag(hash)) << 32) | static_cast<std::uint32_t>(e);
  }
  static bool equal(std::span<const std::byte> a, std::span<const std::byte> b) noexcept
  {
    return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size()) == 0);
  }

  void insert(entry_index e, std::uint64_t hash) noexcept
  {
    const std::size_t mask = table_.size() - 1;
    std::size_t at         = hash & mask;
    while (table_[at] != empty) { at = (at + 1) & mask; }
    table_[at] = cell_of(e, hash);
  }

  void rehash(std::size_t capacity)
  {
    std::vector<std::uint64_t> old = std::exchange(table_, std::vector<std::uint64_t>(capacity, empty));
    for (const std::uint64_t cell : old) {
      if (cell != empty) { insert(index_of(cell), (*this)[index_of(cell)].hash); }
    }
  }

  void lru_unlink(entry_index e) noexcept
  {
    tier_entry& entry = (*this)[e];
    if (entry.lru_prev != no_entry) { (*this)[entry.lru_prev].lru_next = entry.lru_next; } else { lru_head_ = entry.lru_next; }
    if (entry.lru_next != no_entry) { (*this)[entry.lru_next].lru_prev = entry.lru_prev; } else { lru_tail_ = entry.lru_prev; }
    entry.lru_prev = entry.lru_next = no_entry;
    entry.in_lru                    = false;
    --lru_size_;
  }

  std::vector<tier_entry> entries_;
  std::vector<entry_index> free_;
  std::vector<std::uint64_t> table_;  // power-of-two size, at most half full
  std::size_t live_      = 0;
  entry_index lru_head_  = no_entry;
  entry_index lru_tail_  = no_entry;
  std::size_t lru_size_  = 0;
};

}  // namespace routing_replay::detail
