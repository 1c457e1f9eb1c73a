/// @file
/// Block-slot indexed host storage: rows live at KV-cache slots, so prefix-cache hits and
/// preemption keep them, and a per-block generation detects rows made stale by block reuse.
#pragma once

#include <routing_replay/config.hpp>
#include <routing_replay/detail/position_pages.hpp>
#include <routing_replay/detail/row_claim.hpp>
#include <routing_replay/detail/row_memory.hpp>
#include <routing_replay/detail/streaming_store.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/index_type.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <limits>
#include <memory>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace routing_replay::detail {

/// @brief One [num_blocks * block_size, L, K] array indexed by KV slot, plus, per request, which
/// slot (and which generation of its block) holds each position.
///
/// A step maps the positions it computes when it begins (its claims), but readers keep seeing the
/// mapping it replaced until that step is filed: a position recomputed into new blocks, or into a
/// slot another request already filled, reads as before the step until the step's rows are in,
/// and as before the step for good if the step is discarded.
///
/// A block's generation grows whenever the engine declares it freshly allocated; a position whose
/// recorded generation differs from its block's current one is stale and reads as missing, never as
/// another request's routing.
///
/// Which slot holds a row is metadata (the generation it was claimed in), never inferred from the
/// row's contents: claims can then be decided before the rows arrive (device scatter decides them
/// when a step begins, while earlier steps' rows are still on their way), and the host never writes
/// pool memory a kernel may be writing. Reads also require a non-sentinel row, so rows a failed
/// step replaced with the sentinel read as missing.
/// @tparam RowMemory host_written_rows, or device_written_rows when kernels write the pool
template <class Index, class RowMemory = host_written_rows>
class block_slot_store {
  using Rows = typename RowMemory::template vector<Index>;

 public:
  /// @brief Whether rows live at KV slots (true: at slots).
  static constexpr bool slot_indexed = true;
  /// @brief reserve() also makes room in a request's position map, which growth_bytes() does not
  /// count: it runs for every request of a step.
  static constexpr bool reserve_only_grows = false;

