/// @file
/// Bodies of the library's kernels as functors over a flat index, so that one definition runs as a
/// CUDA kernel (through CUB) and as a loop on a host stream.
#pragma once

#include <routing_replay/buffer_layout.hpp>
#include <routing_replay/detail/macros.hpp>
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

/// @brief End-of-step check of D rows [0, N): finds (layer, row) groups still holding the sentinel
/// (a layer the engine never captured) and values outside [0, E) (written through a view).
///
/// One thread per (layer, row).
template <class Index, class Layout>
struct check_rows {
  buffer_mdspan<const Index, Layout> buffer;
  step_status* status;
  std::int64_t num_experts;
  std::int32_t num_rows;

  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t i) const noexcept
  {
    const auto layer = static_cast<std::int32_t>(i / num_rows);
    const auto row   = static_cast<std::int32_t>(i % num_rows);
    for (std::int32_t k = 0; k < buffer.extent(2); ++k) {
      const Index v = buffer(layer, row, k);
      if (v == index_traits<Index>::sentinel) {
        status->unwritten.report(0, layer, row, k);
        return;  // one report per (layer, row) keeps the count meaningful: unwritten rows
      }
      if (!index_traits<Index>::is_valid(static_cast<std::int64_t>(v), num_experts)) {
        status->out_of_range.report(static_cast<std::int64_t>(v), layer, row, k);
      }
    }
  }
};

}  // namespace routing_replay::detail
