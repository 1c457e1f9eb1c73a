/// @file
/// The address-range half of per-request host storage: each request's reserved range, grown by
/// row_arena segments mapped one after the other, parked whole when the request closes and adopted
/// by a later one, and where kernels reach its rows. per_request_store (per_request_store.hpp)
/// derives from it and adds the claims: which positions hold a row, and reading them back.
///
/// About 470 lines, past the 450 of one idea: growth, parking and adoption act on the same range
/// record and its invariants (a parked range is whole, adopted whole), so they stay in one file.
#pragma once

#include <routing_replay/config.hpp>
#include <routing_replay/detail/host_storage/row_arena.hpp>
#include <routing_replay/detail/host_storage/row_memory.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace routing_replay::detail {

/// @brief A reserved address range per request, holding its rows at their positions.
///
/// A request's range grows by segments from a row_arena (each at least doubling its capacity, or
/// exactly what a step needs when doubling would cross host_memory_limit), mapped one after the
/// other into the range: the host sees the request's rows contiguous, and kernels write them at
/// the segments' arena addresses (device_pieces()). Nothing is ever copied to grow. Where kernels
/// write the rows, a segment is mapped into the range when the host first reads the request's rows
/// (extraction), not when the step that needs it begins.
///
/// A closed request's range stays mapped, parked, and the next new request that fits in it takes
/// it over whole. Mapping a segment (MAP_POPULATE: page-table entries for every page) and unmapping
/// it cost more than filing its rows: on the H200 host, a prefill step of 8192 new rows spent
/// 2.5 to 3.3 ms in begin_step() mapping 6.3 MB, and filing into pages mapped that step ran at half
/// the speed of filing into pages mapped before. Parked ranges do not count as in use; they are
/// given back to the arena (oldest first) when growth would cross host_memory_limit.
///
/// Each request's entry also holds its claims (claimed_by, and the newest in the entry itself),
/// sized with its range here and kept by per_request_store, which derives from this class.
/// @tparam RowMemory host_written_rows, or device_written_rows when kernels write the rows
template <class Index, class RowMemory = host_written_rows>
class request_ranges {
 protected:
  /// @brief Where the segments come from.
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
  /// @brief Ranges for rows of `row_bytes` bytes, under `config`'s max_model_len and host memory
  /// limit.
  request_ranges(const replay_config& config, std::size_t row_bytes)
    : row_bytes_(row_bytes),
      max_rows_(config.max_model_len),
      limit_(config.host_memory_limit),
      base_(segment_base(row_bytes_)),
      arena_(base_, order_for(base_, static_cast<std::size_t>(max_rows_) * row_bytes_), bytes_ahead(config, row_bytes_))
  {
    // parking and adopting never allocate: close() and undo_reserve() must not fail
    parked_.reserve(max_parked);
    bare_.reserve(max_parked + 1);
  }
  request_ranges(request_ranges&&) noexcept            = default;
  request_ranges& operator=(request_ranges&&) noexcept = default;
  request_ranges(const request_ranges&)                = delete;
  request_ranges& operator=(const request_ranges&)     = delete;
  ~request_ranges()
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

  /// @brief How the row memory grew: superblocks made ahead and taken, and made in a step.
  [[nodiscard]] host_memory_growth growth() const noexcept { return arena_.growth(); }

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

 protected:
  // The host address of the row of `position` in the range of `r`.
  [[nodiscard]] Index* row_at(const request_rows& r, std::int64_t position) const noexcept
  {
    return reinterpret_cast<Index*>(r.view + static_cast<std::size_t>(position) * row_bytes_);
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

 private:
  // At most this many closed ranges stay parked (a prefill step of new requests reuses as many).
  static constexpr std::size_t max_parked = 256;

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

  // Bytes of row memory the arena keeps ready (config.host_memory_ahead; by default two full steps
  // of new rows: with one, a step of new requests emptied the ready list, and the next found the
  // worker still making its memory and mapped its own)
  static std::size_t bytes_ahead(const replay_config& config, std::size_t row_bytes)
  {
    return config.host_memory_ahead >= 0 ? static_cast<std::size_t>(config.host_memory_ahead)
                                         : 2 * static_cast<std::size_t>(config.max_tokens_per_step) * row_bytes;
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

  // Turns [at, at + bytes) of a reserved range back into a bare reservation.
  static bool unmap(std::byte* at, std::size_t bytes) noexcept
  {
    return ::mmap(at, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) != MAP_FAILED;
  }

  [[nodiscard]] std::size_t view_bytes() const noexcept { return arena_.block_bytes(arena_.max_order()) * 2; }

  // The order of the segment that `reserve(h, rows, exact)` adds, or -1 if none is needed.
  [[nodiscard]] int growth_order(const request_rows& r, std::int64_t rows, bool exact) const noexcept
  {
    const std::size_t need = static_cast<std::size_t>(std::min(rows, max_rows_)) * row_bytes_;
    if (need <= r.capacity) { return -1; }
    const std::size_t increment = exact ? need - r.capacity : std::max(need - r.capacity, r.capacity);
    return std::min(order_for(base_, increment), arena_.max_order());
  }

 protected:
  // per_request_store, the claims side, reads the entries, the row size and filed_through_ too
  std::size_t row_bytes_;
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
};

}  // namespace routing_replay::detail
