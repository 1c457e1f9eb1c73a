/// @file
/// Kernels of the parallel schemes (parallel/), as functors over a flat index like detail/kernels.hpp:
/// merging other ranks' step statuses, assembling a step from sequence-parallel shards, and merging
/// pipeline stages' layer slabs into the output rank's D.
#pragma once

#include <routing_replay/buffer_layout.hpp>
#include <routing_replay/detail/macros.hpp>
#include <routing_replay/detail/step_status.hpp>

#include <cstddef>
#include <cstdint>

namespace routing_replay::detail {

/// @brief Bytes in front of every rank's rows in an exchange buffer: the rank's step_status, padded
/// so that the rows after it stay aligned for any index type.
inline constexpr std::size_t exchange_header_bytes = 128;
static_assert(sizeof(step_status) <= exchange_header_bytes);

/// @brief Bytes of one rank's part of an exchange: its status, then `elems` ids of `index_bytes`,
/// rounded up so that the next part's status is aligned.
[[nodiscard]] constexpr std::size_t exchange_bytes(std::int64_t elems, std::size_t index_bytes) noexcept
{
  const std::size_t raw = exchange_header_bytes + static_cast<std::size_t>(elems) * index_bytes;
  return (raw + exchange_header_bytes - 1) / exchange_header_bytes * exchange_header_bytes;
}

/// @brief Adds another rank's report to `into`: counts add up; the first offender stays the one
/// `into` already had, else it is the other rank's, its layer and row moved into this rank's terms.
ROUTING_REPLAY_HOST_DEVICE inline void merge_report(problem_report& into,
                                                    const problem_report& from,
                                                    std::int32_t layer_offset,
                                                    std::int32_t row_offset) noexcept
{
  if (from.count == 0) { return; }
  if (into.count == 0) {
    into = from;
    into.layer += layer_offset;
    into.row += row_offset;
  } else {
    into.count += from.count;
  }
}

/// @brief merge_report() for every kind of problem of a step status.
ROUTING_REPLAY_HOST_DEVICE inline void merge_status(step_status& into,
                                                    const step_status& from,
                                                    std::int32_t layer_offset,
                                                    std::int32_t row_offset) noexcept
{
  merge_report(into.invalid_id, from.invalid_id, layer_offset, row_offset);
  merge_report(into.out_of_bounds, from.out_of_bounds, layer_offset, row_offset);
  merge_report(into.unwritten, from.unwritten, layer_offset, row_offset);
  merge_report(into.out_of_range, from.out_of_range, layer_offset, row_offset);
}

/// @brief Sequence parallel, on the output rank: the gathered shards (rank r's part at
/// `r * part_bytes`: its status, then `shard_rows` token-major rows) become the step's snapshot
/// rows [0, N), and every rank's status is merged into the step's, rows shifted to step rows.
///
/// One thread per element of the snapshot (at least one, so the statuses merge for N = 0).
template <class Index>
struct assemble_shards {
  const std::byte* gathered;
  std::int64_t part_bytes;
  std::int64_t shard_rows;
  std::int64_t row_elems;   // L * K
  std::int64_t elems;       // N * L * K
  std::int32_t ranks;
  Index* snapshot;          // [N, L, K]
  step_status* status;      // zero before

  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t i) const noexcept
  {
    if (i == 0) {
      for (std::int32_t r = 0; r < ranks; ++r) {
        merge_status(*status, *reinterpret_cast<const step_status*>(gathered + r * part_bytes), 0,
                     static_cast<std::int32_t>(r * shard_rows));
      }
    }
    if (i >= elems) { return; }
    const std::int64_t row = i / row_elems;
    const std::int64_t r   = row / shard_rows;
    const auto* rows = reinterpret_cast<const Index*>(gathered + r * part_bytes + exchange_header_bytes);
    snapshot[i]      = rows[(row - r * shard_rows) * row_elems + i % row_elems];
  }
};

/// @brief Pipeline parallel: where the layer slot of the output rank's D comes from.
struct stage_layer {
  std::int64_t part_offset = -1;  ///< byte offset of its stage's part in the received buffer; -1: captured here
  std::int32_t local_slot  = 0;   ///< its slot among the stage's layers
  std::int32_t stage_layers = 0;  ///< layers of its stage (the slab's row width in layers)
};

/// @brief Pipeline parallel, on the output rank before the end-of-step kernel: writes rows [0, N)
/// of every layer another stage captured from that stage's slab ([N, L_s, K], token-major) into D,
/// whatever D's layout. A stage's slab holds the sentinel where the stage recorded nothing, so such
/// rows stay missing and the end-of-step check reports them.
///
/// One thread per (row, layer slot, column) of D's rows [0, N).
template <class Index, class Layout>
struct merge_stage_rows {
  buffer_mdspan<Index, Layout> buffer;
  const std::byte* received;
  const stage_layer* layers;  // one per layer slot of D
  std::int64_t num_rows;

  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t i) const noexcept
  {
    const auto num_layers = static_cast<std::int64_t>(buffer.extent(0));
    const auto top_k      = static_cast<std::int64_t>(buffer.extent(2));
    const auto k          = static_cast<std::int32_t>(i % top_k);
    const auto slot       = static_cast<std::int32_t>((i / top_k) % num_layers);
    const auto row        = static_cast<std::int32_t>(i / (top_k * num_layers));
    const stage_layer& from = layers[slot];
    if (from.part_offset < 0) { return; }
    const auto* slab = reinterpret_cast<const Index*>(received + from.part_offset + exchange_header_bytes);
    buffer(slot, row, k) = slab[(static_cast<std::int64_t>(row) * from.stage_layers + from.local_slot) * top_k + k];
  }
};

/// @brief Pipeline parallel: one received part of a stage, for the status merge.
struct stage_part {
  std::int64_t offset     = 0;  ///< byte offset of the part (its status) in the received buffer
  std::int32_t first_slot = 0;  ///< the stage's first layer slot in the output rank's D
};

/// @brief Pipeline parallel, on the output rank after the end-of-step kernel: merges what every other
/// stage's capture paths reported (invalid ids, records outside the buffer) into the step's status,
/// layer slots shifted to D's. One thread. The stages' own checks (unwritten, out of range) are
/// not merged: the end-of-step kernel just checked the same values in D, and counts them once.
struct merge_stage_statuses {
  const std::byte* received;
  const stage_part* parts;
  std::int32_t num_parts;
  step_status* status;

  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t) const noexcept
  {
    for (std::int32_t p = 0; p < num_parts; ++p) {
      const auto& stage = *reinterpret_cast<const step_status*>(received + parts[p].offset);
      merge_report(status->invalid_id, stage.invalid_id, parts[p].first_slot, 0);
      merge_report(status->out_of_bounds, stage.out_of_bounds, parts[p].first_slot, 0);
    }
  }
};

}  // namespace routing_replay::detail
