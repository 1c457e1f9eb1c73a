/// @file
/// The slot half of block-slot indexed host storage: one [num_blocks * block_size, L, K] array of
/// rows indexed by KV slot, each slot's claim (the step and the block generation it was claimed
/// in), each block's generation, and the checks of slots and blocks a plan names.
/// block_slot_store (block_slot_store.hpp) derives from it and adds, per request, which slot holds
/// each position.
#pragma once

#include <routing_replay/config.hpp>
#include <routing_replay/detail/row_claim.hpp>
#include <routing_replay/detail/host_storage/row_memory.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/index_type.hpp>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace routing_replay::detail {

/// @brief The rows of a KV pool at their slots, and what each slot and block knows of them.
///
/// A block's generation grows whenever the engine declares it freshly allocated; a slot claimed in
/// an earlier generation is stale and reads as missing, never as another request's routing.
///
/// Which slot holds a row is metadata (the generation it was claimed in), never inferred from the
/// row's contents: claims can then be decided before the rows arrive (device scatter decides them
/// when a step begins, while earlier steps' rows are still on their way), and the host never writes
/// pool memory a kernel may be writing. Reads also require a non-sentinel row, so rows a failed
/// step replaced with the sentinel read as missing.
///
/// The pool is sized and allocated by block_slot_store's constructor (check_shape(), then
/// allocate()), which checks its own limits between the two.
/// @tparam RowMemory host_written_rows, or device_written_rows when kernels write the pool
template <class Index, class RowMemory = host_written_rows>
class slot_pool {
  using Rows = typename RowMemory::template vector<Index>;

 public:
  /// @brief A pool of `config.num_blocks` blocks of `config.block_size` rows of `row_elems` ids,
  /// not allocated yet (allocate()).
  slot_pool(const replay_config& config, std::int64_t row_elems)
    : row_elems_(row_elems),
      block_size_(config.block_size),
      block_shift_(config.block_size > 0 && std::has_single_bit(static_cast<std::uint64_t>(config.block_size))
                     ? std::countr_zero(static_cast<std::uint64_t>(config.block_size))
                     : -1),
      num_slots_(config.num_blocks * config.block_size),
      limit_(config.host_memory_limit)
  {
  }

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

  /// @brief Every step up to `serial` has been filed: rows they claimed have arrived. Rows of later
  /// steps (the open one, or one still in flight) read as missing until then.
  void set_filed_through(std::uint64_t serial) noexcept { filed_through_ = serial; }

 protected:
  // Throws invalid_config unless the pool's shape is valid: blocks of at least one slot, at least
  // one block, at most 2^31 - 1 slots.
  void check_shape(const replay_config& config) const
  {
    if (config.block_size <= 0 || config.num_blocks <= 0) {
      throw error{errc::invalid_config,
                  "block_slot_storage needs block_size > 0 and num_blocks > 0 (got block_size " +
                    std::to_string(config.block_size) + ", num_blocks " +
                    std::to_string(config.num_blocks) + ")"};
    }
    if (num_slots_ > std::numeric_limits<std::int32_t>::max()) {
      throw error{errc::invalid_config, "block_slot_storage holds at most 2^31 - 1 slots (got " +
                                          std::to_string(num_slots_) + ")"};
    }
  }

  // Allocates the pool, every row the sentinel, every block in its first generation.
  // @throws error host_memory_exhausted if the pool would cross host_memory_limit
  void allocate(const replay_config& config)
  {
    const std::size_t bytes = static_cast<std::size_t>(num_slots_ * row_elems_) * sizeof(Index);
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

  [[nodiscard]] slot_ref ref_to(std::int64_t slot) const noexcept
  {
    return {static_cast<std::int32_t>(slot), generation_of(slot)};
  }

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
};

}  // namespace routing_replay::detail