  block_slot_store(const replay_config& config, std::int64_t row_elems)
    : row_elems_(row_elems),
      block_size_(config.block_size),
      block_shift_(config.block_size > 0 && std::has_single_bit(static_cast<std::uint64_t>(config.block_size))
                     ? std::countr_zero(static_cast<std::uint64_t>(config.block_size))
                     : -1),
      num_slots_(config.num_blocks * config.block_size),
      limit_(config.host_memory_limit),
      positions_(ready_position_pages(config))
  {
    if (config.block_size <= 0 || config.num_blocks <= 0) {
      throw error{errc::invalid_config,
                  "block_slot_storage needs block_size > 0 and num_blocks > 0 (got block_size " +
                    std::to_string(config.block_size) + ", num_blocks " +
                    std::to_string(config.num_blocks) + ")"};
    }
    const std::size_t bytes = static_cast<std::size_t>(num_slots_ * row_elems_) * sizeof(Index);
    if (num_slots_ > std::numeric_limits<std::int32_t>::max()) {
      throw error{errc::invalid_config, "block_slot_storage holds at most 2^31 - 1 slots (got " +
                                          std::to_string(num_slots_) + ")"};
    }
    if (config.max_model_len > position_pages<position_ref>::max_positions) {
      throw error{errc::invalid_config, "block_slot_storage maps at most " +
                                          std::to_string(position_pages<position_ref>::max_positions) +
                                          " positions a request (got max_model_len " +
                                          std::to_string(config.max_model_len) + ")"};
    }
    if (bytes > limit_) {
      throw error{errc::host_memory_exhausted,
                  "block_slot_storage for " + std::to_string(num_slots_) + " slots needs " +
                    std::to_string(bytes) + " bytes, over host_memory_limit " +
                    std::to_string(limit_)};
    }
    rows_.assign(static_cast<std::size_t>(num_slots_ * row_elems_), index_traits<Index>::sentinel);
    base_ = std::to_address(rows_.data());
    generation_.assign(static_cast<std::size_t>(config.num_blocks), 1u);  // 0 means "never"
    slots_.assign(static_cast<std::size_t>(num_slots_), slot_state{});
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

  /// @brief Throws slot_out_of_range unless every slot lies in the pool.
  void check_slot_range(std::span<const std::int64_t> slots) const
  {
    for (const std::int64_t slot : slots) {
      if (slot < 0 || slot >= num_slots_) {
        throw error{errc::slot_out_of_range,
                    "slot " + std::to_string(slot) + " is outside the pool [0, " +
                      std::to_string(num_slots_) + ")"};
      }
    }
  }

  /// @brief Prefix-cache hit: positions [0, cached_slots.size()) of `h` are served from those
  /// slots as their blocks are now, except positions that already hold a valid row.
  void bind_cached(std::uint32_t h, std::span<const std::int64_t> cached_slots)
  {
    const auto n = static_cast<std::int64_t>(cached_slots.size());
    positions_.reserve(h, n);
    positions_.for_each(h, 0, n, [&](std::size_t p, position_ref& at) {
      if (!claimed(at.now) && !pending(at)) { at = settled(ref_to(cached_slots[p])); }
    });
  }

  /// @brief Forgets `h`; its rows stay at their slots for later prefix hits.
  void close(std::uint32_t h) noexcept { positions_.close(h); }

  /// @brief Validates the slots of a scheduled request: one per token, inside the pool, and no slot
  /// twice in one step.
  void check_slots(std::span<const std::int64_t> slots, std::int32_t num_tokens)
  {
    if (slots.size() != static_cast<std::size_t>(num_tokens)) {
      throw error{errc::slot_out_of_range,
                  "block_slot_storage needs one slot per token: got " +
                    std::to_string(slots.size()) + " slots for " + std::to_string(num_tokens) +
                    " tokens"};
    }
    // one pass (a prefill chunk brings thousands), the fields it reads in locals: the stamps it
    // writes are 32-bit integers, as the compiler sees it possibly attempt_ itself
    const auto num_slots         = static_cast<std::uint64_t>(num_slots_);
    const std::uint32_t attempt  = attempt_;
    slot_state* const states     = slots_.data();
    for (const std::int64_t slot : slots) {
      if (static_cast<std::uint64_t>(slot) >= num_slots) [[unlikely]] { check_slot_range(slots); }  // negative too
      slot_state& state = states[slot];
      if (state.stamp == attempt) [[unlikely]] {
        throw error{errc::slot_out_of_range, "slot " + std::to_string(slot) + " is used twice in one step"};
      }
      state.stamp = attempt;
    }
  }

  /// @brief Asks the cache for what checking and claiming `slots` will touch first (the first
  /// slot's state and its block's generation), a few requests before the planner gets to them: in a
  /// decoding batch each request's slot lies in its own KV block, so these are cache and TLB misses,
  /// and a request's checks are too long for the processor to start the next request's on its own.
  /// The request's handle `h` (any value) is not needed: its position map is reached through them.
  [[gnu::always_inline]] void prefetch(std::uint32_t /*h*/, std::span<const std::int64_t> slots) const noexcept
  {
    if (slots.empty() || slots.front() < 0 || slots.front() >= num_slots_) { return; }  // checked later
    __builtin_prefetch(&slots_[static_cast<std::size_t>(slots.front())], 1);
    __builtin_prefetch(&generation_[block_of(slots.front())], 0);
  }

  /// @brief Starts a validation pass of a step plan (for duplicate-slot detection).
  void begin_validation()
  {
    if (++attempt_ == 0) {  // wrapped: old stamps could collide with new passes
      for (auto& state : slots_) { state.stamp = 0u; }
      attempt_ = 1;
    }
  }

  /// @brief Throws slot_out_of_range unless every block lies in the pool; `what` names the use
  /// ("fresh", "export_blocks:", ...) in the message.
  void check_blocks(std::span<const std::int64_t> blocks, const char* what) const
  {
    for (const std::int64_t b : blocks) {
      if (b < 0 || b >= static_cast<std::int64_t>(generation_.size())) {
        throw error{errc::slot_out_of_range,
                    std::string{what} + " block " + std::to_string(b) + " is outside the pool [0, " +
                      std::to_string(generation_.size()) + ")"};
      }
    }
  }

  /// @brief Nothing to wait for: the row pool is allocated when the store is built.
  void wait_until_ahead() const noexcept {}

  /// @brief Metadata only: the row pool is allocated up front and counted at construction.
  [[nodiscard]] std::size_t growth_bytes(std::uint32_t, std::int64_t, bool) const noexcept
  {
    return 0;
  }
  /// @brief Bytes allocated for rows (the whole pool).
  [[nodiscard]] std::size_t bytes_in_use() const noexcept { return rows_.size() * sizeof(Index); }
  /// @brief The current generation of the block holding `slot` (rows claimed for it are planned
  /// with it, and dropped if the block is reallocated before they arrive).
  [[nodiscard]] std::uint32_t generation_of(std::int64_t slot) const noexcept
  {
    return generation_[block_of(slot)];
  }
  /// @brief The host memory limit.
  [[nodiscard]] std::size_t limit() const noexcept { return limit_; }

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

  /// @brief A new KV allocation of these blocks: their old rows become stale for everyone.
  /// Metadata only: a new generation makes every earlier claim on the blocks stale.
  void refresh_blocks(std::span<const std::int64_t> blocks)
  {
    for (const std::int64_t b : blocks) { ++generation_[static_cast<std::size_t>(b)]; }
  }

  /// @brief Copies the rows of whole blocks, block after block, to `out`
  /// ([blocks.size() * block_size, L, K]; rows never recorded hold the sentinel).
  void export_blocks(std::span<const std::int64_t> blocks, Index* out) const
  {
    for (const std::int64_t b : blocks) {
      for (std::int64_t slot = b * block_size_; slot < (b + 1) * block_size_; ++slot, out += row_elems_) {
        if (const Index* row = valid_row(ref_to(slot))) {
          std::copy_n(row, row_elems_, out);
        } else {
          std::fill_n(out, row_elems_, index_traits<Index>::sentinel);
        }
      }
    }
  }

  /// @brief Fills whole blocks from rows laid out as export_blocks() writes them. Each block becomes
  /// fresh first: mappings to its previous content go stale, and a request served from it later
  /// binds to it through a prefix hit.
  void import_blocks(std::span<const std::int64_t> blocks, const Index* rows)
  {
    refresh_blocks(blocks);
    for (const std::int64_t b : blocks) {
      for (std::int64_t slot = b * block_size_; slot < (b + 1) * block_size_; ++slot, rows += row_elems_) {
        std::copy_n(rows, row_elems_, row_at(slot));
        slot_state& state     = slots_[static_cast<std::size_t>(slot)];
        state.claimed_in      = rows[0] != index_traits<Index>::sentinel ? generation_of(slot) : 0u;
        state.claim           = 0u;  // already here
      }
    }
  }

  /// @brief Ids per block (block_size * L * K).
  [[nodiscard]] std::int64_t block_elems() const noexcept { return block_size_ * row_elems_; }
  /// @brief Blocks in the pool.
  [[nodiscard]] std::int64_t num_blocks() const noexcept
  {
    return static_cast<std::int64_t>(generation_.size());
  }

  /// @brief Where the row of (`h`, `position`) at `slot`, planned when the slot's block had
  /// generation `planned`, should go (first write wins unless `replace`).
  ///
  /// A row already claimed at this slot in this generation stays, whoever claimed it (a request
  /// sharing the block through the prefix cache computed the same position of the same prefix).
  /// Otherwise, if the position has a row at another slot (recompute after preemption into new
  /// blocks), that first row follows it to its new slot. A block reallocated since the step was
  /// planned makes the row stale: it is dropped.
  ///
  /// `step` is the claiming step's serial: the new mapping, and the row, are readable once that step
  /// has been filed; until then readers see the position as it was (design.md 2.3).
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

  /// @brief Every step up to `serial` has been filed: rows they claimed have arrived. Rows of later
  /// steps (the open one, or one still in flight) read as missing until then.
  void set_filed_through(std::uint64_t serial) noexcept { filed_through_ = serial; }

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
    const std::int64_t mapped = positions_.size(h);
    const std::int64_t end    = first + count;
    std::int64_t p        = first;
    while (p < end) {
      const slot_ref first_ref = p < mapped ? visible(positions_.at(h, p)) : slot_ref{};
      const Index* row         = valid_row(first_ref);
      if (row == nullptr) {
        std::fill_n(out, row_elems_, index_traits<Index>::sentinel);
        out += row_elems_;
        ++p;
        continue;
      }
      std::int64_t run = 1;  // extend while the next position is valid at the next slot
      while (p + run < end && p + run < mapped) {
        const slot_ref next = visible(positions_.at(h, p + run));
        if (next.slot != first_ref.slot + run || valid_row(next) == nullptr) { break; }
        ++run;
      }
      std::memcpy(out, row, static_cast<std::size_t>(run * row_elems_) * sizeof(Index));
      out += run * row_elems_;
      p += run;
    }
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
  // What a step checks and claims of a slot, in one entry: three arrays of the pool's size cost a
  // step three cache and TLB misses a row where the slots of a step lie far apart (a decoding
  // batch: one slot per request, each in its own KV block).
  struct slot_state {
    // The step that claimed its row (0: imported, or none), below replaced_bit; replaced_bit: the
    // claim replaced a row claimed in the same generation (overwrite_recomputed_rows), which
    // readers see until the claiming step is filed. One word: a claim writes both in one store,
    // and the stamp beside it is a whole word, compared and written as one (as a 31-bit field, a
    // mask and a read-modify-write on every row a step checks).
    std::uint64_t claim      = 0;
    std::uint32_t claimed_in = 0;  // the block generation its row was claimed in (0: none)
    std::uint32_t stamp      = 0;  // the validation pass that last saw it in a plan

    // step serials stay far below it (2^63)
    static constexpr std::uint64_t replaced_bit = std::uint64_t{1} << 63;
    [[nodiscard]] std::uint64_t claimed_by_step() const noexcept { return claim & ~replaced_bit; }
    [[nodiscard]] bool replaced_row() const noexcept { return (claim & replaced_bit) != 0; }
  };

  struct slot_ref {
    std::int32_t slot        = -1;  // the pool holds at most 2^31 - 1 slots (checked when built)
    std::uint32_t generation = 0;
  };

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

  [[nodiscard]] slot_ref ref_to(std::int64_t slot) const noexcept
  {
    return {static_cast<std::int32_t>(slot), generation_of(slot)};
  }

  [[nodiscard]] bool pending(const position_ref& at) const noexcept { return at.mapped_by > filed_through_; }
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

  // The slot's half of a claim in its block's generation `planned` (current) by step `step`: where
  // the row goes, or nowhere if a row claimed in this generation stays (`replace` false).
  [[nodiscard, gnu::always_inline]] row_claim<Index> claim_slot(std::int64_t slot,
                                                                std::uint32_t planned,
                                                                std::uint64_t step,
                                                                bool replace) noexcept
  {
    slot_state& state = slots_[static_cast<std::size_t>(slot)];
    const bool held   = state.claimed_in == planned;
    if (!replace && held) { return {}; }
    const std::uint64_t replaced = held ? state.claimed_by_step() : row_claim<Index>::no_claim;
    state.claimed_in             = planned;
    state.claim                  = held ? step | slot_state::replaced_bit : step;
    return {row_at(slot), nullptr, replaced};
  }

  [[nodiscard]] std::size_t block_of(std::int64_t slot) const noexcept
  {
    // a shift where the block size is a power of two (as engines' are): a step looks up a block
    // for every row it plans and claims, and a 64-bit division takes tens of cycles
    return block_shift_ >= 0 ? static_cast<std::size_t>(slot) >> block_shift_ : static_cast<std::size_t>(slot / block_size_);
  }

  [[nodiscard]] Index* row_at(std::int64_t slot) const noexcept { return base_ + slot * row_elems_; }

  /// @brief Whether a reference still owns its slot: the block was not reused since, and the slot
  /// was claimed in that generation (the row may still be on its way).
  [[nodiscard]] bool claimed(const slot_ref& at) const noexcept
  {
    return at.slot >= 0 && generation_of(at.slot) == at.generation &&
           slots_[static_cast<std::size_t>(at.slot)].claimed_in == at.generation;
  }

  /// @brief Whether readers see a routing row at a claimed slot: its claiming step has been filed,
  /// or that step is still unfiled but replaced a row of the same generation, which is still there.
  /// Readers file every ended step first (host_side::rows_read_through), so an unfiled claim is the
  /// open step's: nothing has written its rows yet (CORE-BUG-15).
  [[nodiscard]] bool landed(std::int64_t slot) const noexcept
  {
    const slot_state& state = slots_[static_cast<std::size_t>(slot)];
    return state.claimed_by_step() <= filed_through_ || state.replaced_row();
  }

  /// @brief The row a reference points to if it is claimed, readers may see it (landed()) and it
  /// holds routing.
  [[nodiscard]] const Index* valid_row(const slot_ref& at) const noexcept
  {
    if (!claimed(at) || !landed(at.slot)) { return nullptr; }
    const Index* row = row_at(at.slot);
    return row[0] == index_traits<Index>::sentinel ? nullptr : row;
  }

  std::int64_t row_elems_;
  std::int64_t block_size_;
  int block_shift_;  // log2(block_size_) where it is a power of two, else -1
  std::int64_t num_slots_;
  std::size_t limit_;
  Rows rows_;
  Index* base_ = nullptr;
  std::vector<std::uint32_t> generation_;
  std::uint64_t filed_through_ = 0;             // every step up to this serial has been filed
  std::vector<slot_state> slots_;  // per slot
  std::uint32_t attempt_ = 0;
  position_pages<position_ref> positions_;  // per request: where each position's row is
};

}  // namespace routing_replay::detail
