/// @file
/// Bodies of the library's kernels as functors of (block, thread), launched with
/// Backend::launch_async, so that one definition runs as a CUDA kernel and as loops on a host
/// stream. None uses shared memory or assumes blocks run together.
#pragma once

#include <routing_replay/buffer_layout.hpp>
#include <routing_replay/detail/macros.hpp>
#include <routing_replay/detail/scatter_op.hpp>
#include <routing_replay/detail/step_status.hpp>
#include <routing_replay/index_type.hpp>

#include <cuda/atomic>
#include <cuda/std/array>
#include <cuda/std/bit>
#include <cuda/std/cstdint>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace routing_replay::detail {

/// @brief 16 bytes moved by one load or store (a 128-bit access on the device when aligned).
struct alignas(16) word16 {
  std::uint64_t low;   ///< first 8 bytes
  std::uint64_t high;  ///< last 8 bytes
};

/// @brief Reports a word access at an address that is not a multiple of the word's alignment and
/// aborts: on a GPU the same access faults ("misaligned address", a sticky error that ends the
/// context), so a host run that gets here has found a shape the device cannot run.
[[noreturn]] inline void misaligned_word(const void* at, std::size_t alignment) noexcept
{
  std::fprintf(stderr, "routing_replay: a %zu-byte word accessed at %p, which is not %zu-byte aligned "
                       "(a CUDA kernel faults there with 'misaligned address')\n",
               alignment, at, alignment);
  std::abort();
}

/// @brief Aborts (misaligned_word()) unless `at` is aligned for a `Word`. On the host only: the
/// device faults by itself. One test and a branch never taken per word.
template <class Word>
ROUTING_REPLAY_HOST_DEVICE void require_word_aligned([[maybe_unused]] const void* at) noexcept
{
#if !defined(__CUDA_ARCH__)
  if (reinterpret_cast<std::uintptr_t>(at) % alignof(Word) != 0) [[unlikely]] { misaligned_word(at, alignof(Word)); }
#endif
}

/// @brief Loads a word. Plain on the device (one wide access); through memcpy on the host, where
/// reading ids as words would break strict aliasing, after checking the address as the device
/// would need it (require_word_aligned()).
template <class Word>
[[nodiscard]] ROUTING_REPLAY_HOST_DEVICE Word load_word(const Word* at) noexcept
{
#if defined(__CUDA_ARCH__)
  return *at;
#else
  require_word_aligned<Word>(at);
  Word w;
  std::memcpy(&w, at, sizeof(Word));
  return w;
#endif
}

/// @brief Stores a word (see load_word()).
template <class Word>
ROUTING_REPLAY_HOST_DEVICE void store_word(Word* at, const Word& w) noexcept
{
#if defined(__CUDA_ARCH__)
  *at = w;
#else
  require_word_aligned<Word>(at);
  std::memcpy(at, &w, sizeof(Word));
#endif
}

/// @brief The sentinel in every id of a word.
template <class Index, class Word>
[[nodiscard]] ROUTING_REPLAY_HOST_DEVICE Word sentinel_word() noexcept
{
  cuda::std::array<Index, sizeof(Word) / sizeof(Index)> ids{};
  for (auto& id : ids) { id = index_traits<Index>::sentinel; }
  return cuda::std::bit_cast<Word>(ids);
}

/// @brief Threads per block of the library's kernels.
inline constexpr std::int32_t kernel_block_threads = 256;

/// @brief Blocks that cover `items` items at kernel_block_threads threads each.
[[nodiscard]] ROUTING_REPLAY_HOST_DEVICE constexpr std::int32_t blocks_for(std::int64_t items) noexcept
{
  return static_cast<std::int32_t>((items + kernel_block_threads - 1) / kernel_block_threads);
}

/// @brief The item thread `thread` of block `block` handles in a kernel of kernel_block_threads
/// threads a block, one item a thread (callers check it against their item count).
template <class Int = std::int64_t>
[[nodiscard]] ROUTING_REPLAY_HOST_DEVICE constexpr Int item_of(std::int32_t block, std::int32_t thread) noexcept
{
  return static_cast<Int>(block) * kernel_block_threads + thread;
}

