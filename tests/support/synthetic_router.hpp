/// @file
/// A deterministic stand-in for a MoE router, runnable on any backend, plus the functors that
/// feed each of the three capture paths.
#pragma once

#include <routing_replay/detail/macros.hpp>

#include <cstdint>

namespace rr_test {

/// @brief Which request and position a row of the step belongs to; `salt` changes on every step
/// so a recomputed position routes differently and first-write-wins is observable.
struct row_meta {
  std::int64_t request  = -1;
  std::int64_t position = 0;
  std::int64_t salt     = 0;
};

/// @brief The part of routed_expert() that depends on the row only: a host computing a whole row
/// (the reference model, 384 ids a row at scale) hashes it once.
ROUTING_REPLAY_HOST_DEVICE inline std::uint64_t routed_row_hash(const row_meta& m) noexcept
{
  std::uint64_t x = static_cast<std::uint64_t>(m.request + 3) * 0x9E3779B97F4A7C15ull;
  x ^= static_cast<std::uint64_t>(m.position + 1) * 0xBF58476D1CE4E5B9ull;
  x ^= static_cast<std::uint64_t>(m.salt + 7) * 0x94D049BB133111EBull;
  return x;
}

/// @brief The unreduced pick of routed_expert() for a row hash (routed_row_hash) and a cell.
ROUTING_REPLAY_HOST_DEVICE inline std::uint64_t routed_mix(std::uint64_t row_hash, std::int32_t layer,
                                                           std::int32_t column) noexcept
{
  std::uint64_t x = row_hash ^ static_cast<std::uint64_t>(layer * 131 + column * 17 + 1);
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 32;
  return x;
}

/// @brief The expert the synthetic router picks for (row, captured layer, column).
ROUTING_REPLAY_HOST_DEVICE inline std::int64_t routed_expert(const row_meta& m,
                                                             std::int32_t layer,
                                                             std::int32_t column,
                                                             std::int64_t num_experts) noexcept
{
  return static_cast<std::int64_t>(routed_mix(routed_row_hash(m), layer, column) %
                                   static_cast<std::uint64_t>(num_experts));
}

/// @brief The id a write puts at (row, column): the router's pick, or `bad_value` at the write's one
/// bad cell (`bad_cell` is row * K + column; -1: none), as a faulty router or kernel would.
ROUTING_REPLAY_HOST_DEVICE inline std::int64_t routed_or_bad(const row_meta& m, std::int32_t layer, std::int64_t row,
                                                             std::int32_t column, std::int32_t top_k,
                                                             std::int64_t num_experts, std::int64_t bad_cell,
                                                             std::int64_t bad_value) noexcept
{
  return row * top_k + column == bad_cell ? bad_value : routed_expert(m, layer, column, num_experts);
}

/// @brief Path (a): writes a router output [rows, stride] of `Source`, as torch.topk would; the
/// columns past K (fused shared experts) hold an invalid id that capture() must skip.
template <class Source>
struct write_router_output {
  const row_meta* meta;
  Source* out;
  std::int64_t stride;
  std::int32_t top_k;
  std::int32_t layer;
  std::int64_t num_experts;
  std::int64_t bad_cell  = -1;  ///< see routed_or_bad
  std::int64_t bad_value = 0;

  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t i) const noexcept
  {
    const std::int64_t row    = i / stride;
    const auto column         = static_cast<std::int32_t>(i % stride);
    out[i] = static_cast<Source>(
      column < top_k ? routed_or_bad(meta[row], layer, row, column, top_k, num_experts, bad_cell, bad_value)
                     : num_experts + 3);
  }
};

/// @brief Path (b): a "fused MoE kernel" writing its routing straight into a layer view.
template <class View>
struct write_layer_view {
  const row_meta* meta;
  View view;
  std::int32_t top_k;
  std::int32_t layer;
  std::int64_t num_experts;
  std::int64_t bad_cell  = -1;  ///< see routed_or_bad
  std::int64_t bad_value = 0;

  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t i) const noexcept
  {
    const std::int64_t row = i / top_k;
    const auto column      = static_cast<std::int32_t>(i % top_k);
    view(row, column)      = static_cast<typename View::value_type>(
      routed_or_bad(meta[row], layer, row, column, top_k, num_experts, bad_cell, bad_value));
  }
};

/// @brief Path (c): an engine's own top-k kernel recording through the device reference (one
/// thread per (row, column) it is launched for: launched for more rows than the reference covers,
/// it records past it).
template <class Ref>
struct record_through_ref {
  const row_meta* meta;
  Ref ref;
  std::int32_t top_k;
  std::int32_t layer;
  std::int64_t num_experts;
  std::int32_t slot      = -1;  ///< the layer slot recorded into, when it is not `layer` (a pipeline stage's D)
  std::int64_t bad_cell  = -1;  ///< see routed_or_bad
  std::int64_t bad_value = 0;

  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t i) const noexcept
  {
    const auto row    = static_cast<std::int32_t>(i / top_k);
    const auto column = static_cast<std::int32_t>(i % top_k);
    ref.record(slot < 0 ? layer : slot, row, column,
               routed_or_bad(meta[row], layer, row, column, top_k, num_experts, bad_cell, bad_value));
  }
};

}  // namespace rr_test
