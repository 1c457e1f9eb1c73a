/// @file
/// The one-kernel end of step of slot_rows (slot_rows.hpp) for small steps: the end-of-step kernel
/// itself stores each row at its KV slot in the mapped host pool, so a step costs the host one
/// launch and one event record instead of two launches, two records and a stream wait. Functors of
/// (block, thread), as detail/kernels.hpp's.
#pragma once

#include <routing_replay/detail/kernels.hpp>
#include <routing_replay/detail/macros.hpp>
#include <routing_replay/detail/slot_rows/slot_rows_kernels.hpp>
#include <routing_replay/detail/step_status.hpp>
#include <routing_replay/index_type.hpp>

#include <cuda/atomic>
#include <cuda/std/cstdint>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace routing_replay::detail {

/// @brief The end-of-step kernel's merge (detail::harvest_rows) that stores the step: the thread of
/// cell (layer, row) writes the cell, as the capture paths left it in D, into the pool at the row's
/// KV slot, before the check; the thread of layer 0 also range-checks the slot. A slot outside the
/// pool is skipped (the step is refused). Whether the step is clean is known only once every cell
/// was checked: store_step_rows_kernel's last block then overwrites a refused step's rows with the
/// sentinel, so that the pool ends as the scatter (scatter_slot_rows) would have left it.
template <class Index, class Slot, class Word>
struct store_step_rows {
  const Slot* slots_in;     ///< the engine's [num_rows] KV slots of the step (device)
  Index* pool;              ///< [num_slots, L, K] (mapped pinned host memory)
  problem_report* bad_slot; ///< where a slot outside the pool is reported
  std::int64_t num_slots;   ///< slots in the pool
  std::int64_t row_elems;   ///< L * K
  std::int32_t num_rows;    ///< N
  std::int32_t top_k;       ///< K
  layer_mask required;      ///< layer slots whose cells must be written

  /// @brief Rows the end-of-step kernel visits for this merge: the step's.
  [[nodiscard]] ROUTING_REPLAY_HOST_DEVICE std::int64_t rows() const noexcept { return num_rows; }

  /// @brief Whether a sentinel in `layer` is an error.
  [[nodiscard]] ROUTING_REPLAY_HOST_DEVICE bool requires_layer(std::int32_t layer) const noexcept
  {
    return ((required[static_cast<std::size_t>(layer >> 6)] >> (layer & 63)) & 1u) != 0u;
  }

  /// @brief Stores cell (layer, row) at the row's slot; the layer-0 thread checks the slot.
  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int32_t layer,
                                             std::int32_t row,
                                             bool in_step,
                                             Index* cell,
                                             step_status*) const noexcept
  {
    if (!in_step) { return; }
    const auto slot = static_cast<std::int64_t>(slots_in[row]);
    if (slot < 0 || slot >= num_slots) {
      if (layer == 0) { bad_slot->report(slot, 0, row, 0); }
      return;
    }
    const auto* from         = reinterpret_cast<const Word*>(cell);
    auto* to                 = reinterpret_cast<Word*>(pool + slot * row_elems + static_cast<std::int64_t>(layer) * top_k);
    const std::int32_t words = static_cast<std::int32_t>(static_cast<std::size_t>(top_k) * sizeof(Index) / sizeof(Word));
    for (std::int32_t w = 0; w < words; ++w) { store_word(to + w, load_word(from + w)); }
  }
};

/// @brief The whole end of a small step in one kernel: `Harvest` (detail::harvest_rows with
/// store_step_rows as its merge) checks, snapshots and resets D and stores every cell at its slot;
/// the last block to finish overwrites the step's rows with the sentinel if the step is not clean
/// (an error path, one thread), then publishes the status to pinned memory and zeroes it, as
/// scatter_slot_rows does.
template <class Index, class Slot, class Word, class Harvest>
struct store_step_rows_kernel {
  Harvest harvest;               ///< the end-of-step kernel, storing through its merge
  slot_step_status* status;      ///< the step's status (device)
  slot_step_status* published;   ///< ... where the host reads it (pinned)
  unsigned int* blocks_done;     ///< zero between launches
  std::int32_t num_blocks;       ///< blocks of the launch

