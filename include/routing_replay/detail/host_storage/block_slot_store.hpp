/// @file
/// Block-slot indexed host storage: rows live at KV-cache slots, so prefix-cache hits and
/// preemption keep them, and a per-block generation detects rows made stale by block reuse. This
/// file holds, per request, which slot (and which generation of its block) holds each position,
/// the claims that map them and the reads; the slots themselves, their claims and the blocks'
/// generations are slot_pool (slot_pool.hpp), which block_slot_store derives from.
#pragma once

#include <routing_replay/config.hpp>
#include <routing_replay/detail/host_storage/position_pages.hpp>
#include <routing_replay/detail/row_claim.hpp>
#include <routing_replay/detail/host_storage/row_memory.hpp>
#include <routing_replay/detail/host_storage/slot_pool.hpp>
#include <routing_replay/detail/host_storage/streaming_store.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/index_type.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>

namespace routing_replay::detail {

/// @brief One [num_blocks * block_size, L, K] array indexed by KV slot, plus, per request, which
/// slot (and which generation of its block) holds each position.
///
/// A step maps the positions it computes when it begins (its claims), but readers keep seeing the
/// mapping it replaced until that step is filed: a position recomputed into new blocks, or into a
/// slot another request already filled, reads as before the step until the step's rows are in,
/// and as before the step for good if the step is discarded.
///
/// A position whose recorded generation differs from its block's current one is stale and reads as
/// missing, never as another request's routing. The slots, their claims (metadata, never read from
/// the rows) and the blocks' generations are slot_pool's, which this class derives from.
/// @tparam RowMemory host_written_rows, or device_written_rows when kernels write the pool
template <class Index, class RowMemory = host_written_rows>
class block_slot_store : public slot_pool<Index, RowMemory> {
  using pool = slot_pool<Index, RowMemory>;
  using typename pool::slot_ref;
  using typename pool::slot_state;
  using pool::block_shift_;
  using pool::block_size_;
  using pool::claim_slot;
  using pool::claimed;
  using pool::filed_through_;
  using pool::generation_;
  using pool::num_slots_;
  using pool::ref_to;
  using pool::row_at;
  using pool::row_elems_;
  using pool::slots_;
  using pool::valid_row;

 public:
  using pool::generation_of;

  /// @brief Whether rows live at KV slots (true: at slots).
  static constexpr bool slot_indexed = true;
  /// @brief reserve() also makes room in a request's position map, which growth_bytes() does not
  /// count: it runs for every request of a step.
  static constexpr bool reserve_only_grows = false;

  /// @brief Storage for rows of `row_elems` ids in the pool `config` describes.
  block_slot_store(const replay_config& config, std::int64_t row_elems)
    : pool(config, row_elems), positions_(ready_position_pages(config))
  {
    this->check_shape(config);
    if (config.max_model_len > position_pages<position_ref>::max_positions) {
      throw error{errc::invalid_config, "block_slot_storage maps at most " +
                                          std::to_string(position_pages<position_ref>::max_positions) +
                                          " positions a request (got max_model_len " +
                                          std::to_string(config.max_model_len) + ")"};
    }
    this->allocate(config);
  }

  /// @brief Pages of position metadata made when a store is built (replay_config::host_memory_ahead
  /// bytes of them; by default two full steps of new positions), so that new requests' first
  /// steps take pages already faulted in.
  [[nodiscard]] static std::size_t ready_position_pages(const replay_config& config) noexcept
  {
    constexpr std::int64_t per_page = position_pages<position_ref>::page_positions;
    if (config.host_memory_ahead >= 0) {
      return static_cast<std::size_t>(config.host_memory_ahead) / (sizeof(position_ref) * per_page);
    }
    return static_cast<std::size_t>(2 * ((std::max(config.max_tokens_per_step, 0) + per_page - 1) / per_page));
  }

  /// @brief Starts bookkeeping for request handle `h`.
  void open(std::uint32_t h) { positions_.open(h); }

