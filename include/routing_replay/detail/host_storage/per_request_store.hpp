/// @file
/// Per-request host storage: each request's rows at its positions, contiguous for the host, at
/// addresses that never move while the request lives, so a kernel may write them (device scatter)
/// while the host plans later steps, and extraction is a view. This file holds the claims (which
/// positions hold a row, and reading them back); the address ranges the rows live in, their growth
/// and their parking, are request_ranges (request_ranges.hpp), which per_request_store derives from.
#pragma once

#include <routing_replay/config.hpp>
#include <routing_replay/detail/prefetch.hpp>
#include <routing_replay/detail/host_storage/request_ranges.hpp>
#include <routing_replay/detail/row_claim.hpp>
#include <routing_replay/detail/host_storage/row_memory.hpp>
#include <routing_replay/index_type.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

namespace routing_replay::detail {

/// @brief Rows of each request at their positions, in a reserved address range per request
/// (request_ranges: how the range grows, is parked and is adopted).
///
/// Which positions hold a row is metadata (the serial of the step that claimed each one), never
/// read from the rows: claims can be made when a step begins, before its rows arrive, and rows
/// of a step are readable once it has been filed (set_filed_through()). Positions never recorded
/// read as missing; a view of them holds the sentinel.
/// @tparam RowMemory host_written_rows, or device_written_rows when kernels write the rows
template <class Index, class RowMemory = host_written_rows>
class per_request_store : public request_ranges<Index, RowMemory> {
  using ranges = request_ranges<Index, RowMemory>;
  using typename ranges::claim_run;
  using typename ranges::request_rows;
  using ranges::filed_through_;
  using ranges::host_view;
  using ranges::row_at;
  using ranges::row_bytes_;
  using ranges::rows_;

  // The longest claim_run: `count` is 32 bits (a run's tokens, std::int32_t, always fit).
  static constexpr std::int32_t max_run_count = std::numeric_limits<std::int32_t>::max();

 public:
  /// @brief Whether rows live at KV slots (false: at request positions).
  static constexpr bool slot_indexed = false;
  /// @brief reserve() changes nothing for a request whose growth_bytes() is 0 (the planner skips it).
  static constexpr bool reserve_only_grows = true;

  /// @brief Storage for rows of `row_elems` ids, under `config`'s limits.
  per_request_store(const replay_config& config, std::int64_t row_elems)
    : ranges(config, static_cast<std::size_t>(row_elems) * sizeof(Index)), row_elems_(row_elems)
  {
  }

  /// @brief Nothing to check: cached slots are not used here.
  void check_slot_range(std::span<const std::int64_t>) const noexcept {}
  /// @brief A prefix-cache hit has no rows here: its positions read as missing.
  void bind_cached(std::uint32_t, std::span<const std::int64_t>, std::uint64_t) noexcept {}
  /// @brief Starts a validation pass of a step plan (nothing to track).
  void begin_validation() noexcept {}
  /// @brief Checks the slots of a scheduled request (nothing to check: rows live at positions).
  void check_slots(std::span<const std::int64_t>, std::int32_t) const noexcept {}
  /// @brief Asks the processor for the entry of request `h` (any value is safe:
  /// detail::prefetch_for_write) a few requests before the planner gets to it: the planner's
  /// checks of a request are too long for the processor to start the next request's loads on its
  /// own.
  [[gnu::always_inline]] void prefetch(std::uint32_t h, std::span<const std::int64_t>) const noexcept
  {
    prefetch_for_write(rows_.data(), h);
  }
  /// @brief Checks blocks declared fresh (nothing to check: rows do not live in KV blocks).
  void check_blocks(std::span<const std::int64_t>, const char*) const noexcept {}
  /// @brief Nothing to do: rows do not live in KV blocks.
  void refresh_blocks(std::span<const std::int64_t>) noexcept {}
  /// @brief Rows do not live in KV blocks: every slot has generation 0.
  [[nodiscard]] std::uint32_t generation_of(std::int64_t) const noexcept { return 0; }