  /// @brief Cell work of item block * threads + thread.
  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int32_t block, std::int32_t thread) const noexcept
  {
    harvest(block, thread);
  }

  /// @brief After each block: the last one refuses an unclean step's rows and publishes the status.
  ROUTING_REPLAY_HOST_DEVICE void block_done(std::int32_t) const noexcept
  {
    cuda::atomic_thread_fence(cuda::std::memory_order_seq_cst, cuda::thread_scope_device);
    cuda::atomic_ref<unsigned int, cuda::thread_scope_device> done{*blocks_done};
    if (done.fetch_add(1u, cuda::std::memory_order_acq_rel) + 1u != static_cast<unsigned int>(num_blocks)) { return; }
    if (!status->clean()) { refuse_rows(); }
    *published   = *status;  // every block is done with it: zeroed for the next step in this place
    *status      = slot_step_status{};
    *blocks_done = 0u;
  }

 private:
  // the sentinel over every row of the step whose slot is in the pool (cells stored before the
  // check found the problem included)
  ROUTING_REPLAY_HOST_DEVICE void refuse_rows() const noexcept
  {
    const auto& store        = harvest.merge;
    const auto words_per_row = static_cast<std::int64_t>(static_cast<std::size_t>(store.row_elems) * sizeof(Index) / sizeof(Word));
    const Word reset         = sentinel_word<Index, Word>();
    for (std::int32_t row = 0; row < store.num_rows; ++row) {
      const auto slot = static_cast<std::int64_t>(store.slots_in[row]);
      if (slot < 0 || slot >= store.num_slots) { continue; }
      auto* to = reinterpret_cast<Word*>(store.pool + slot * store.row_elems);
      for (std::int64_t w = 0; w < words_per_row; ++w) { store_word(to + w, reset); }
    }
  }
};

/// @brief What launch_store_step() needs of a slot_rows and of the step's place in its ring.
template <class Index, class Slot>
struct store_step_args {
  const Slot* slots;              ///< the engine's [num_rows] KV slots (device)
  Index* pool;                    ///< [num_slots, L, K] (mapped pinned host memory)
  Index* snapshot;                ///< the place's [N_max, L, K] snapshot (device)
  slot_step_status* status;       ///< the place's status (device, zero)
  slot_step_status* published;    ///< ... where the host reads it (pinned)
  unsigned int* blocks_done;      ///< the place's block counter (zero)
  std::int64_t num_slots;         ///< slots in the pool
  std::int64_t row_elems;         ///< L * K
  std::int32_t num_rows;          ///< N
  std::int32_t top_k;             ///< K
  std::int32_t num_experts;       ///< E
  layer_mask required;            ///< layer slots whose cells must be written
};

/// @brief Ends a small step on `compute` with store_step_rows_kernel, through
/// capture_buffer::end_step_with() (which accounts for the rows to reset as its own end of step).
/// Cells move as the widest word that divides a cell (so a row too) and that D, the snapshot and the
/// pool all start on: every cell's address in each is then a whole number of words, where a word
/// access needs it (a GPU faults on a misaligned one); rows of one layer are grouped to fill 32-byte
/// sectors, as capture_buffer's own kernel does.
template <class Backend, class Layout, class Buffer, class Index, class Slot>
void launch_store_step(Buffer& buffer, const store_step_args<Index, Slot>& a, std::int64_t padded_rows,
                       typename Backend::stream_ref compute)
{
  const std::size_t cell_bytes = static_cast<std::size_t>(a.top_k) * sizeof(Index);
  const auto bases = reinterpret_cast<std::uintptr_t>(buffer.whole().data_handle()) |
                     reinterpret_cast<std::uintptr_t>(a.snapshot) | reinterpret_cast<std::uintptr_t>(a.pool);
  const auto fits    = [&](std::size_t word) { return (cell_bytes | bases) % word == 0; };
  const auto grouped = std::max<std::int32_t>(1, 32 / static_cast<std::int32_t>(cell_bytes));
  const auto launch  = [&](auto word) {
    using Word         = decltype(word);
    using store_type   = store_step_rows<Index, Slot, Word>;
    using harvest_type = harvest_rows<Index, Layout, Word, store_type>;
    const store_type store{a.slots, a.pool, &a.status->bad_slot, a.num_slots, a.row_elems, a.num_rows, a.top_k, a.required};
    buffer.end_step_with(a.num_rows, padded_rows, [&](auto whole, step_status* capture_status, std::int64_t reset_rows) {
      const harvest_type harvest{whole,          a.snapshot, &a.status->rows, capture_status, a.num_experts,
                                 a.num_rows,     static_cast<std::int32_t>(reset_rows), grouped, store};
      const auto blocks = std::max(1, blocks_for(harvest.num_items()));
      Backend::launch_async(blocks, kernel_block_threads,
                            store_step_rows_kernel<Index, Slot, Word, harvest_type>{harvest, a.status, a.published,
                                                                                    a.blocks_done, blocks},
                            compute);
    });
  };
  if (fits(sizeof(word16))) {
    launch(word16{});
  } else if (fits(sizeof(std::uint64_t))) {
    launch(std::uint64_t{});
  } else {
    launch(Index{});
  }
}

}  // namespace routing_replay::detail
