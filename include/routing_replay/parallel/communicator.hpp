/// @file
/// Collectives for parallel engines: the `communicator` concept the parallel schemes are written
/// against, and how sequence parallelism splits a step's rows into per-rank shards. Plain C++20.
///
/// The library never creates a communicator: the engine hands in its own (an `ncclComm_t` through
/// nccl_communicator on CUDA, parallel/nccl_communicator.cuh; a thread_communicator for ranks that
/// run as threads of one process on the host backend, parallel/thread_communicator.hpp).
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>

namespace routing_replay {

/// @brief A communicator over `size()` ranks whose operations are enqueued on a stream of type
/// `Stream`, in the same order on every rank (NCCL's contract):
/// - `all_gather_async(send, recv, bytes, stream)`: rank r's `bytes` from `send` land at
///   `recv + r * bytes` on every rank;
/// - `send_async(data, bytes, peer, stream)` / `recv_async(data, bytes, peer, stream)`: one
///   message to or from `peer`, matched in order per pair of ranks.
///
/// Buffers are device memory of the backend; nothing is waited for on the host.
template <class C, class Stream>
concept communicator = requires(C& c, const C& cc, const void* src, void* dst, std::size_t bytes, int peer, Stream s) {
  { cc.rank() } -> std::convertible_to<int>;
  { cc.size() } -> std::convertible_to<int>;
  c.all_gather_async(src, dst, bytes, s);
  c.send_async(src, bytes, peer, s);
  c.recv_async(dst, bytes, peer, s);
};

/// @brief What a parallel_replay rank captures and where its rows go.
enum class parallel_scheme {
  /// Tensor parallel (and data or expert parallel): every rank captures every row of its step with
  /// every layer; only the output rank copies and files, the others only reset what they wrote.
  replicated,
  /// Sequence parallel: each rank captures its shard of the step's rows (sequence_shard); the
  /// shards are gathered once per step onto the output rank.
  sequence,
  /// Pipeline parallel: each rank (stage) captures its range of layers; the output rank receives
  /// the other stages' layer slabs once per step and files complete rows.
  pipeline,
};

/// @brief One rank's part of a sequence-parallel step.
///
/// The step's rows, padded as engines pad (to the rows the forward runs: the plan's padded rows
/// when declared, else N), are split into `size` shards of `shard_rows` = ceil(padded / size) rows.
/// Rank r's forward runs rows [r * shard_rows, (r + 1) * shard_rows) of the step; the first
/// `num_rows` of them are real rows (rows past N are padding). Gathered in rank order, the first N
/// rows of the shards are the step's rows in order.
struct sequence_shard {
  std::int64_t shard_rows = 0;  ///< rows every rank's forward runs (its local num_tokens)
  std::int64_t first_row  = 0;  ///< this rank's first row of the step
  std::int64_t num_rows   = 0;  ///< real rows of the step in this shard (may be 0)

  /// @brief The shard of `rank` of `size` for a step of `step_rows` real rows, of which the forward
  /// runs `padded_rows` (-1: not declared, the forward runs exactly the real rows).
  [[nodiscard]] static sequence_shard of(std::int64_t step_rows, std::int64_t padded_rows, int rank, int size) noexcept
  {
    const std::int64_t run   = std::max(step_rows, padded_rows);
    const std::int64_t shard = (run + size - 1) / size;
    const std::int64_t first = shard * rank;
    return {shard, first, std::clamp<std::int64_t>(step_rows - first, 0, shard)};
  }
};

}  // namespace routing_replay