  /// @brief Prefix-cache hit: positions [0, cached_slots.size()) of `h` are served from those
  /// slots as their blocks are now, except positions that already hold a row (one readers see, or
  /// one on its way from a step that has ended). A slot claimed by `open_step` (0: none) alone
  /// holds nothing yet: such a position follows the engine's cached slot too, so that a discard
  /// of that step cannot leave it at a slot a later step fills for another position (CORE-BUG-20).
  void bind_cached(std::uint32_t h, std::span<const std::int64_t> cached_slots, std::uint64_t open_step)
  {
    const auto n = static_cast<std::int64_t>(cached_slots.size());
    positions_.reserve(h, n);
    positions_.for_each(h, 0, n, [&](std::size_t p, position_ref& at) {
      if (!holds_row(at.now, open_step) && !pending(at)) { at = settled(ref_to(cached_slots[p])); }
    });
  }

  /// @brief Forgets `h`; its rows stay at their slots for later prefix hits.
  void close(std::uint32_t h) noexcept { positions_.close(h); }

  /// @brief Makes room to record positions [0, rows) of `h`, and asks the cache for the entry of
  /// position rows - 1 (the step's last: a decoding request's only one). Metadata only: returns
  /// false (nothing for undo_reserve() to take back).
  bool reserve(std::uint32_t h, std::int64_t rows, bool)
  {
    positions_.reserve(h, rows);
    // The planner reserves every run in a short pass before it claims them in a long one: a claim
    // reaches the entry through the page it is on, a cache miss per decoding request that the
    // claim's long body would leave unoverlapped. Asked for here, it is in the cache by then.
    if (rows > 0) { __builtin_prefetch(positions_.place_of(h, rows - 1), 1); }
    return false;
  }

  /// @brief Nothing to take back: reserve() only makes room in metadata.
  void undo_reserve(std::uint32_t) noexcept {}

  /// @brief Where the row of (`h`, `position`) at `slot`, planned when the slot's block had
  /// generation `planned`, should go (first write wins unless `replace`).
  ///
  /// A row already claimed at this slot in this generation stays, whoever claimed it (a request
  /// sharing the block through the prefix cache computed the same position of the same prefix).
  /// Otherwise, if the position has a row at another slot (recompute after preemption into new
  /// blocks), that first row follows it to its new slot. A block reallocated since the step was
  /// planned makes the row stale: it is dropped.
  ///
  /// `step` is the claiming step's serial: the new mapping, and the row, are readable once that
  /// step has been filed; until then readers see the position as it was
  /// (docs/design/copy_pipeline.md, 2.3).
  [[nodiscard]] row_claim<Index> claim(std::uint32_t h,
                                       std::int64_t position,
                                       std::int64_t slot,
                                       std::uint32_t planned,
                                       std::uint64_t step,
                                       bool replace)
  {
    return claim_at(positions_.entry(h, position), slot, planned, step, replace);
  }

  /// @brief claim() of positions [`first`, `first` + slots.size()) of `h`, in order, at `slots`,
  /// by the step being planned: each block's generation is read as its slot is claimed, so no
  /// block can have been reallocated since and the claims skip that check. Each row's slot goes to
  /// `slots_out[i]` (the step's record; slots were checked, so they fit).
  ///
  /// `place(i, claim, rows)` receives the rows that have a place (claim().dst non-null), gathered:
  /// rows i to i + rows - 1 go to consecutive rows from claim.dst (a prefill chunk's slots run
  /// through whole KV blocks); a row that copies or replaces another comes on its own (rows 1).
  /// One lookup of the request's positions for the run.
  template <class Place>
  [[gnu::always_inline]] void claim_run(std::uint32_t h,
                                        std::int64_t first,
                                        std::span<const std::int64_t> slots,
                                        std::int32_t* slots_out,
                                        std::uint64_t step,
                                        bool replace,
                                        Place&& place)
  {
    const auto count = static_cast<std::int64_t>(slots.size());
    row_ranges<Place> ranges{*this, place};
    if (first >= positions_.size(h)) {
      // positions no entry maps yet: every decode step and prefill chunk
      if (block_shift_ >= 0) {
        claim_new_positions(h, first, slots, slots_out, step, replace, ranges,
                            [shift = block_shift_](std::int64_t slot) { return static_cast<std::size_t>(slot) >> shift; });
      } else {
        claim_new_positions(h, first, slots, slots_out, step, replace, ranges,
                            [size = block_size_](std::int64_t slot) { return static_cast<std::size_t>(slot / size); });
      }
    } else {
      positions_.for_each(h, first, count, [&](std::size_t i, position_ref& at) {
        const std::int64_t slot     = slots[i];
        const std::uint32_t planned = generation_of(slot);
        slots_out[i]                = static_cast<std::int32_t>(slot);
        const row_claim<Index> c    = claim_at<false>(at, slot, planned, step, replace);
        if (c.copy_from != nullptr || c.replaced != row_claim<Index>::no_claim) {
          ranges.single(i, c);
        } else if (c.dst != nullptr) {
          ranges.add(i, slot);
        }
      });
    }
    ranges.flush();
  }

