/// @file
/// Per-request position metadata of block-slot storage, in pages drawn from one pool: a request's
/// map grows page by page (never copied, as a vector doubling would copy it), a released request's
/// pages go back to the pool, and pages made ready when the store is built serve the first steps'
/// new requests, so a prefill step does not fault fresh pages in on the engine's thread.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace routing_replay::detail {

/// @brief Maps (request handle, position) to a `Ref` (value-initialized: "nothing recorded"), in
/// pages of page_positions positions from a pool that only grows: close() gives a request's pages
/// back, and pages are made only when the pool has none.
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
  /// through the list, 9.21 of docs/performance.md).
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

  /// @brief Starts the map of handle `h` empty (a handle's previous request was closed).
  void open(std::uint32_t h)
  {
    if (h >= maps_.size()) { maps_.resize(h + 1); }
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
  }

  /// @brief Positions [0, size(h)) of `h` have entries: a multiple of page_positions.
  [[nodiscard]] std::int64_t size(std::uint32_t h) const noexcept
  {
    return h < maps_.size() ? static_cast<std::int64_t>(maps_[h].count) * page_positions : 0;
  }

  /// @brief Gives `h` entries for positions [0, positions), new ones value-initialized.
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

  /// @brief Calls `f(i, entry)` for the entries of positions [first, first + count) of `h`, in
  /// order (i from 0), a page at a time; all inside [0, size(h)).
  template <class F>
  [[gnu::always_inline]] void for_each(std::uint32_t h, std::int64_t first, std::int64_t count, F&& f)
  {
    const request_pages& map = maps_[h];
    std::int64_t i           = 0;
    while (i < count) {
      const std::int64_t position = first + i;
      Ref* const refs             = page_at(map, page_of(position))->refs;
      const auto offset           = static_cast<std::int64_t>(offset_of(position));
      const std::int64_t n        = std::min(count - i, page_positions - offset);
      for (std::int64_t j = 0; j < n; ++j) { f(static_cast<std::size_t>(i + j), refs[offset + j]); }
      i += n;
    }
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
    std::size_t count         = 0;
    std::vector<page*> later;
  };

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

  // reserve() past the request's pages: new ones from the pool, refilled
  [[gnu::noinline]] void grow(request_pages& map, std::int64_t positions)
  {
    const auto need = static_cast<std::size_t>((positions + page_positions - 1) / page_positions);
    if (need > inline_pages) { map.later.reserve(need - inline_pages); }
    while (map.count < need) {
      page* const p = take();
      // a copy of a blank page: filling with a Ref{} that is not all zero bytes (a slot of -1)
      // stores it field by field, about eight instructions a position where the copy takes a few
      std::memcpy(static_cast<void*>(p->refs), blank_->refs, sizeof(p->refs));
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

  std::unique_ptr<const page> blank_;         // every entry value-initialized: what a refill copies
  std::vector<std::unique_ptr<page>> made_;  // every page, owned here
  std::vector<request_pages> maps_;          // per handle
  std::vector<page*> pool_;                  // pages no request holds
};

}  // namespace routing_replay::detail