  /// @brief Where the row of (`h`, `position`) should be written (its host address), claimed by
  /// step `step`; `dst` null when the existing row stays (first write wins unless `replace`).
  [[nodiscard]] row_claim<Index> claim(std::uint32_t h,
                                       std::int64_t position,
                                       std::int64_t /*slot*/,
                                       std::uint32_t /*planned generation*/,
                                       std::uint64_t step,
                                       bool replace)
  {
    auto& r = rows_[h];
    settle(r);
    auto& by     = r.claimed_by[static_cast<std::size_t>(position)];
    r.last_claim = std::max(r.last_claim, step);  // even if the row stays: a step that tried holds the segments
    if (!replace && by != 0) { return {}; }
    const std::uint64_t replaced = by != 0 ? by : row_claim<Index>::no_claim;
    // a claim over a row keeps that row readable until its step is filed (claims made as a step
    // begins: a device scatter writes the new row only once the step has ended)
    by = by != 0 ? step | replaced_bit : step;
    r.claimed_end                = std::max(r.claimed_end, position + 1);
    return {row_at(r, position), nullptr, replaced};
  }

  /// @brief Claims positions [first, first + count) of `h` for step `step` as one range if none of
  /// them holds a claim (new tokens: every decode step and prefill chunk), and returns the host
  /// address of the first row (the range is contiguous); nullptr, and nothing changed, if one does.
  [[nodiscard]] Index* claim_fresh(std::uint32_t h, std::int64_t first, std::int64_t count, std::uint64_t step) noexcept
  {
    auto& r = rows_[h];
    if (first < r.claimed_end) {  // a recomputed position, say: look at the claims themselves
      settle(r);
      const std::uint64_t* by           = r.claimed_by.data() + first;
      const std::int64_t may_be_claimed = std::min(r.claimed_end - first, count);
      if (std::any_of(by, by + may_be_claimed, [](std::uint64_t c) { return c != 0; })) { return nullptr; }
    }
    take_fresh(r, first, count, step);
    return row_at(r, first);
  }

  /// @brief Claims made from now on by claim_in_tail() are provisional: undo_claim_in_tail() gives
  /// them back, newest first, until the next call. Room for `most` of them (claim_in_tail() then
  /// never allocates).
  void start_provisional_claims(std::size_t most)
  {
    provisional_.clear();
    provisional_.reserve(most);
  }

  /// @brief Claims positions [first, first + count) of `h` (count > 0) for step `step` if
  /// claim_fresh() would claim them in the entry alone and they lie in the last segment (no
  /// position at or past `first` holds a claim, the segment holds them all: every decode step and
  /// prefill chunk of a request that does not grow), provisionally; returns where kernels write the
  /// first of them. nullptr, and nothing changed, otherwise. The step planner claims the common
  /// step this way while it validates the plan, and gives the claims back if it refuses the plan.
  /// Always inlined: the planner calls it for every run, and at -O2 (the Python package's build)
  /// GCC kept it out of line, a call and its register saves a run.
  [[nodiscard, gnu::always_inline]] Index* claim_in_tail(std::uint32_t h, std::int64_t first, std::int64_t count,
                                                          std::uint64_t step) noexcept
  {
    auto& r = rows_[h];
    if (first < r.claimed_end) { return nullptr; }
    const auto offset = static_cast<std::size_t>(first) * row_bytes_;
    if (offset < r.tail_start || offset + static_cast<std::size_t>(count) * row_bytes_ > r.capacity) { return nullptr; }
    // a decoding request's claim extends its newest run, and undo_claim_in_tail() knows the entry
    // before it from the entry after it; any other claim keeps what it replaces (room was made)
    const bool extends = extends_recent(r, first, count, step);
    if (!extends) { provisional_.push_back({h, r.recent, r.claimed_end, r.last_claim}); }
    take_fresh(r, first, count, step, extends);
    return reinterpret_cast<Index*>(r.tail_address + (offset - r.tail_start));
  }

  /// @brief Gives back the claim of claim_in_tail(`h`, `first`, ..., `step`), the newest not given
  /// back since start_provisional_claims(): the entry of `h` is as before it. (A claim that
  /// settled the entry's earlier claims into its claims array leaves them there too: both say the
  /// same.)
  void undo_claim_in_tail(std::uint32_t h, std::int64_t first, std::uint64_t step) noexcept
  {
    auto& r = rows_[h];
    if (!provisional_.empty() && provisional_.back().handle == h) {
      const auto& p = provisional_.back();
      r.recent      = p.recent;
      r.claimed_end = p.claimed_end;
      r.last_claim  = p.last_claim;
      provisional_.pop_back();
      return;
    }
    // the claim extended the run of a request decoding in every step up to `step`: before it, its
    // claims ended at `first`, and the latest was step - 1's
    --r.recent.count;
    r.claimed_end = first;
    r.last_claim  = step - 1;
  }