/// @brief capture(): copies the first K columns of a router's top-k output into one layer of D,
/// narrowing each id to Index once. One thread per (row, column), 32-bit index arithmetic.
///
/// Source rows may be wider than K (fused shared experts) and may hold physical ids, which a
/// device map turns into logical ones before the range check. An id outside [0, E) is stored as
/// the sentinel and reported.
template <class Index, class Layout, class Source>
struct capture_layer {
  buffer_mdspan<Index, Layout> buffer;      // D
  step_status* status;                      // where capture paths report
  const Source* source;                     // [rows, source_stride], row-major
  std::int64_t source_stride;               // elements between consecutive source rows
  const std::int32_t* physical_to_logical;  // nullptr: ids are already logical
  std::int64_t num_physical;                // entries of physical_to_logical
  std::int64_t num_experts;                 // E
  std::int32_t layer_slot;
  std::int32_t top_k;
  std::int32_t num_items;     // rows * K
  bool report_invalid = true; // false: an invalid id is only stored as the sentinel (capture_options)

  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int32_t block, std::int32_t thread) const noexcept
  {
    const auto i = item_of<std::int32_t>(block, thread);
    if (i >= num_items) { return; }
    const std::int32_t row    = i / top_k;
    const std::int32_t column = i - row * top_k;
    auto id = static_cast<std::int64_t>(source[static_cast<std::int64_t>(row) * source_stride + column]);
    if (physical_to_logical != nullptr) {  // an unmappable physical id becomes -1: invalid
      id = (id >= 0 && id < num_physical) ? physical_to_logical[id] : std::int64_t{-1};
    }
    if (index_traits<Index>::is_valid(id, num_experts)) {
      buffer(layer_slot, row, column) = static_cast<Index>(id);
    } else {
      buffer(layer_slot, row, column) = index_traits<Index>::sentinel;
      if (report_invalid) { status->invalid_id.report(id, layer_slot, row, column); }
    }
  }
};

/// @brief Whether the end-of-step check reports a (layer, row) of a merge's step still holding the
/// sentinel: yes, unless the merge says which layers must be written (`requires_layer(layer)`), as
/// slot_rows' does for the layers no capture path was ever handed.
template <class Merge>
[[nodiscard]] ROUTING_REPLAY_HOST_DEVICE bool merge_requires_layer(const Merge& merge, std::int32_t layer) noexcept
{
  if constexpr (requires { merge.requires_layer(layer); }) {
    return merge.requires_layer(layer);
  } else {
    return true;
  }
}

/// @brief The end-of-step kernel's default merge: D holds the step's rows as the capture paths
/// wrote them.
struct no_merge {
  /// @brief Rows the merge needs visited: none.
  [[nodiscard]] ROUTING_REPLAY_HOST_DEVICE std::int64_t rows() const noexcept { return 0; }
  /// @brief Nothing to merge.
  template <class Index>
  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int32_t, std::int32_t, bool, Index*, step_status*) const noexcept
  {
  }
};

/// @brief End of step, in one kernel on the compute stream: checks D rows [0, N) (a (layer, row)
/// holding the sentinel was never captured; a value outside [0, E) came through a view),
/// snapshots them token-major ([N, L, K], one contiguous row per token) for the copy, and resets
/// rows [0, reset_rows) to the sentinel so the next forward may write D at once.
///
/// One thread per (layer, row) "cell" of K ids, moved as `Word`s (16 bytes where a cell is a
/// multiple of 16 and D and the snapshot start on 16 bytes: every cell's address is then a multiple
/// of the word; capture_buffer::end_step() chooses). Threads are ordered (row group, layer, row in group): a warp reads whole
/// 32-byte sectors of a layer's rows and writes contiguous runs of a token's row, for either
/// layout, so D is read and written once at memory speed. Thread 0 also moves what capture paths
/// reported during the forward into the step's status.
///
/// `Merge` writes rows kept outside D into a cell before it is checked (the Python binding's staged
/// captures, which would otherwise take a kernel of their own a step): called by the cell's own
/// thread as merge(layer, row, row < N, cell, status) for every row below merge.rows(), which
/// reset_rows covers. Its problems go to the step's status, as record()'s would. A merge with a
/// `requires_layer(layer)` member decides which layers' unwritten cells are reported
/// (merge_requires_layer()).
template <class Index, class Layout, class Word, class Merge = no_merge>
struct harvest_rows {
  buffer_mdspan<Index, Layout> buffer;
  Index* snapshot;              // [num_rows, L, K]
  step_status* status;          // the step's status (zero before the kernel)
  step_status* capture_status;  // what capture paths reported; zeroed here
  std::int64_t num_experts;
  std::int32_t num_rows;        // N
  std::int32_t reset_rows;      // >= N: rows any capture path may have written
  std::int32_t rows_per_group;  // rows of one layer a warp reads together
  Merge merge{};                // rows merged into D first (no_merge: none)

  static constexpr std::int32_t ids_per_word = static_cast<std::int32_t>(sizeof(Word) / sizeof(Index));

