/// @file
/// Data parallel with naive dispatch: this rank's span of a router output that holds every rank's
/// tokens, read from device memory when the capture kernel runs, so that one recorded CUDA graph
/// stays correct while the per-rank token counts change from step to step.
#pragma once

#include <routing_replay/detail/kernels.hpp>
#include <routing_replay/detail/macros.hpp>

#include <cstdint>

namespace routing_replay {

/// @brief Where this rank's rows lie in an all-ranks router output. The engine keeps it in device
/// memory and updates it before each forward (the token counts of a step are known then), and
/// passes its address in capture_options::device_row_span.
struct row_span {
  std::int64_t first_row = 0;  ///< this rank's first row of the router output (>= 0)
  std::int64_t num_rows  = 0;  ///< this rank's rows this step; rows past the capture's num_tokens are not read
};

namespace detail {

/// @brief capture() with a span read from device memory: rows [0, min(span.num_rows, launched))
/// of the layer come from source rows span.first_row + row. The launch covers the rows the graph
/// was recorded for; threads past this step's count write nothing (the end-of-step check reports
/// rows the step should have had and did not get).
template <class Index, class Layout, class Source>
struct capture_layer_span {
  capture_layer<Index, Layout, Source> inner;  ///< its source is the router output's row 0
  const row_span* span;                        ///< device memory, read when the kernel runs

  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int32_t block, std::int32_t thread) const noexcept
  {
    const std::int64_t first = span->first_row;
    const std::int64_t row   = item_of(block, thread) / inner.top_k;
    if (row >= span->num_rows || first < 0) { return; }
    auto shifted = inner;
    shifted.source += first * inner.source_stride;
    shifted(block, thread);
  }
};

}  // namespace detail
}  // namespace routing_replay
