/// @file
/// Kernel bodies of slot_rows (slot_rows.hpp): the end-of-step merge that copies the step's KV slots
/// from the engine's device array, and the scatter that writes each row into the mapped host pool at
/// its slot. Functors of (block, thread), as detail/kernels.hpp's, so one definition runs as a CUDA
/// kernel and as loops on a host stream.
#pragma once

#include <routing_replay/detail/kernels.hpp>
#include <routing_replay/detail/macros.hpp>
#include <routing_replay/detail/step_status.hpp>
#include <routing_replay/index_type.hpp>

#include <cuda/atomic>
#include <cuda/std/array>
#include <cuda/std/cstdint>

#include <cstdint>

namespace routing_replay::detail {

/// @brief The most layers a slot_rows instance addresses: the layers that must be written travel
/// to the end-of-step kernel by value, as a bit set of this many bits.
inline constexpr std::int32_t max_slot_rows_layers = 1024;

/// @brief Words of the layer bit set.
inline constexpr std::int32_t layer_mask_words = max_slot_rows_layers / 64;

/// @brief A bit per layer slot: the layers the end-of-step check requires written.
using layer_mask = cuda::std::array<std::uint64_t, layer_mask_words>;

/// @brief What device code reports about one slot_rows step: the rows' problems (capture paths and
/// the end-of-step check) and the KV slots outside the pool.
struct slot_step_status {
  step_status rows;        ///< invalid ids, unwritten cells of required layers, out-of-bounds records
  problem_report bad_slot; ///< a row's KV slot outside [0, num_slots): value = the slot, row = the row

  /// @brief Whether the step's rows may be stored.
  [[nodiscard]] ROUTING_REPLAY_HOST_DEVICE bool clean() const noexcept
  {
    return rows.clean() && bad_slot.count == 0;
  }
};

/// @brief The end-of-step kernel's merge (detail::harvest_rows) for slot_rows. It copies the step's
/// KV slots out of the engine's array, which the engine may reuse as soon as the step ends, and
/// range-checks them (the thread of layer 0 of each row); and it tells the check which layers must
/// have been written: those a capture path was handed at some point, so that a layer no capture
/// ever wrote (a dense layer of a model whose every layer has a place) is not an error, while a
/// captured layer missing a row is.
template <class Slot>
struct copy_step_slots {
  const Slot* slots_in;         ///< the engine's [num_rows] KV slots of the step (device)
  std::int64_t* slots_out;      ///< the step's own copy (device)
  problem_report* bad_slot;     ///< where a slot outside the pool is reported
  std::int64_t num_slots;       ///< slots in the pool
  std::int32_t num_rows;        ///< N
  layer_mask required;          ///< layer slots whose cells must be written

  /// @brief Rows the end-of-step kernel visits for this merge: the step's.
  [[nodiscard]] ROUTING_REPLAY_HOST_DEVICE std::int64_t rows() const noexcept { return num_rows; }

  /// @brief Whether a sentinel in `layer` is an error.
  [[nodiscard]] ROUTING_REPLAY_HOST_DEVICE bool requires_layer(std::int32_t layer) const noexcept
  {
    return ((required[static_cast<std::size_t>(layer >> 6)] >> (layer & 63)) & 1u) != 0u;
  }

  /// @brief Copies and checks the slot of `row` (its layer-0 thread); cells are left as they are.
  template <class Index>
  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int32_t layer,
                                             std::int32_t row,
                                             bool in_step,
                                             Index*,
                                             step_status*) const noexcept
  {
    if (layer != 0 || !in_step) { return; }
    const auto slot = static_cast<std::int64_t>(slots_in[row]);
    slots_out[row]  = slot;
    if (slot < 0 || slot >= num_slots) { bad_slot->report(slot, 0, row, 0); }
  }
};

/// @brief The scatter of slot_rows, in one kernel: thread (row, word) copies one `Word` of the
/// step's token-major snapshot row into the mapped host pool at the row's KV slot, or the sentinel
/// when the step's status is not clean (a step with a problem is refused as a whole, so none of its
/// rows can pass for routing). Rows whose slot lies outside the pool are skipped (the step is
/// refused anyway). The last block to finish publishes the status to pinned memory and zeroes it,
/// so the step needs no other copy.
template <class Index, class Word>
struct scatter_slot_rows {
  const Index* snapshot;         ///< [N, L, K] (device)
  const std::int64_t* slots;     ///< [N] (device)
  Index* pool;                   ///< [num_slots, L, K] (mapped pinned host memory)
  slot_step_status* status;      ///< the step's status (device)
  slot_step_status* published;   ///< ... where the host reads it (pinned)
  unsigned int* blocks_done;     ///< zero between launches
  std::int64_t num_slots;        ///< slots in the pool
  std::int32_t num_rows;         ///< N
  std::int32_t words_per_row;    ///< L * K * sizeof(Index) / sizeof(Word)
  std::int32_t num_blocks;       ///< blocks of the launch (at least one: a step without rows publishes)

  /// @brief Copies word (row, w) of item block * threads + thread, if it is one.
  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int32_t block, std::int32_t thread) const noexcept
  {
    const auto i = item_of(block, thread);
    if (i >= static_cast<std::int64_t>(num_rows) * words_per_row) { return; }
    const auto row  = static_cast<std::int32_t>(i / words_per_row);
    const auto word = static_cast<std::int32_t>(i - static_cast<std::int64_t>(row) * words_per_row);
    const std::int64_t slot = slots[row];
    if (slot < 0 || slot >= num_slots) { return; }
    const auto* from = reinterpret_cast<const Word*>(snapshot) + static_cast<std::int64_t>(row) * words_per_row;
    auto* to         = reinterpret_cast<Word*>(pool) + slot * words_per_row;
    store_word(to + word, status->clean() ? load_word(from + word) : sentinel_word<Index, Word>());
  }

  /// @brief After each block: the last one publishes and zeroes the status.
  ROUTING_REPLAY_HOST_DEVICE void block_done(std::int32_t) const noexcept
  {
    cuda::atomic_thread_fence(cuda::std::memory_order_seq_cst, cuda::thread_scope_device);
    cuda::atomic_ref<unsigned int, cuda::thread_scope_device> done{*blocks_done};
    if (done.fetch_add(1u, cuda::std::memory_order_acq_rel) + 1u != static_cast<unsigned int>(num_blocks)) { return; }
    *published   = *status;  // every block has read it: zeroed for the next step in this place
    *status      = slot_step_status{};
    *blocks_done = 0u;
  }
};

}  // namespace routing_replay::detail