  /// @brief Threads needed: one per (layer, row) of rows [0, reset_rows), padded to row groups.
  [[nodiscard]] ROUTING_REPLAY_HOST_DEVICE std::int64_t num_items() const noexcept
  {
    const std::int64_t groups = (reset_rows + rows_per_group - 1) / rows_per_group;
    return groups * buffer.extent(0) * rows_per_group;
  }

  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int32_t block, std::int32_t thread) const noexcept
  {
    const auto i = item_of(block, thread);
    if (i == 0) {
      // capture kernels of this step have finished (stream order); nothing else touches them now
      // absorbed, not assigned: a merge may already be reporting into the step's status
      status->invalid_id.absorb(capture_status->invalid_id);
      status->out_of_bounds.absorb(capture_status->out_of_bounds);
      capture_status->invalid_id    = problem_report{};
      capture_status->out_of_bounds = problem_report{};
    }
    if (i >= num_items()) { return; }
    const auto layers  = static_cast<std::int32_t>(buffer.extent(0));
    const auto top_k   = static_cast<std::int32_t>(buffer.extent(2));
    const auto in_row  = static_cast<std::int32_t>(i % rows_per_group);
    const auto layer   = static_cast<std::int32_t>((i / rows_per_group) % layers);
    const auto row     = static_cast<std::int32_t>(i / (static_cast<std::int64_t>(rows_per_group) * layers)) *
                       rows_per_group + in_row;
    if (row >= reset_rows) { return; }
    if (row < merge.rows()) { merge(layer, row, row < num_rows, &buffer(layer, row, 0), status); }
    Word* cell               = reinterpret_cast<Word*>(&buffer(layer, row, 0));
    const std::int32_t words = top_k / ids_per_word;
    if (row < num_rows) {
      Word* out      = reinterpret_cast<Word*>(snapshot + (static_cast<std::int64_t>(row) * layers + layer) * top_k);
      bool unwritten = false;
      for (std::int32_t w = 0; w < words; ++w) {
        const Word v = load_word(cell + w);
        store_word(out + w, v);
        const auto ids = cuda::std::bit_cast<cuda::std::array<Index, ids_per_word>>(v);
        for (std::int32_t e = 0; e < ids_per_word; ++e) {
          if (ids[e] == index_traits<Index>::sentinel) {
            unwritten = true;
          } else if (!index_traits<Index>::is_valid(static_cast<std::int64_t>(ids[e]), num_experts)) {
            status->out_of_range.report(static_cast<std::int64_t>(ids[e]), layer, row, w * ids_per_word + e);
          }
        }
      }
      // one report per (layer, row) keeps the count meaningful: unwritten rows
      if (unwritten && merge_requires_layer(merge, layer)) { status->unwritten.report(0, layer, row, 0); }
    }
    const Word reset = sentinel_word<Index, Word>();
    for (std::int32_t w = 0; w < words; ++w) { store_word(cell + w, reset); }
  }
};

/// @brief Device scatter, in one kernel on the copy stream: block b writes piece b of the step
/// straight to its place in mapped host storage (the step's rows from the snapshot, or an earlier
/// row that follows its position), or the sentinel instead when the step's status is not clean (the
/// step is discarded as a whole; rows it would have replaced stay). The last block to finish publishes the status to pinned memory
/// for the host and zeroes it for the slot's next step, so the step needs no other copy.
template <class Index>
struct scatter_rows {
  const scatter_op<Index>* ops;  // [num_ops], read where the host wrote them (pinned)
  const Index* snapshot;         // [N, L, K]
  step_status* status;           // the step's status, on the device
  step_status* published;        // ... where the host reads it (pinned)
  unsigned int* blocks_done;     // zero between launches
  std::int32_t num_ops;
  std::int32_t num_blocks;       // max(1, num_ops): a step without rows still publishes

  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int32_t block, std::int32_t thread) const noexcept
  {
    if (block >= num_ops) { return; }
    const scatter_op<Index> op = ops[block];  // one request per warp: every lane reads the same piece
    const Index* from          = op.copy_from != nullptr ? op.copy_from : snapshot + op.src;
    const bool clean           = status->clean();
    if (!clean && op.replaces) { return; }  // a discarded step leaves the rows it would have replaced
    const auto bytes           = static_cast<std::size_t>(op.elems) * sizeof(Index);
    const auto aligned         = reinterpret_cast<std::uintptr_t>(op.dst) | reinterpret_cast<std::uintptr_t>(from) | bytes;
    if (aligned % sizeof(word16) == 0) {
      const word16 reset = sentinel_word<Index, word16>();
      const auto* src    = reinterpret_cast<const word16*>(from);
      auto* dst          = reinterpret_cast<word16*>(op.dst);
      for (std::size_t w = static_cast<std::size_t>(thread); w < bytes / sizeof(word16); w += kernel_block_threads) {
        store_word(dst + w, clean ? load_word(src + w) : reset);
      }
    } else {
      for (std::int64_t e = thread; e < op.elems; e += kernel_block_threads) {
        op.dst[e] = clean ? from[e] : index_traits<Index>::sentinel;
      }
    }
  }

  /// @brief After each block: the last one publishes and zeroes the status.
  ROUTING_REPLAY_HOST_DEVICE void block_done(std::int32_t) const noexcept
  {
    cuda::atomic_thread_fence(cuda::std::memory_order_seq_cst, cuda::thread_scope_device);
    cuda::atomic_ref<unsigned int, cuda::thread_scope_device> done{*blocks_done};
    if (done.fetch_add(1u, cuda::std::memory_order_acq_rel) + 1u != static_cast<unsigned int>(num_blocks)) { return; }
    *published   = *status;  // every block has read it: it can be zeroed for the slot's next step
    *status      = step_status{};
    *blocks_done = 0u;
  }
};

}  // namespace routing_replay::detail
