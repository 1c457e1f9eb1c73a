/// @file
/// Per-request host storage: each request's rows at its positions, contiguous for the host, at
/// addresses that never move while the request lives, so a kernel may write them (device scatter)
/// while the host plans later steps, and extraction is a view.
#pragma once

#include <routing_replay/config.hpp>
#include <routing_replay/detail/prefetch.hpp>
#include <routing_replay/detail/row_arena.hpp>
#include <routing_replay/detail/row_claim.hpp>
#include <routing_replay/detail/row_memory.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/index_type.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace routing_replay::detail {

/// @brief Rows of each request at their positions, in a reserved address range per request.
///
/// A request's range grows by segments from a row_arena (each at least doubling its capacity, or
/// exactly what a step needs when doubling would cross host_memory_limit), mapped one after the
/// other into the range: the host sees the request's rows contiguous, and kernels write them at
/// the segments' arena addresses (device_pieces()). Nothing is ever copied to grow. Where kernels
/// write the rows, a segment is mapped into the range when the host first reads the request's rows
/// (extraction), not when the step that needs it begins.
///
/// Which positions hold a row is metadata (the serial of the step that claimed each one), never
/// read from the rows: claims can be made when a step begins, before its rows arrive, and rows
/// of a step are readable once it has been filed (set_filed_through()). Positions never recorded
/// read as missing; a view of them holds the sentinel.
///
/// A closed request's range stays mapped, parked, and the next new request that fits in it takes
/// it over whole. Mapping a segment (MAP_POPULATE: page-table entries for every page) and unmapping
/// it cost more than filing its rows: on the H200 host, a prefill step of 8192 new rows spent
/// 2.5 to 3.3 ms in begin_step() mapping 6.3 MB, and filing into pages mapped that step ran at half
/// the speed of filing into pages mapped before. Parked ranges do not count as in use; they are
/// given back to the arena (oldest first) when growth would cross host_memory_limit.
/// @tparam RowMemory host_written_rows, or device_written_rows when kernels write the rows
template <class Index, class RowMemory = host_written_rows>
class per_request_store {
  using arena_type = row_arena<RowMemory>;

  // Claims of new positions not yet written to claimed_by: [first, first + count) claimed by step
  // `serial`, or, `per_step`, position first + i by step serial + i (a request decoding one token
  // in each of successive steps extends it, and never writes claimed_by).
  struct claim_run {
    std::int64_t first   = 0;
    std::uint64_t serial = 0;
    // 32 bits with the flag beside them, so that a request's hot fields share one cache line
    // (request_rows); a decode run longer than that is settled and a new one begins
    std::int32_t count = 0;  // 0: none
    bool per_step      = false;

    [[nodiscard]] bool holds(std::int64_t position) const noexcept
    {
      return position >= first && position < first + count;
    }
    [[nodiscard]] std::uint64_t serial_at(std::int64_t position) const noexcept
    {
      return per_step ? serial + static_cast<std::uint64_t>(position - first) : serial;
    }
  };
  // The longest claim_run: `count` is 32 bits (a run's tokens, std::int32_t, always fit).
  static constexpr std::int32_t max_run_count = std::numeric_limits<std::int32_t>::max();

  // A request's storage. The step's hot path (claim_fresh() and device_pieces() of new positions)
  // reads and writes only this entry of the dense rows_ array: which positions may hold a claim
  // (claimed_end), the newest claims (recent), where kernels reach the last segment (tail_*). It
  // touches neither the claims array nor the segment list, each a heap allocation in pages of its
  // own: with an engine's Python and torch work between steps, one such access per request cost a
  // TLB and cache miss (the H200 host: 0.3 to 0.4 us per request per step at B1024). Those fields
  // come first in an entry aligned to a cache line, so that a step touches one line per request:
  // entries of 144 bytes packed end to end spread them over two or three (cachegrind, decode
  // B1024: a quarter fewer first-level misses in begin_step with both entries aligned).
  struct alignas(64) request_rows {
    // --- hot: one cache line ---
    std::size_t capacity = 0;                        // bytes mapped at its start
    std::size_t tail_start = 0;                      // bytes of the range before the last segment
    std::byte* tail_address = nullptr;               // the last segment's first byte, as kernels reach it
    std::int64_t claimed_end = 0;                    // no position at or past it holds a claim
    claim_run recent;                                // claims not yet in claimed_by
    std::uint64_t last_claim = 0;                    // the latest step that claimed a row here
    // --- cold ---
    std::byte* view = nullptr;                       // the reserved range
    // Bytes at the range's start mapped for the host; below `capacity` only where kernels write the
    // rows: their segments are mapped into the range when the host first reads it (host_view()).
    mutable std::size_t mapped = 0;
    std::vector<typename arena_type::block> segments;  // mapped one after the other
    std::vector<std::uint64_t> claimed_by;           // per position: the claiming step, 0 if none
    bool adopted             = false;                // its last reserve() took a parked range
  };
  static_assert(4 * sizeof(std::size_t) + sizeof(claim_run) + sizeof(std::uint64_t) <= 64,
                "a request's hot fields fit one cache line");

