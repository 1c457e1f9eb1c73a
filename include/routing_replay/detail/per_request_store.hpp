/// @file
/// Per-request growable host storage: each request owns one contiguous [capacity, L, K] array.
#pragma once

#include <routing_replay/config.hpp>
#include <routing_replay/detail/row_claim.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/index_type.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace routing_replay::detail {

/// @brief Rows of each request at their positions, in one growable array per request.
///
/// Growth is amortised (doubling) and capped at max_model_len rows; capacity is reserved in
/// begin_step so that the scatter never allocates and the memory limit is checked before anything
/// changes. Unwritten rows hold the sentinel, which is also how "already recorded" is detected.
template <class Index>
class per_request_store {
 public:
  /// @brief Whether rows live at KV slots (false: at request positions).
  static constexpr bool slot_indexed = false;

  per_request_store(const replay_config& config, std::int64_t row_elems)
    : row_elems_(row_elems), max_rows_(config.max_model_len), limit_(config.host_memory_limit)
  {
  }

  /// @brief Starts storage for request handle `h`.
  void open(std::uint32_t h)
  {
    if (h >= rows_.size()) { rows_.resize(h + 1); }
  }

  /// @brief Nothing to check: cached slots are not used here.
  void check_slot_range(std::span<const std::int64_t>) const noexcept {}

  /// @brief A prefix-cache hit has no rows here: its positions read as missing.
  void bind_cached(std::uint32_t, std::span<const std::int64_t>) noexcept {}

  /// @brief Frees the rows of `h`.
  void close(std::uint32_t h)
  {
    bytes_ -= rows_[h].capacity() * sizeof(Index);
    rows_[h] = std::vector<Index>{};
  }

  /// @brief Starts a validation pass of a step plan (nothing to track).
  void begin_validation() noexcept {}
  /// @brief Checks the slots of a scheduled request (nothing to check: rows live at positions).
  void check_slots(std::span<const std::int64_t>, std::int32_t) const noexcept {}
  /// @brief Checks blocks declared fresh (nothing to check: rows do not live in KV blocks).
  void check_blocks(std::span<const std::int64_t>, const char*) const noexcept {}

  /// @brief Extra bytes needed so that `h` can hold positions [0, rows); `exact` grows to exactly
  /// `rows` instead of doubling (used when doubling would cross the memory limit).
  [[nodiscard]] std::size_t growth_bytes(std::uint32_t h, std::int64_t rows, bool exact) const noexcept
  {
    const std::size_t have = rows_[h].capacity();
    const std::size_t need = grown_capacity(h, rows, exact);
    return need > have ? (need - have) * sizeof(Index) : 0;
  }

  /// @brief Bytes currently allocated for rows.
  [[nodiscard]] std::size_t bytes_in_use() const noexcept { return bytes_; }
  /// @brief The host memory limit.
  [[nodiscard]] std::size_t limit() const noexcept { return limit_; }

  /// @brief Grows `h` to hold positions [0, rows); growth_bytes() has been checked by the caller.
  void reserve(std::uint32_t h, std::int64_t rows, bool exact)
  {
    auto& r                = rows_[h];
    const std::size_t need = grown_capacity(h, rows, exact);
    if (need <= r.capacity()) {
      if (static_cast<std::size_t>(rows * row_elems_) > r.size()) {
        r.resize(static_cast<std::size_t>(rows * row_elems_), index_traits<Index>::sentinel);
      }
      return;
    }
    std::vector<Index> grown;
    grown.reserve(need);
    grown.assign(r.begin(), r.end());
    grown.resize(static_cast<std::size_t>(rows * row_elems_), index_traits<Index>::sentinel);
    bytes_ += (grown.capacity() - r.capacity()) * sizeof(Index);
    r = std::move(grown);
  }

  /// @brief Where the row of (`h`, `position`) should be written; `dst` null when the existing
  /// row stays (first write wins unless `replace`). Positions were reserved in begin_step; rows are
  /// claimed when they arrive, on the host, so the row's contents tell whether it was recorded.
  [[nodiscard]] row_claim<Index> claim(std::uint32_t h,
                                       std::int64_t position,
                                       std::int64_t /*slot*/,
                                       std::uint32_t /*planned generation*/,
                                       std::uint64_t /*step*/,
                                       bool replace)
  {
    Index* row = rows_[h].data() + position * row_elems_;
    if (!replace && row[0] != index_traits<Index>::sentinel) { return {}; }
    return {row, nullptr};
  }

  /// @brief Rows do not live in KV blocks: every slot has generation 0.
  [[nodiscard]] std::uint32_t generation_of(std::int64_t /*slot*/) const noexcept { return 0; }

  /// @brief Forgets the row of (`h`, `position`) (a rejected draft).
  void erase(std::uint32_t h, std::int64_t position, std::int64_t /*slot*/)
  {
    std::fill_n(rows_[h].data() + position * row_elems_, row_elems_, index_traits<Index>::sentinel);
  }

  /// @brief Rows [first, first + count) of `h` as one contiguous array, or nullptr if some of
  /// them were never reserved (positions of a prefix-cache hit: they are read as missing).
  [[nodiscard]] const Index* contiguous(std::uint32_t h, std::int64_t first, std::int64_t count) const
  {
    const auto& r = rows_[h];
    if (count == 0 || static_cast<std::size_t>((first + count) * row_elems_) > r.size()) {
      return nullptr;
    }
    return r.data() + first * row_elems_;
  }

  /// @brief Copies the row of (`h`, `position`) to `out`; false (and `out` untouched) if missing.
  bool read(std::uint32_t h, std::int64_t position, Index* out) const
  {
    const auto& r = rows_[h];
    if (static_cast<std::size_t>((position + 1) * row_elems_) > r.size()) { return false; }
    const Index* row = r.data() + position * row_elems_;
    if (row[0] == index_traits<Index>::sentinel) { return false; }
    std::memcpy(out, row, static_cast<std::size_t>(row_elems_) * sizeof(Index));
    return true;
  }

  /// @brief Nothing to do: rows do not live in KV blocks.
  void refresh_blocks(std::span<const std::int64_t>) noexcept {}

 private:
  [[nodiscard]] std::size_t grown_capacity(std::uint32_t h, std::int64_t rows, bool exact) const noexcept
  {
    const std::size_t have_rows = rows_[h].capacity() / static_cast<std::size_t>(row_elems_);
    if (static_cast<std::size_t>(rows) <= have_rows) { return rows_[h].capacity(); }
    const std::size_t doubled = exact ? 0 : std::max<std::size_t>(2 * have_rows, 16);
    const std::size_t grown   = std::min<std::size_t>(
      std::max<std::size_t>(doubled, static_cast<std::size_t>(rows)), static_cast<std::size_t>(max_rows_));
    return grown * static_cast<std::size_t>(row_elems_);
  }

  std::int64_t row_elems_;
  std::int64_t max_rows_;
  std::size_t limit_;
  std::size_t bytes_ = 0;
  std::vector<std::vector<Index>> rows_;
};

}  // namespace routing_replay::detail
