/// @file
/// Per-request position metadata of block-slot storage, in pages drawn from one pool: a request's
/// map grows page by page (never copied, as a vector doubling would copy it), a released request's
/// pages go back to the pool, and pages made ready when the store is built serve the first steps'
/// new requests, so a prefill step does not fault fresh pages in on the engine's thread. A page
/// taken from the pool is not refilled: a request's entries count as written up to its size, and
/// new positions are written once, by their first claim.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace routing_replay::detail {

/// @brief Maps (request handle, position) to a `Ref` (value-initialized: "nothing recorded"), in
/// pages of page_positions positions from a pool that only grows: close() gives a request's pages
/// back, and pages are made only when the pool has none.
///
/// A request's entries are written up to its size(): reserve() only makes room, and the entries
/// of positions past the size are whatever the page held before. Reaching past the size through
/// for_each() or entry() first writes the entries on the way value-initialized; for_each_new()
/// hands the new positions' entries to a writer that fills them in full, so a step that maps new
/// positions (every decode step and prefill chunk) writes each entry once and reads none: a refill
/// of every page taken, then a claim reading each entry back, cost a prefill step a pass over 12
/// KiB a page (docs/performance.md).
///
/// A request's first inline_pages page addresses sit in its own entry, so reaching a position there
/// costs the same loads as an array per request would (a decoding batch reaches one position of
/// every request, each a cache miss); later pages take one more.
///
/// close() never allocates (release and abort must not fail half-way): the pool keeps room for
/// every page made.
template <class Ref>
class position_pages {
  static_assert(std::is_trivially_copyable_v<Ref>, "pages are refilled by assignment, never destroyed per entry");

 public:
  /// @brief Positions per page: 512 entries of 24 bytes are three 4 KiB pages.
  static constexpr std::int64_t page_positions = 512;
  /// @brief Pages whose addresses a request's entry holds itself (4096 positions). Eight, not the
  /// seven that would fit one 64-byte line with the count: in the GPU engine loop, whose decoding
  /// positions run to 4096, seven made block-slot decode B1024 10 to 19 us slower (the eighth page
  /// through the list; docs/performance.md).
  static constexpr std::size_t inline_pages = 8;

  /// @brief A pool with `ready_pages` pages made, filled (so faulted in) and waiting.
  explicit position_pages(std::size_t ready_pages) : blank_(std::make_unique<page>())
  {
    made_.reserve(ready_pages);
    pool_.reserve(ready_pages);
    for (std::size_t i = 0; i < ready_pages; ++i) {
      made_.push_back(std::make_unique<page>());
      pool_.push_back(made_.back().get());
    }
  }

  /// @brief Positions a request may map: its size is kept in 32 bits.
  static constexpr std::int64_t max_positions = std::numeric_limits<std::uint32_t>::max();

  /// @brief Starts the map of handle `h` empty (a handle's previous request was closed).
  void open(std::uint32_t h)
  {
    if (h >= maps_.size()) {
      sizes_.resize(h + 1);  // first: if the maps' resize throws, a longer sizes_ harms nothing
      maps_.resize(h + 1);
    }
    close(h);
  }

  /// @brief Gives the pages of `h` back to the pool.
  void close(std::uint32_t h) noexcept
  {
    if (h >= maps_.size()) { return; }
    request_pages& map = maps_[h];
    for (std::size_t i = 0; i < map.count; ++i) { pool_.push_back(page_at(map, i)); }  // room was made with the page
    map.count = 0;
    map.later.clear();
    sizes_[h] = 0;
  }

  /// @brief Positions [0, size(h)) of `h` have entries written; later ones read as nothing
  /// recorded.
  [[nodiscard]] std::int64_t size(std::uint32_t h) const noexcept
  {
    return h < sizes_.size() ? static_cast<std::int64_t>(sizes_[h]) : 0;
  }

  /// @brief Gives `h` room for the entries of positions [0, positions), `positions` at most
  /// max_positions; writes none.
  [[gnu::always_inline]] void reserve(std::uint32_t h, std::int64_t positions)
  {
    request_pages& map = maps_[h];
    // every step of a request reserves its positions: all but one step in page_positions find them
    if (static_cast<std::int64_t>(map.count) * page_positions < positions) { grow(map, positions); }
  }

  /// @brief The entry of (`h`, `position`), position in [0, size(h)).
  [[nodiscard]] Ref& at(std::uint32_t h, std::int64_t position) noexcept
  {
    return page_at(maps_[h], page_of(position))->refs[offset_of(position)];
  }
  /// @copydoc at
  [[nodiscard]] const Ref& at(std::uint32_t h, std::int64_t position) const noexcept
  {
    return page_at(maps_[h], page_of(position))->refs[offset_of(position)];
  }

  /// @brief Where the entry of (`h`, `position`) would be, written or not (`position` inside the
  /// room reserve() made): for a prefetch.
  [[nodiscard]] const Ref* place_of(std::uint32_t h, std::int64_t position) const noexcept
  {
    return &at(h, position);
  }

  /// @brief The entry of (`h`, `position`), inside the room reserve() made; entries up to it are
  /// written value-initialized first if they were not.
  [[nodiscard]] Ref& entry(std::uint32_t h, std::int64_t position) noexcept
  {
    if (position >= static_cast<std::int64_t>(sizes_[h])) { extend(h, position + 1); }
    return at(h, position);
  }

  /// @brief Calls `f(i, entry)` for the entries of positions [first, first + count) of `h`, in
  /// order (i from 0), a page at a time, inside the room reserve() made; entries not written yet
  /// are written value-initialized first.
  template <class F>
  [[gnu::always_inline]] void for_each(std::uint32_t h, std::int64_t first, std::int64_t count, F&& f)
  {
    if (first + count > static_cast<std::int64_t>(sizes_[h])) { extend(h, first + count); }
    visit(maps_[h], first, count, f);
  }