  /// @brief A discarded step `serial` gives back its claim of `slot`, which replaced the claim of
  /// step `prior` (row_claim::replaced): the row there is `prior`'s again.
  void restore_claim(std::uint32_t, std::int64_t, std::int64_t slot, std::uint64_t serial, std::uint64_t prior) noexcept
  {
    slot_state& state = slots_[static_cast<std::size_t>(slot)];
    if (state.claimed_by_step() == serial && state.claimed_in == generation_of(slot)) {
      state.claim = prior | (state.claim & slot_state::replaced_bit);
    }
  }

  /// @brief Undoes the claim of `slot` if step `serial` made it in its block's current generation
  /// (a discarded step).
  /// The position goes back to the mapping readers saw before the step, unless something mapped it
  /// since (a later step, or the handle's next request: handles are reused).
  void unclaim(std::uint32_t h, std::int64_t position, std::int64_t slot, std::uint64_t serial) noexcept
  {
    slot_state& state = slots_[static_cast<std::size_t>(slot)];
    if (state.claimed_by_step() == serial && state.claimed_in == generation_of(slot)) { state.claimed_in = 0u; }
    if (position >= positions_.size(h)) { return; }
    position_ref& at = positions_.at(h, position);
    if (at.mapped_by == serial && at.now.slot == slot) { at = settled(at.before); }
  }

  /// @brief Calls `emit(dst, elems)` for the `elems` ids at `host_dst`: kernels reach the pool at
  /// the host's addresses.
  template <class Emit>
  void device_pieces(std::uint32_t, Index* host_dst, std::int64_t elems, Emit&& emit) const
  {
    emit(host_dst, elems);
  }

  /// @brief The row that the claim of (`h`, `position`) by a step after `step` replaced was
  /// rejected (a tentative draft row that claim took over, at the same slot): until the claiming
  /// step is filed, the slot reads as missing.
  void forget_replaced_row(std::uint32_t h, std::int64_t position, std::uint64_t step) noexcept
  {
    if (position >= positions_.size(h)) { return; }
    const position_ref& at = positions_.at(h, position);
    if (!claimed(at.now)) { return; }
    slot_state& state = slots_[static_cast<std::size_t>(at.now.slot)];
    if (state.replaced_row() && state.claimed_by_step() > step) { state.claim = state.claimed_by_step(); }
  }

  /// @brief Forgets the row of (`h`, `position`) (a rejected draft) if it is still current.
  /// Metadata only, so it is safe while a kernel may still be writing that row.
  void erase(std::uint32_t h, std::int64_t position, std::int64_t slot)
  {
    if (position >= positions_.size(h)) { return; }  // never mapped
    position_ref& at = positions_.at(h, position);
    if (at.now.slot == slot && claimed(at.now)) { slots_[static_cast<std::size_t>(slot)].claimed_in = 0u; }
    at = position_ref{};
  }

  /// @brief Rows at slots are never contiguous per request.
  [[nodiscard]] const Index* contiguous(std::uint32_t, std::int64_t, std::int64_t) const noexcept
  {
    return nullptr;
  }

  /// @brief Copies rows [first, first + count) of `h` to `out`, the sentinel for missing ones; a
  /// run of positions at consecutive slots (a KV block) is one copy.
  void read_rows(std::uint32_t h, std::int64_t first, std::int64_t count, Index* out) const
  {
    for_each_run(
      h, first, count,
      [&](const Index* rows, std::int64_t n) noexcept {
        std::memcpy(out, rows, static_cast<std::size_t>(n * row_elems_) * sizeof(Index));
        out += n * row_elems_;
      },
      [&](std::int64_t n) noexcept { out = std::fill_n(out, n * row_elems_, index_traits<Index>::sentinel); });
  }

