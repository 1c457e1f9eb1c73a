/// @file
/// Per-request position metadata of block-slot storage, in pages drawn from one pool: a request's
/// map grows page by page (never copied, as a vector doubling would copy it), a released request's
/// pages go back to the pool, and pages made ready when the store is built serve the first steps'
/// new requests, so a prefill step does not fault fresh pages in on the engine's thread.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

namespace routing_replay::detail {

/// @brief Maps (request handle, position) to a `Ref` (value-initialized: "nothing recorded"), in
/// pages of page_positions positions from a pool that only grows: close() gives a request's pages
/// back, and pages are made only when the pool has none.
///
/// close() never allocates (release and abort must not fail half-way): the pool keeps room for
/// every page made.
template <class Ref>
class position_pages {
  static_assert(std::is_trivially_copyable_v<Ref>, "pages are refilled by assignment, never destroyed per entry");

 public:
  /// @brief Positions per page: 512 entries of 24 bytes are three 4 KiB pages.
  static constexpr std::int64_t page_positions = 512;

  /// @brief A pool with `ready_pages` pages made, filled (so faulted in) and waiting.
  explicit position_pages(std::size_t ready_pages)
  {
    pool_.reserve(ready_pages);
    for (std::size_t i = 0; i < ready_pages; ++i) { pool_.push_back(std::make_unique<page>()); }
    made_ = ready_pages;
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
    for (auto& p : maps_[h]) { pool_.push_back(std::move(p)); }  // room was made with the page
    maps_[h].clear();
  }

  /// @brief Positions [0, size(h)) of `h` have entries: a multiple of page_positions.
  [[nodiscard]] std::int64_t size(std::uint32_t h) const noexcept
  {
    return h < maps_.size() ? static_cast<std::int64_t>(maps_[h].size()) * page_positions : 0;
  }

  /// @brief Gives `h` entries for positions [0, positions), new ones value-initialized.
  void reserve(std::uint32_t h, std::int64_t positions)
  {
    auto& map = maps_[h];
    const auto need = static_cast<std::size_t>((positions + page_positions - 1) / page_positions);
    if (map.size() >= need) { return; }
    map.reserve(need);
    while (map.size() < need) {
      std::unique_ptr<page> p = take();
      std::fill(std::begin(p->refs), std::end(p->refs), Ref{});
      map.push_back(std::move(p));
    }
  }

  /// @brief The entry of (`h`, `position`), position in [0, size(h)).
  [[nodiscard]] Ref& at(std::uint32_t h, std::int64_t position) noexcept
  {
    return maps_[h][page_of(position)]->refs[offset_of(position)];
  }
  /// @copydoc at
  [[nodiscard]] const Ref& at(std::uint32_t h, std::int64_t position) const noexcept
  {
    return maps_[h][page_of(position)]->refs[offset_of(position)];
  }

  /// @brief Calls `f(i, entry)` for the entries of positions [first, first + count) of `h`, in
  /// order (i from 0), a page at a time; all inside [0, size(h)).
  template <class F>
  [[gnu::always_inline]] void for_each(std::uint32_t h, std::int64_t first, std::int64_t count, F&& f)
  {
    const auto& map = maps_[h];
    std::int64_t i  = 0;
    while (i < count) {
      const std::int64_t position = first + i;
      Ref* const refs           = map[page_of(position)]->refs;
      const std::int64_t offset = static_cast<std::int64_t>(offset_of(position));
      const std::int64_t n      = std::min(count - i, page_positions - offset);
      for (std::int64_t j = 0; j < n; ++j) { f(static_cast<std::size_t>(i + j), refs[offset + j]); }
      i += n;
    }
  }

  /// @brief Pages waiting in the pool.
  [[nodiscard]] std::size_t pooled() const noexcept { return pool_.size(); }

 private:
  // positions are never negative: unsigned, the division and remainder are a shift and a mask
  [[nodiscard]] static std::size_t page_of(std::int64_t position) noexcept
  {
    return static_cast<std::size_t>(position) / page_positions;
  }
  [[nodiscard]] static std::size_t offset_of(std::int64_t position) noexcept
  {
    return static_cast<std::size_t>(position) % page_positions;
  }

  struct page {
    Ref refs[page_positions]{};
  };

  // A page from the pool, or a new one (the pool then makes room for it to come back).
  std::unique_ptr<page> take()
  {
    if (!pool_.empty()) {
      std::unique_ptr<page> p = std::move(pool_.back());
      pool_.pop_back();
      return p;
    }
    if (pool_.capacity() < made_ + 1) { pool_.reserve(std::max(made_ + 1, 2 * pool_.capacity())); }
    auto p = std::make_unique<page>();
    ++made_;
    return p;
  }

  std::vector<std::vector<std::unique_ptr<page>>> maps_;  // per handle, its pages in position order
  std::vector<std::unique_ptr<page>> pool_;                // pages no request holds
  std::size_t made_ = 0;                                   // pages made: room the pool keeps
};

}  // namespace routing_replay::detail