  /// @brief A discarded step `serial` gives back its claim of (`h`, `position`), which replaced the
  /// claim of step `prior` (row_claim::replaced): the row there is `prior`'s again.
  void restore_claim(std::uint32_t h, std::int64_t position, std::int64_t, std::uint64_t serial,
                     std::uint64_t prior) noexcept
  {
    auto& r = rows_[h];
    settle(r);
    auto& by = r.claimed_by[static_cast<std::size_t>(position)];
    if (claim_step(by) == serial) { by = prior; }
  }

  /// @brief Undoes the claim of (`h`, `position`) if step `serial` made it (a discarded step).
  void unclaim(std::uint32_t h, std::int64_t position, std::int64_t /*slot*/, std::uint64_t serial) noexcept
  {
    auto& r = rows_[h];
    settle(r);
    auto& by = r.claimed_by;
    if (static_cast<std::size_t>(position) < by.size() && claim_step(by[static_cast<std::size_t>(position)]) == serial) {
      by[static_cast<std::size_t>(position)] = 0;
    }
  }

  /// @brief The row that the claim of (`h`, `position`) by a step after `step` replaced was
  /// rejected (a tentative draft row that claim took over): until the claiming step is filed, the
  /// position reads as missing.
  void forget_replaced_row(std::uint32_t h, std::int64_t position, std::uint64_t step) noexcept
  {
    auto& r = rows_[h];
    settle(r);
    if (static_cast<std::size_t>(position) >= r.claimed_by.size()) { return; }
    auto& by = r.claimed_by[static_cast<std::size_t>(position)];
    if ((by & replaced_bit) != 0 && claim_step(by) > step) { by = claim_step(by); }
  }

  /// @brief Forgets the row of (`h`, `position`) (a rejected draft). Metadata only, so it is safe
  /// while a kernel may still be writing that row.
  void erase(std::uint32_t h, std::int64_t position, std::int64_t /*slot*/) noexcept
  {
    auto& r = rows_[h];
    settle(r);
    auto& by = r.claimed_by;
    if (static_cast<std::size_t>(position) < by.size()) { by[static_cast<std::size_t>(position)] = 0; }
  }

  /// @brief Rows [first, first + count) of `h` as one contiguous array, positions never recorded
  /// set to the sentinel first; nullptr if some of them were never reserved (positions of a
  /// prefix-cache hit) or are claimed by a step not filed yet.
  [[nodiscard]] const Index* contiguous(std::uint32_t h, std::int64_t first, std::int64_t count)
  {
    auto& r = rows_[h];
    settle(r);
    if (count == 0 || static_cast<std::size_t>(first + count) > r.claimed_by.size()) { return nullptr; }
    host_view(r);
    for (std::int64_t p = first; p < first + count; ++p) {
      const std::uint64_t by = r.claimed_by[static_cast<std::size_t>(p)];
      if (!readable(by)) { return nullptr; }
      if (by == 0) { std::fill_n(row_at(r, p), row_elems_, index_traits<Index>::sentinel); }
    }
    return row_at(r, first);
  }

  /// @brief Hands rows [first, first + count) of `h` over where they lie, in position order:
  /// `rows(first_row, n)` for n recorded rows back to back, `missing(n)` for n positions without a
  /// readable row (never recorded, a prefix-cache hit, or claimed by a step not filed yet). Unlike
  /// contiguous(), it writes nothing into the rows, so a range with gaps is no reason to copy.
  /// @throws what the callables throw; error host_memory_exhausted (as contiguous())
  template <class Rows, class Missing>
  void for_each_run(std::uint32_t h, std::int64_t first, std::int64_t count, Rows&& rows, Missing&& missing)
  {
    auto& r = rows_[h];
    settle(r);
    const auto claimed = std::min(first + count, static_cast<std::int64_t>(r.claimed_by.size()));
    if (first < claimed) { host_view(r); }
    const auto present = [&](std::int64_t p) {
      if (p >= claimed) { return false; }
      const std::uint64_t by = r.claimed_by[static_cast<std::size_t>(p)];
      return by != 0 && readable(by);
    };
    for (std::int64_t p = first, end = first + count; p < end;) {
      const bool here = present(p);
      std::int64_t q  = p + 1;
      while (q < end && present(q) == here) { ++q; }
      if (here) {
        rows(static_cast<const Index*>(row_at(r, p)), q - p);
      } else {
        missing(q - p);
      }
      p = q;
    }
  }