 public:
  /// @brief Whether rows live at KV slots (false: at request positions).
  static constexpr bool slot_indexed = false;
  /// @brief reserve() changes nothing for a request whose growth_bytes() is 0 (the planner skips it).
  static constexpr bool reserve_only_grows = true;

  per_request_store(const replay_config& config, std::int64_t row_elems)
    : row_bytes_(static_cast<std::size_t>(row_elems) * sizeof(Index)),
      row_elems_(row_elems),
      max_rows_(config.max_model_len),
      limit_(config.host_memory_limit),
      base_(segment_base(row_bytes_)),
      arena_(base_, order_for(base_, static_cast<std::size_t>(max_rows_) * row_bytes_), bytes_ahead(config, row_bytes_))
  {
    // parking and adopting never allocate: close() and undo_reserve() must not fail
    parked_.reserve(max_parked);
    bare_.reserve(max_parked + 1);
  }
  per_request_store(per_request_store&&) noexcept            = default;
  per_request_store& operator=(per_request_store&&) noexcept = default;
  per_request_store(const per_request_store&)                = delete;
  per_request_store& operator=(const per_request_store&)     = delete;
  ~per_request_store()
  {
    for (auto& r : rows_) {
      if (r.view != nullptr) { ::munmap(r.view, view_bytes()); }
    }
    for (const auto& p : parked_) { ::munmap(p.view, view_bytes()); }
    for (std::byte* v : bare_) { ::munmap(v, view_bytes()); }
  }