  /// @brief Hands rows [first, first + count) of `h` over where they lie, in position order:
  /// `rows(first_row, n)` for n valid rows at consecutive slots (a KV block), `missing(n)` for n
  /// positions without a valid row (never recorded, or stale). Copies nothing.
  /// @throws what the callables throw
  template <class Rows, class Missing>
  void for_each_run(std::uint32_t h, std::int64_t first, std::int64_t count, Rows&& rows, Missing&& missing) const
  {
    const std::int64_t mapped = positions_.size(h);
    const std::int64_t end    = first + count;
    std::int64_t gap          = 0;  // missing positions not handed over yet: one call for a run of them
    for (std::int64_t p = first; p < end;) {
      const slot_ref first_ref = p < mapped ? visible(positions_.at(h, p)) : slot_ref{};
      const Index* row         = valid_row(first_ref);
      if (row == nullptr) {
        ++gap;
        ++p;
        continue;
      }
      std::int64_t run = 1;  // extend while the next position is valid at the next slot
      while (p + run < end && p + run < mapped) {
        const slot_ref next = visible(positions_.at(h, p + run));
        if (next.slot != first_ref.slot + run || valid_row(next) == nullptr) { break; }
        ++run;
      }
      if (gap != 0) { missing(std::exchange(gap, 0)); }
      rows(row, run);
      p += run;
    }
    if (gap != 0) { missing(gap); }
  }

  /// @brief Copies the row of (`h`, `position`) to `out`; false if missing or stale.
  bool read(std::uint32_t h, std::int64_t position, Index* out) const
  {
    if (position >= positions_.size(h)) { return false; }
    const Index* row = valid_row(visible(positions_.at(h, position)));
    if (row == nullptr) { return false; }
    std::memcpy(out, row, static_cast<std::size_t>(row_elems_) * sizeof(Index));
    return true;
  }

 private:
  // Where a position's row is, and, while the step that mapped it there is not filed, where readers
  // still find it (rows are claimed when a step begins, but readers see filed steps only).
  struct position_ref {
    slot_ref now;                 // the slot its latest step claimed or deferred to
    slot_ref before;              // what readers see until step `mapped_by` is filed
    std::uint64_t mapped_by = 0;  // the step that mapped it to `now` (0: before any step)
  };

  // The words of position_ref{.now = {slot, generation}, .before = {}, .mapped_by = step}, in
  // memory order, for store_streaming().
  [[nodiscard]] static std::array<std::uint64_t, 3> new_mapping_words(std::int64_t slot,
                                                                      std::uint32_t generation,
                                                                      std::uint64_t step) noexcept
  {
    static_assert(std::endian::native == std::endian::little && sizeof(position_ref) == 24 &&
                  offsetof(position_ref, before) == 8 && offsetof(position_ref, mapped_by) == 16 &&
                  offsetof(slot_ref, generation) == 4);
    constexpr std::uint64_t nothing = std::uint32_t{0xffffffffu};  // slot_ref{}: slot -1, generation 0
    return {static_cast<std::uint32_t>(slot) | std::uint64_t{generation} << 32, nothing, step};
  }

  // A mapping no unfiled step changed.
  [[nodiscard]] static position_ref settled(slot_ref at) noexcept { return {at, slot_ref{}, 0}; }

  [[nodiscard]] bool pending(const position_ref& at) const noexcept { return at.mapped_by > filed_through_; }

  // Whether `at` holds a row, or one is on its way: claimed, and not by the open step `open_step`
  // alone (a claim that replaced a row of the same generation leaves that row readable).
  [[nodiscard]] bool holds_row(const slot_ref& at, std::uint64_t open_step) const noexcept
  {
    if (!claimed(at)) { return false; }
    const slot_state& state = slots_[static_cast<std::size_t>(at.slot)];
    return open_step == 0 || state.claimed_by_step() != open_step || state.replaced_row();
  }
  [[nodiscard]] slot_ref visible(const position_ref& at) const noexcept { return pending(at) ? at.before : at.now; }

