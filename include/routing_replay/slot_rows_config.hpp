/// @file
/// Construction-time configuration of a slot_rows (slot_rows.hpp), and what the engine says about
/// each step it ends.
#pragma once

#include <cstdint>
#include <vector>

namespace routing_replay {

/// @brief Sizes and choices of a slot_rows.
struct slot_rows_config {
  /// @brief E: routed experts; valid ids are [0, E).
  std::int32_t num_experts = 0;
  /// @brief K: ids kept per row and layer.
  std::int32_t top_k = 0;
  /// @brief Columns after the first K of a router output (fused shared experts), skipped.
  std::int32_t num_fused_shared_experts = 0;
  /// @brief N_max: the most rows (tokens) one step may have, padding of a CUDA graph included.
  std::int32_t max_tokens_per_step = 0;
  /// @brief Layers of the model; a read returns this many per row.
  std::int32_t num_model_layers = 0;
  /// @brief The model layers the pool keeps (the layer map); empty: every layer. Layers outside it
  /// read as slot_read_options::uncaptured_value, and capturing them is an error.
  std::vector<std::int32_t> layers;
  /// @brief Slots of the engine's KV pool: the pool holds one row per slot.
  std::int64_t num_slots = 0;
  /// @brief Tokens per KV page of the engine (informative: rows live at slots, which pages group).
  std::int32_t page_size = 1;
  /// @brief Steps that may be in flight at once (each has a device snapshot of its rows); an end of
  /// step waits for the oldest only when all are.
  std::int32_t steps_in_flight = 4;
  /// @brief Run the scatter on the compute stream right after the end-of-step kernel, instead of on
  /// a side stream after an event: one event call less on the host, the PCIe writes on the compute
  /// stream (steps above fused_scatter_max_rows; smaller ones are stored by one kernel anyway).
  bool scatter_on_compute_stream = false;
  /// @brief Steps of at most this many rows are stored by the end-of-step kernel itself, on the
  /// compute stream: one launch and one event record on the host instead of two launches, two event
  /// records and a stream wait (a decode step of a small batch, whose host path is all fixed cost),
  /// at the price of at most this many rows of PCIe writes on the compute stream. 0: never.
  std::int32_t fused_scatter_max_rows = 64;
};

/// @brief What the engine says about the forward a step ends.
struct slot_step_options {
  /// @brief The forward replayed a CUDA graph: its capture kernels wrote rows the host never saw
  /// handed out, up to the rows they were recorded with (every graph recorded so far counts).
  bool graph_replayed = false;
  /// @brief Rows the forward's capture paths wrote beyond the step's own (a padded batch), if the
  /// engine knows; 0 otherwise.
  std::int64_t padded_rows = 0;
};

}  // namespace routing_replay