  /// @brief Starts storage for request handle `h`: its range is reserved once and kept for the
  /// handle's later uses.
  void open(std::uint32_t h)
  {
    if (h >= rows_.size()) { rows_.resize(h + 1); }
    if (rows_[h].view == nullptr && !bare_.empty()) {
      rows_[h].view = bare_.back();
      bare_.pop_back();
    }
    if (rows_[h].view == nullptr) {
      void* at = ::mmap(nullptr, view_bytes(), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (at == MAP_FAILED) { throw_system_error("mmap of a request's reserved range"); }
      rows_[h].view = static_cast<std::byte*>(at);
    }
  }

  /// @brief Frees the rows of `h`: its range is parked for a later request, or its segments go back
  /// to the arena (those a kernel may still write, claimed by a step not yet filed, once that step
  /// has been). Strong: a failure changes nothing.
  /// @throws error host_memory_exhausted if the system refuses to unmap; std::bad_alloc
  void close(std::uint32_t h)
  {
    auto& r = rows_[h];
    if (r.capacity > 0 && parked_.size() < max_parked) {
      park(r);
      r = request_rows{};  // the handle takes a bare range at its next open()
      return;
    }
    // room for every segment in the pending list, then back to a bare reservation: if either
    // fails, nothing has changed, and nothing after them allocates (arena releases never do)
    if (pending_.capacity() < pending_.size() + r.segments.size()) {
      pending_.reserve(std::max(2 * pending_.capacity(), pending_.size() + r.segments.size()));
    }
    if (r.capacity > 0 && !unmap(r.view, r.capacity)) { throw_system_error("mmap over a closed request's rows"); }
    release_segments(r.segments, r.last_claim);
    forget_rows(r);
    r.last_claim = 0;
  }

  /// @brief Nothing to check: cached slots are not used here.
  void check_slot_range(std::span<const std::int64_t>) const noexcept {}
  /// @brief A prefix-cache hit has no rows here: its positions read as missing.
  void bind_cached(std::uint32_t, std::span<const std::int64_t>) noexcept {}
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

  /// @brief Extra bytes needed so that `h` can hold positions [0, rows): a segment that at least
  /// doubles its capacity, or with `exact` the smallest that suffices.
  [[nodiscard]] std::size_t growth_bytes(std::uint32_t h, std::int64_t rows, bool exact) const noexcept
  {
    const int order = growth_order(rows_[h], rows, exact);
    return order < 0 ? 0 : arena_.block_bytes(order);
  }

  /// @brief Blocks until the row memory kept ahead of need (replay_config::host_memory_ahead) is
  /// mapped, faulted in and registered.
  void wait_until_ahead() const { arena_.wait_until_ahead(); }

  /// @brief Bytes of rows held (segments of live requests, and of closed ones still in flight).
  [[nodiscard]] std::size_t bytes_in_use() const noexcept { return arena_.bytes_in_use() - parked_bytes_; }
  /// @brief The host memory limit.
  [[nodiscard]] std::size_t limit() const noexcept { return limit_; }

  /// @brief Grows `h` to hold positions [0, rows); growth_bytes() has been checked by the caller.
  /// Returns whether it grew (undo_reserve() takes the growth back).
  /// @throws error host_memory_exhausted if the system refuses memory
  bool reserve(std::uint32_t h, std::int64_t rows, bool exact)
  {
    auto& r         = rows_[h];
    r.adopted       = false;
    const int order = growth_order(r, rows, exact);
    if (order < 0) { return false; }
    if (r.capacity == 0 && adopt_parked(r, rows)) { return true; }
    const std::size_t bytes = arena_.block_bytes(order);
    evict_parked_beyond(bytes);
    const auto segment = arena_.allocate(order);
    // Where the host files the rows, the segment is mapped into the range now, populated in one
    // call rather than page by page as filing first touches it. Where kernels write them (at the
    // arena's addresses), the host first reads the range at extraction: the segment is mapped then
    // (host_view()), off the step (a mapping costs 15 us on the CPU machine, and a decode step of
    // requests that started at different times grows one or two of them).
    if constexpr (!RowMemory::device_writable) {
      if (!map_segment(r.view + r.capacity, segment)) {
        arena_.release(segment);
        throw_system_error("mmap of a row segment");
      }
    }
    try {
      r.segments.push_back(segment);
      r.claimed_by.resize((r.capacity + bytes) / row_bytes_, 0);
    } catch (...) {
      if (r.segments.size() > 0 && r.segments.back().offset == segment.offset) { r.segments.pop_back(); }
      unmap(r.view + r.capacity, bytes);
      arena_.release(segment);
      throw;
    }
    r.capacity += bytes;
    if constexpr (!RowMemory::device_writable) { r.mapped = r.capacity; }
    set_tail(r);
    return true;
  }

  /// @brief Takes back the growth of the last reserve() of `h` (nothing was claimed in it).
  void undo_reserve(std::uint32_t h) noexcept
  {
    auto& r = rows_[h];
    if (r.adopted) {  // park the range again; the handle takes back the bare range it gave up
      park(r);
      r.view = bare_.back();
      bare_.pop_back();
      forget_rows(r);
      r.adopted = false;
      return;
    }
    const auto segment      = r.segments.back();
    const std::size_t bytes = arena_.block_bytes(segment.order);
    r.segments.pop_back();
    r.capacity -= bytes;
    r.mapped = std::min(r.mapped, r.capacity);
    r.claimed_by.resize(r.capacity / row_bytes_);
    r.claimed_end = std::min(r.claimed_end, static_cast<std::int64_t>(r.claimed_by.size()));
    set_tail(r);
    unmap(r.view + r.capacity, bytes);
    arena_.release(segment);
  }

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
    by                           = step;
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
    if (by == serial) { by = prior; }
  }

  /// @brief Undoes the claim of (`h`, `position`) if step `serial` made it (a discarded step).
  void unclaim(std::uint32_t h, std::int64_t position, std::int64_t /*slot*/, std::uint64_t serial) noexcept
  {
    auto& r = rows_[h];
    settle(r);
    auto& by = r.claimed_by;
    if (static_cast<std::size_t>(position) < by.size() && by[static_cast<std::size_t>(position)] == serial) {
      by[static_cast<std::size_t>(position)] = 0;
    }
  }

  /// @brief Every step up to `serial` has been filed: rows they claimed have arrived, and segments
  /// of closed requests they wrote can be reused.
  void set_filed_through(std::uint64_t serial)
  {
    filed_through_ = serial;
    std::erase_if(pending_, [&](const pending_segment& p) {
      if (p.last_claim > serial) { return false; }
      arena_.release(p.segment);
      return true;
    });
  }