  /// @brief Copies rows [first, first + count) of `h` to `out`, the sentinel for missing ones.
  void read_rows(std::uint32_t h, std::int64_t first, std::int64_t count, Index* out) const
  {
    for (std::int64_t p = first; p < first + count; ++p, out += row_elems_) {
      if (!read(h, p, out)) { std::fill_n(out, row_elems_, index_traits<Index>::sentinel); }
    }
  }

  /// @brief Copies the row of (`h`, `position`) to `out`; false (and `out` untouched) if missing.
  bool read(std::uint32_t h, std::int64_t position, Index* out) const
  {
    const auto& r = rows_[h];
    if (static_cast<std::size_t>(position) >= r.claimed_by.size()) { return false; }
    const std::uint64_t by =
      r.recent.holds(position) ? r.recent.serial_at(position) : r.claimed_by[static_cast<std::size_t>(position)];
    if (by == 0 || !readable(by)) { return false; }
    host_view(r);
    std::memcpy(out, row_at(r, position), row_bytes_);
    return true;
  }

 private:
  // A claim (the claiming step's serial) with this bit replaced a row that readers keep seeing
  // until that step is filed; serials stay far below it.
  static constexpr std::uint64_t replaced_bit = std::uint64_t{1} << 63;
  [[nodiscard]] static std::uint64_t claim_step(std::uint64_t by) noexcept { return by & ~replaced_bit; }
  // Whether readers see the row of a claim (0: none, which callers tell apart): its step has been
  // filed, or it replaced a row that is still there.
  [[nodiscard]] bool readable(std::uint64_t by) const noexcept
  {
    return claim_step(by) <= filed_through_ || (by & replaced_bit) != 0;
  }

  // What a provisional claim (claim_in_tail()) changed in its request's entry.
  struct provisional_claim {
    std::uint32_t handle;
    claim_run recent;
    std::int64_t claimed_end;
    std::uint64_t last_claim;
  };

  // Claims new positions [first, first + count) of `r` (nothing at or past `first` is claimed) in
  // its entry alone: past claimed_end nothing is claimed, so claimed_by is not written.
  static void take_fresh(request_rows& r, std::int64_t first, std::int64_t count, std::uint64_t step) noexcept
  {
    take_fresh(r, first, count, step, extends_recent(r, first, count, step));
  }
  // take_fresh(), told whether the claim extends_recent()
  static void take_fresh(request_rows& r, std::int64_t first, std::int64_t count, std::uint64_t step, bool extends) noexcept
  {
    auto& run = r.recent;
    if (extends) {
      ++run.count;  // the next step of a decoding request
    } else {
      settle(r);
      run = claim_run{first, step, static_cast<std::int32_t>(count), count == 1};
    }
    r.claimed_end = std::max(r.claimed_end, first + count);
    r.last_claim  = std::max(r.last_claim, step);
  }

  // Whether take_fresh() claims new positions [first, first + count) of `r` for step `step` by
  // extending its newest run: one more step of a request that decoded in every step of the run.
  [[nodiscard]] static bool extends_recent(const request_rows& r, std::int64_t first, std::int64_t count,
                                           std::uint64_t step) noexcept
  {
    const auto& run = r.recent;
    // a per-step run holds at least one claim (it starts with one, and settling empties it whole)
    return count == 1 && run.per_step && first == run.first + run.count &&
           step == run.serial + static_cast<std::uint64_t>(run.count) && run.count < max_run_count;
  }

  // Writes the claims `r` holds in its entry alone to claimed_by: before anything else reads or
  // changes claims there (a recomputed position, drafts, a discard, extraction).
  static void settle(request_rows& r) noexcept
  {
    auto& run = r.recent;
    if (run.count == 0) { return; }
    std::uint64_t* by = r.claimed_by.data() + run.first;
    for (std::int64_t i = 0; i < run.count; ++i) { by[i] = run.serial_at(run.first + i); }
    run = {};
  }

  std::int64_t row_elems_;
  std::vector<provisional_claim> provisional_;  // what claim_in_tail()'s claims replaced, for their undo
};

}  // namespace routing_replay::detail