  /// @brief for_each() of positions no entry of `h` maps yet (`first` >= size(h)), whose entries
  /// `f(i, entry)` writes in full without reading them (they hold what their page held before).
  /// Entries between size(h) and `first` are written value-initialized; the size becomes
  /// `first` + `count`.
  template <class F>
  [[gnu::always_inline]] void for_each_new(std::uint32_t h, std::int64_t first, std::int64_t count, F&& f)
  {
    if (first > static_cast<std::int64_t>(sizes_[h])) [[unlikely]] { extend(h, first); }
    visit(maps_[h], first, count, f);
    sizes_[h] = static_cast<std::uint32_t>(first + count);
  }

  /// @brief Pages waiting in the pool.
  [[nodiscard]] std::size_t pooled() const noexcept { return pool_.size(); }

 private:
  struct page {
    Ref refs[page_positions]{};
  };

  // A request's pages in position order: the first inline_pages here, the rest in `later`.
  struct request_pages {
    page* first[inline_pages] = {};
    std::size_t count         = 0;  // pages held
    std::vector<page*> later;
  };

  // Calls `g(i, refs, n)` for the entries of positions [first, first + count) of `map` a page at a
  // time: positions first + i to first + i + n - 1 are refs[0] to refs[n - 1].
  template <class G>
  [[gnu::always_inline]] static void for_each_segment(const request_pages& map, std::int64_t first, std::int64_t count,
                                                      G&& g)
  {
    std::int64_t i = 0;
    while (i < count) {
      const std::int64_t position = first + i;
      const auto offset           = static_cast<std::int64_t>(offset_of(position));
      const std::int64_t n        = std::min(count - i, page_positions - offset);
      g(i, page_at(map, page_of(position))->refs + offset, n);
      i += n;
    }
  }

  // for_each()'s walk over entries [first, first + count) of `map`.
  template <class F>
  [[gnu::always_inline]] static void visit(const request_pages& map, std::int64_t first, std::int64_t count, F& f)
  {
    for_each_segment(map, first, count, [&](std::int64_t i, Ref* refs, std::int64_t n) {
      for (std::int64_t j = 0; j < n; ++j) { f(static_cast<std::size_t>(i + j), refs[j]); }
    });
  }

  // Writes the entries of `h` from its size up to `end` value-initialized (copies of a blank
  // page: filling with a Ref{} that is not all zero bytes, a slot of -1, stores it field by field,
  // about eight instructions a position where the copy takes a few). Rare: a position mapped past
  // the request's last one (a prefix hit's, a recompute's, a claim after a gap).
  [[gnu::noinline]] void extend(std::uint32_t h, std::int64_t end) noexcept
  {
    const auto size = static_cast<std::int64_t>(sizes_[h]);
    for_each_segment(maps_[h], size, end - size, [&](std::int64_t, Ref* refs, std::int64_t n) {
      std::memcpy(static_cast<void*>(refs), blank_->refs, static_cast<std::size_t>(n) * sizeof(Ref));
    });
    sizes_[h] = static_cast<std::uint32_t>(end);
  }

  // positions are never negative: unsigned, the division and remainder are a shift and a mask
  [[nodiscard]] static std::size_t page_of(std::int64_t position) noexcept
  {
    return static_cast<std::size_t>(position) / page_positions;
  }
  [[nodiscard]] static std::size_t offset_of(std::int64_t position) noexcept
  {
    return static_cast<std::size_t>(position) % page_positions;
  }
  [[nodiscard]] static page* page_at(const request_pages& map, std::size_t i) noexcept
  {
    return i < inline_pages ? map.first[i] : map.later[i - inline_pages];
  }

  // reserve() past the request's pages: new ones from the pool, as they are (entries are written
  // as the request's size reaches them)
  [[gnu::noinline]] void grow(request_pages& map, std::int64_t positions)
  {
    const auto need = static_cast<std::size_t>((positions + page_positions - 1) / page_positions);
    if (need > inline_pages) { map.later.reserve(need - inline_pages); }
    while (map.count < need) {
      page* const p = take();
      if (map.count < inline_pages) {
        map.first[map.count] = p;
      } else {
        map.later.push_back(p);  // room was made
      }
      ++map.count;
    }
  }

  // A page from the pool, or a new one (the pool then makes room for it to come back).
  page* take()
  {
    if (!pool_.empty()) {
      page* const p = pool_.back();
      pool_.pop_back();
      return p;
    }
    if (pool_.capacity() < made_.size() + 1) { pool_.reserve(std::max(made_.size() + 1, 2 * pool_.capacity())); }
    if (made_.size() == made_.capacity()) { made_.reserve(std::max<std::size_t>(16, 2 * made_.size())); }
    made_.push_back(std::make_unique<page>());  // room was made first: if the page throws, nothing is lost
    return made_.back().get();
  }

  std::unique_ptr<const page> blank_;         // every entry value-initialized: what extend() copies
  std::vector<std::unique_ptr<page>> made_;  // every page, owned here
  std::vector<request_pages> maps_;          // per handle
  // per handle: positions whose entries are written. Beside the maps, not in them: every step
  // writes the size of each request it schedules, and a decoding batch would otherwise dirty a
  // line of every request's map (read-only in steps otherwise), where here 16 sizes share one.
  std::vector<std::uint32_t> sizes_;
  std::vector<page*> pool_;                  // pages no request holds
};

}  // namespace routing_replay::detail
