/// @file
/// Bodies of the library's kernels as functors over a flat index, so that one definition runs as a
/// CUDA kernel (through CUB) and as a loop on a host stream.
#pragma once

#include <routing_replay/buffer_layout.hpp>
#include <routing_replay/detail/macros.hpp>
#include <routing_replay/detail/scatter_op.hpp>
#include <routing_replay/detail/step_status.hpp>
#include <routing_replay/device_ref.hpp>
#include <routing_replay/index_type.hpp>

#include <cstdint>

namespace routing_replay::detail {

/// @brief capture(): copies the first K columns of a router's top-k output into one layer of D.
///
/// One thread per (row, column). Source rows may be wider than K (fused shared experts) and may
/// hold physical ids, which a device map turns into logical ones before the range check.
template <class Index, class Layout, class Source>
struct capture_layer {
  device_ref<Index, Layout> ref;
  const Source* source;                      // [rows, source_stride], row-major
  std::int64_t source_stride;                // elements between consecutive source rows
  const std::int32_t* physical_to_logical;   // nullptr: ids are already logical
  std::int64_t num_physical;                 // entries of physical_to_logical
  std::int32_t layer_slot;
  std::int32_t top_k;

  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t i) const noexcept
  {
    const auto row    = static_cast<std::int32_t>(i / top_k);
    const auto column = static_cast<std::int32_t>(i % top_k);
    auto id           = static_cast<std::int64_t>(source[row * source_stride + column]);
    if (physical_to_logical != nullptr) {
      // an unmappable physical id becomes -1, which record() reports as invalid
      id = (id >= 0 && id < num_physical) ? physical_to_logical[id] : std::int64_t{-1};
    }
    ref.record(layer_slot, row, column, id);
  }
};

/// @brief End of step, in one kernel on the compute stream: checks D rows [0, N) (a (layer, row)
/// still holding the sentinel was never captured; a value outside [0, E) came through a view),
/// snapshots them token-major ([N, L, K], one contiguous row per token) for the copy, and resets
/// rows [0, reset_rows) to the sentinel so the next forward may write D at once.
///
/// One thread per (row, layer), layers fastest so the snapshot is written contiguously. Thread 0
/// also moves what capture paths reported during the forward into the step's status.
template <class Index, class Layout>
struct harvest_rows {
  buffer_mdspan<Index, Layout> buffer;
  Index* snapshot;               // [num_rows, L, K]
  step_status* status;           // the step's status (zero before the kernel)
  step_status* capture_status;   // what capture()/record() reported; zeroed here
  std::int64_t num_experts;
  std::int32_t num_rows;         // N
  std::int32_t reset_rows;       // >= N: rows any capture path may have written

  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t i) const noexcept
  {
    const auto layers = static_cast<std::int32_t>(buffer.extent(0));
    const auto top_k  = static_cast<std::int32_t>(buffer.extent(2));
    const auto row    = static_cast<std::int32_t>(i / layers);
    const auto layer  = static_cast<std::int32_t>(i % layers);
    if (i == 0) {
      // capture kernels of this step have finished (stream order); nothing else touches them now
      status->invalid_id            = capture_status->invalid_id;
      status->out_of_bounds         = capture_status->out_of_bounds;
      capture_status->invalid_id    = problem_report{};
      capture_status->out_of_bounds = problem_report{};
    }
    if (row < num_rows) {
      Index* out       = snapshot + (static_cast<std::int64_t>(row) * layers + layer) * top_k;
      bool unwritten   = false;
      for (std::int32_t k = 0; k < top_k; ++k) {
        const Index v = buffer(layer, row, k);
        out[k]        = v;
        if (v == index_traits<Index>::sentinel) {
          unwritten = true;
        } else if (!index_traits<Index>::is_valid(static_cast<std::int64_t>(v), num_experts)) {
          status->out_of_range.report(static_cast<std::int64_t>(v), layer, row, k);
        }
      }
      // one report per (layer, row) keeps the count meaningful: unwritten rows
      if (unwritten) { status->unwritten.report(0, layer, row, 0); }
    }
    for (std::int32_t k = 0; k < top_k; ++k) { buffer(layer, row, k) = index_traits<Index>::sentinel; }
  }
};

/// @brief Device scatter: writes every planned row straight to its place in host storage, or the
/// sentinel instead when the step's status is not clean (the step is discarded as a whole).
///
/// One thread per element; consecutive threads write consecutive elements of a row, so the writes
/// over the bus coalesce.
template <class Index>
struct scatter_rows {
  const scatter_op<Index>* ops;
  const Index* snapshot;         // [N, L, K]
  const step_status* status;
  std::int64_t row_elems;        // L * K

  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t i) const noexcept
  {
    const scatter_op<Index>& op = ops[i / row_elems];
    const std::int64_t e        = i % row_elems;
    if (!status->clean()) {
      op.dst[e] = index_traits<Index>::sentinel;
    } else if (op.copy_from != nullptr) {
      op.dst[e] = op.copy_from[e];
    } else {
      op.dst[e] = snapshot[op.row * row_elems + e];
    }
  }
};

}  // namespace routing_replay::detail