  // claim() of the position whose mapping is `at`; a claim made as its step is planned knows its
  // block's generation is `planned` (ChecksGeneration false)
  template <bool ChecksGeneration = true>
  [[nodiscard, gnu::always_inline]] row_claim<Index> claim_at(position_ref& at,
                                                              std::int64_t slot,
                                                              std::uint32_t planned,
                                                              std::uint64_t step,
                                                              bool replace)
  {
    const slot_ref prior = at.now;
    // Readers keep the mapping they see now; where an earlier claim is itself still pending they
    // keep seeing what that one replaced (its rows are a copy of it, or the position's new routing
    // once filed: the later of the two steps is the one that decides).
    at = position_ref{.now = slot_ref{static_cast<std::int32_t>(slot), planned}, .before = visible(at), .mapped_by = step};
    if constexpr (ChecksGeneration) {
      if (generation_of(slot) != planned) { return {}; }
    }
    row_claim<Index> c = claim_slot(slot, planned, step, replace);
    if (c.dst != nullptr && !replace && prior.slot != slot && claimed(prior)) { c.copy_from = row_at(prior.slot); }
    return c;
  }

  // claim_run()'s gathering of claimed rows into ranges for `place` (claim_run() says how): a row
  // continues the range if it is the next row of the run at the next slot.
  template <class Place>
  struct row_ranges {
    const block_slot_store& store;
    Place& place;
    std::size_t first        = 0;   // the range's first row of the run,
    std::int64_t first_slot  = 0;   // its slot,
    std::size_t next         = 0;   // the row that would continue it,
    std::int64_t next_slot   = -1;  // at this slot (-1: no range)

    [[gnu::always_inline]] void add(std::size_t i, std::int64_t slot)
    {
      if (slot == next_slot && i == next) {
        ++next;
        ++next_slot;
        return;
      }
      flush();
      first      = i;
      first_slot = slot;
      next       = i + 1;
      next_slot  = slot + 1;
    }
    void single(std::size_t i, const row_claim<Index>& c)
    {
      flush();
      place(i, c, std::int64_t{1});
    }
    void flush()
    {
      if (next_slot < 0) { return; }
      place(first, row_claim<Index>{store.row_at(first_slot), nullptr, row_claim<Index>::no_claim},
            static_cast<std::int64_t>(next - first));
      next_slot = -1;
    }
  };

  // claim_run() of positions no entry of `h` maps yet, whose slots lie in blocks `block_of(slot)`:
  // each entry is written without being read, and no earlier row follows its position. A slot
  // nobody claimed in its block's current generation (a prefill chunk's and a decoding request's,
  // in their own blocks) takes the short way; one that is held goes through claim_slot().
  template <class Ranges, class BlockOf>
  [[gnu::always_inline]] void claim_new_positions(std::uint32_t h,
                                                  std::int64_t first,
                                                  std::span<const std::int64_t> slots,
                                                  std::int32_t* slots_out,
                                                  std::uint64_t step,
                                                  bool replace,
                                                  Ranges& ranges,
                                                  BlockOf block_of)
  {
    // The store's fields in locals: the loop's stores (ids of 32 and 64 bits) may alias the
    // integers among them as far as the compiler knows, and it reloaded them on every row.
    const std::uint32_t* const generation = generation_.data();
    slot_state* const states              = slots_.data();
    // A long run (a prefill chunk) writes its entries around the cache: nothing reads them before
    // the request is extracted, and written through it each would first be read from memory. A
    // short one (a decoding request's position) keeps its line in the cache, where the request's
    // next position goes.
    const bool streams = slots.size() >= streamed_run;
    positions_.for_each_new(h, first, static_cast<std::int64_t>(slots.size()), [&](std::size_t i, position_ref& at) {
      const std::int64_t slot     = slots[i];
      const std::uint32_t planned = generation[block_of(slot)];
      slots_out[i]                = static_cast<std::int32_t>(slot);
      if (streams) {
        store_streaming(at, new_mapping_words(slot, planned, step));
      } else {
        at = position_ref{.now = slot_ref{static_cast<std::int32_t>(slot), planned}, .before = slot_ref{}, .mapped_by = step};
      }
      slot_state& state = states[slot];
      if (state.claimed_in == planned) [[unlikely]] {  // held: a row claimed in this generation
        const row_claim<Index> c = claim_slot(slot, planned, step, replace);
        if (c.dst != nullptr) { ranges.single(i, c); }  // replaces it
        return;
      }
      state.claimed_in = planned;
      state.claim      = step;
      ranges.add(i, slot);
    });
    if (streams) { streaming_stores_done(); }
  }

  // Runs of at least this many new positions write their entries around the cache
  // (claim_new_positions()): 64 entries are 24 whole cache lines.
  static constexpr std::size_t streamed_run = 64;

  position_pages<position_ref> positions_;  // per request: where each position's row is
};

}  // namespace routing_replay::detail