  /// @brief Calls `emit(device_dst, elems)` for the pieces, as kernels address them, of the `elems`
  /// ids at host address `host_dst` in the rows of request `h`.
  template <class Emit>
  void device_pieces(std::uint32_t h, Index* host_dst, std::int64_t elems, Emit&& emit) const
  {
    const auto& r     = rows_[h];
    auto offset       = static_cast<std::size_t>(reinterpret_cast<std::byte*>(host_dst) - r.view);
    auto left         = static_cast<std::size_t>(elems) * sizeof(Index);
    if (offset >= r.tail_start && offset + left <= r.capacity) {  // new positions: in the last segment
      emit(reinterpret_cast<Index*>(r.tail_address + (offset - r.tail_start)), elems);
      return;
    }
    std::size_t start = 0;
    for (const auto& s : r.segments) {
      const std::size_t bytes = arena_.block_bytes(s.order);
      if (offset < start + bytes) {
        const std::size_t take = std::min(left, start + bytes - offset);
        emit(reinterpret_cast<Index*>(arena_.address(s.offset) + (offset - start)),
             static_cast<std::int64_t>(take / sizeof(Index)));
        offset += take;
        left -= take;
        if (left == 0) { return; }
      }
      start += bytes;
    }
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
      if (by > filed_through_) { return nullptr; }
      if (by == 0) { std::fill_n(row_at(r, p), row_elems_, index_traits<Index>::sentinel); }
    }
    return row_at(r, first);
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
    if (by == 0 || by > filed_through_) { return false; }
    host_view(r);
    std::memcpy(out, row_at(r, position), row_bytes_);
    return true;
  }

 private:
  // At most this many closed ranges stay parked (a prefill step of new requests reuses as many).
  static constexpr std::size_t max_parked = 256;

  // What a provisional claim (claim_in_tail()) changed in its request's entry.
  struct provisional_claim {
    std::uint32_t handle;
    claim_run recent;
    std::int64_t claimed_end;
    std::uint64_t last_claim;
  };

  struct parked_range {
    std::byte* view = nullptr;
    std::size_t capacity = 0;
    std::size_t mapped   = 0;  // request_rows::mapped
    std::vector<typename arena_type::block> segments;
    std::uint64_t last_claim = 0;  // no kernel writes it once every step up to here was filed
  };

  // Gives `r` (no rows mapped yet) the smallest parked range that holds positions [0, rows) and
  // that no kernel writes any more; its bare range is kept for undo_reserve() and later open()s.
  bool adopt_parked(request_rows& r, std::int64_t rows)
  {
    const std::size_t need = static_cast<std::size_t>(std::min(rows, max_rows_)) * row_bytes_;
    auto best              = parked_.end();
    for (auto it = parked_.begin(); it != parked_.end(); ++it) {
      if (it->last_claim <= filed_through_ && it->capacity >= need &&
          (best == parked_.end() || it->capacity < best->capacity)) {
        best = it;
      }
    }
    if (best == parked_.end()) { return false; }
    if (bare_.size() == bare_.capacity()) { bare_.reserve(2 * bare_.capacity()); }  // may throw: nothing changed
    r.claimed_by.assign(best->capacity / row_bytes_, 0);  // was empty; may throw, and then still is
    bare_.push_back(r.view);  // no allocation: room was made above
    r.view        = best->view;
    r.capacity    = best->capacity;
    r.mapped      = best->mapped;
    r.segments    = std::move(best->segments);
    r.claimed_end = 0;
    r.recent      = {};
    r.adopted     = true;
    set_tail(r);
    parked_bytes_ -= best->capacity;
    *best = std::move(parked_.back());
    parked_.pop_back();
    return true;
  }

  // Gives parked ranges back to the arena, oldest first, while mapping `bytes` more would cross the limit.
  void evict_parked_beyond(std::size_t bytes)
  {
    while (!parked_.empty() && arena_.bytes_in_use() + bytes > limit_) {
      pending_.reserve(pending_.size() + parked_.front().segments.size());  // may throw: nothing changed
      parked_range p = std::move(parked_.front());
      parked_.erase(parked_.begin());
      parked_bytes_ -= p.capacity;
      ::munmap(p.view, view_bytes());
      release_segments(p.segments, p.last_claim);
    }
  }

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

  // `r` holds no rows any more: no segments, no claims (its range stays reserved).
  void forget_rows(request_rows& r) const noexcept
  {
    r.segments.clear();
    r.claimed_by.clear();
    r.capacity    = 0;
    r.mapped      = 0;
    r.claimed_end = 0;
    r.recent      = {};
    set_tail(r);
  }

  // Where the last segment of `r` starts in its range and where kernels reach it (device_pieces()'s
  // fast path); after every change of its segments.
  void set_tail(request_rows& r) const noexcept
  {
    if (r.segments.empty()) {
      r.tail_start   = 0;
      r.tail_address = nullptr;
      return;
    }
    r.tail_start   = r.capacity - arena_.block_bytes(r.segments.back().order);
    r.tail_address = arena_.address(r.segments.back().offset);
  }

  // Moves the range of `r` to the parked list (room reserved: nothing allocates); the caller resets `r`.
  void park(request_rows& r) noexcept
  {
    parked_.push_back({r.view, r.capacity, r.mapped, std::move(r.segments), r.last_claim});
    parked_bytes_ += r.capacity;
  }

  // Unmapped segments go to the arena, or to the (reserved) pending list while a kernel may write them.
  void release_segments(const std::vector<typename arena_type::block>& segments, std::uint64_t last_claim) noexcept
  {
    for (const auto& s : segments) {
      if (last_claim > filed_through_) {
        pending_.push_back({s, last_claim});
      } else {
        arena_.release(s);
      }
    }
  }

  struct pending_segment {
    typename arena_type::block segment;
    std::uint64_t last_claim;  // released once every step up to it has been filed
  };

  // Bytes of row memory the arena keeps ready (config.host_memory_ahead; by default a full step of
  // new rows).
  static std::size_t bytes_ahead(const replay_config& config, std::size_t row_bytes)
  {
    return config.host_memory_ahead >= 0 ? static_cast<std::size_t>(config.host_memory_ahead)
                                         : static_cast<std::size_t>(config.max_tokens_per_step) * row_bytes;
  }

  // The smallest segment: a page multiple of at least 16 rows.
  static std::size_t segment_base(std::size_t row_bytes)
  {
    const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    return (16 * row_bytes + page - 1) / page * page;
  }
  // The order whose segment holds `bytes` (so that one segment always suffices).
  static int order_for(std::size_t base, std::size_t bytes)
  {
    const std::size_t units = std::max<std::size_t>(1, (bytes + base - 1) / base);
    return static_cast<int>(std::bit_width(std::bit_ceil(units)) - 1);
  }

  // Maps `segment` of the arena at `at`, in a request's reserved range.
  [[nodiscard]] bool map_segment(std::byte* at, const typename arena_type::block& segment) const noexcept
  {
    constexpr int populate = RowMemory::device_writable ? 0 : MAP_POPULATE;  // kernels wrote the pages
    return ::mmap(at, arena_.block_bytes(segment.order), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | populate,
                  arena_.fd(), static_cast<off_t>(segment.offset)) != MAP_FAILED;
  }

  // Maps the segments of `r` the host has not seen yet into its range (kernels write rows at the
  // arena's addresses; reserve() leaves their mapping to the first read).
  // @throws error host_memory_exhausted if the system refuses the mapping
  void host_view(const request_rows& r) const
  {
    if (r.mapped == r.capacity) { return; }
    std::size_t start = 0;
    for (const auto& s : r.segments) {
      const std::size_t bytes = arena_.block_bytes(s.order);
      if (start >= r.mapped) {
        if (!map_segment(r.view + start, s)) { throw_system_error("mmap of a row segment"); }
        r.mapped = start + bytes;
      }
      start += bytes;
    }
  }

  // Turns [at, at + bytes) of a reserved range back into a bare reservation.
  static bool unmap(std::byte* at, std::size_t bytes) noexcept
  {
    return ::mmap(at, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) != MAP_FAILED;
  }

  [[nodiscard]] std::size_t view_bytes() const noexcept { return arena_.block_bytes(arena_.max_order()) * 2; }

  [[nodiscard]] Index* row_at(const request_rows& r, std::int64_t position) const noexcept
  {
    return reinterpret_cast<Index*>(r.view + static_cast<std::size_t>(position) * row_bytes_);
  }

  // The order of the segment that `reserve(h, rows, exact)` adds, or -1 if none is needed.
  [[nodiscard]] int growth_order(const request_rows& r, std::int64_t rows, bool exact) const noexcept
  {
    const std::size_t need = static_cast<std::size_t>(std::min(rows, max_rows_)) * row_bytes_;
    if (need <= r.capacity) { return -1; }
    const std::size_t increment = exact ? need - r.capacity : std::max(need - r.capacity, r.capacity);
    return std::min(order_for(base_, increment), arena_.max_order());
  }

  std::size_t row_bytes_;
  std::int64_t row_elems_;
  std::int64_t max_rows_;
  std::size_t limit_;
  std::size_t base_;
  std::uint64_t filed_through_ = 0;  // every step up to this serial has been filed
  arena_type arena_;
  std::vector<request_rows> rows_;
  std::vector<pending_segment> pending_;
  std::vector<parked_range> parked_;  // closed ranges kept mapped for the next requests
  std::size_t parked_bytes_ = 0;
  std::vector<std::byte*> bare_;      // reserved ranges with nothing mapped, for open()
  std::vector<provisional_claim> provisional_;  // what claim_in_tail()'s claims replaced, for their undo
};

}  // namespace routing_replay::detail
