/// @file
/// Construction-time configuration of a RoutingReplay.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace routing_replay {

/// @brief Everything a RoutingReplay needs to size its buffers and validate its input.
///
/// Terms follow DESIGN.md: L captured MoE layers, K top-k, E routed experts, N_max the engine's
/// max batched tokens per step.
struct replay_config {
  /// @brief E: routed experts per MoE layer; valid logical ids are [0, E).
  std::int32_t num_experts = 0;
  /// @brief K: experts chosen per token and layer (columns captured per row).
  std::int32_t top_k = 0;
  /// @brief Extra columns after the first K in the router output (fused shared experts); skipped.
  std::int32_t num_fused_shared_experts = 0;
  /// @brief N_max: the most tokens one engine step may schedule.
  std::int32_t max_tokens_per_step = 0;
  /// @brief Positions must lie in [0, max_model_len); also the cap of per-request growth.
  std::int64_t max_model_len = 0;
  /// @brief Model layers in the model (dense and MoE); 0 means one past the largest MoE layer.
  std::int32_t num_model_layers = 0;
  /// @brief The layer map: the model layer index of each captured MoE layer, in capture order.
  /// Captured layer i is model layer moe_layers[i]; every other model layer (dense, draft/MTP) is
  /// not captured, and capturing it is an error.
  std::vector<std::int32_t> moe_layers;
  /// @brief Block-slot storage only: tokens per KV block.
  std::int32_t block_size = 0;
  /// @brief Block-slot storage only: KV blocks in the pool (slots = num_blocks * block_size).
  std::int64_t num_blocks = 0;
  /// @brief Cap on host bytes of stored rows; storing past it is an error, never a silent drop.
  std::size_t host_memory_limit = std::numeric_limits<std::size_t>::max();
  /// @brief Per-request storage: bytes of host row memory a background thread keeps mapped,
  /// faulted in and (device scatter) registered ahead of need, so that a step of new requests takes
  /// memory that is ready instead of mapping fresh pages on the engine's thread (a prefill step of
  /// 8192 new rows spent 2.5 to 3.3 ms of begin_step() there on the H200). -1, the default: two full
  /// steps' rows, 2 * max_tokens_per_step * L * K * sizeof(index), rounded up to the store's
  /// superblocks (a step of new requests takes one step's worth while the thread still makes the
  /// last one's again); 0: no thread, memory is mapped on demand. host_memory_growth() says whether
  /// a step had to map memory itself. What is kept ahead is not counted as in use, and stays
  /// bounded by this amount. Block-slot storage (whose rows are allocated up front): bytes of
  /// per-request position metadata (24 bytes a position, in pages of 512) made when the store is
  /// built, which released requests' pages return to; -1: two full steps of new positions.
  std::int64_t host_memory_ahead = -1;
  /// @brief Preemption with recompute: false keeps the first routing recorded for a position
  /// (it produced the sampled token); true keeps the latest.
  bool overwrite_recomputed_rows = false;
};

/// @brief How per-request storage's row memory grew (RoutingReplay::host_memory_growth()): in
/// superblocks, mapped, faulted in and registered either ahead of need by the background thread
/// (replay_config::host_memory_ahead) or, when none was ready, on the engine's thread in a step.
struct host_memory_growth {
  std::uint64_t superblocks_ahead   = 0;  ///< taken ready from the background thread
  std::uint64_t superblocks_in_step = 0;  ///< mapped by the engine's thread itself (none was ready)
  std::size_t superblock_bytes      = 0;  ///< bytes of one superblock (0: storage without them)
};

}  // namespace routing_replay
