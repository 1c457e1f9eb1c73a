/// @file
/// The staging path of the drop-in capturer, its data and kernels: during the forward each layer's
/// router output is staged (stage_layer on a GPU, a copy past the cache on the host), and the
/// end-of-step kernel merges the staged rows into D (merge_staged) or a reset clears them
/// (reset_staged). replay_impl (replay_impl.hpp) owns the staging buffer and launches these.
/// Included by the host translation units (g++) and the CUDA ones (nvcc).
#pragma once

#include <routing_replay/detail/kernels.hpp>
#include <routing_replay/detail/macros.hpp>
#include <routing_replay/detail/step_status.hpp>
#include <routing_replay/host_backend.hpp>
#include <routing_replay/index_type.hpp>

#if defined(__SSE2__) && !defined(__CUDACC__)
#include <emmintrin.h>
#endif

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace routing_replay::python {

/// @brief The element type of the staging buffer: int32 on a GPU (half the bytes of int64 through
/// the capture and the merge), int64 on the host backend, where staging an int64 router output is
/// then one memcpy and needs no per-id kernel (which costs a 2-core machine's worker tens of
/// microseconds a layer at decode batch 1024).
template <class Backend>
using staged_id_t = std::conditional_t<std::is_same_v<Backend, host_backend>, std::int64_t, std::int32_t>;

/// @brief Copies `bytes` (a multiple of 8) from `src` to `dst` (8-byte aligned) with stores that
/// bypass the cache where the processor has them (x86 SSE2; the caller fences once after its
/// copies), memcpy elsewhere.
inline void copy_bypassing_cache(std::int64_t* dst, const std::int64_t* src, std::size_t bytes) noexcept
{
#if defined(__SSE2__) && !defined(__CUDACC__)
  auto* out      = reinterpret_cast<unsigned char*>(dst);        // NOLINT
  const auto* in = reinterpret_cast<const unsigned char*>(src);  // NOLINT
  if ((reinterpret_cast<std::uintptr_t>(out) & 15u) != 0 && bytes >= 8) {  // NOLINT: to 16-byte alignment
    std::memcpy(out, in, 8);
    out += 8;
    in += 8;
    bytes -= 8;
  }
  for (; bytes >= 16; bytes -= 16, out += 16, in += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(out), _mm_loadu_si128(reinterpret_cast<const __m128i*>(in)));  // NOLINT
  }
  if (bytes > 0) { std::memcpy(out, in, bytes); }
#else
  std::memcpy(dst, src, bytes);
#endif
}

/// @brief Host staging: copies the first `k` of every `stride` int64 ids of `rows` rows to `dst`
/// (compact) past the cache (copy_bypassing_cache()). Each layer's slab is written once a step and
/// read by the end of the step on another thread, so the lines written are not in this core's
/// cache, and an ordinary store reads each line first: on the CPU machine a 64 KiB copy took 5.3 to
/// 6.2 us so, 3.8 bypassing the cache.
inline void stage_rows_bypassing_cache(std::int64_t* dst, const std::int64_t* src, std::int64_t k, std::int64_t stride,
                                       std::int64_t rows) noexcept
{
  const auto row_bytes = static_cast<std::size_t>(k) * sizeof(std::int64_t);
  if (stride == k) {  // contiguous rows: one copy
    copy_bypassing_cache(dst, src, row_bytes * static_cast<std::size_t>(rows));
  } else {
    for (std::int64_t r = 0; r < rows; ++r) { copy_bypassing_cache(dst + r * k, src + r * stride, row_bytes); }
  }
#if defined(__SSE2__) && !defined(__CUDACC__)
  _mm_sfence();  // the stores ordered before whatever publishes the rows (a queue's mutex)
#endif
}

/// @brief The staging buffer's mark for "not captured this step": the type's lowest value. A GPU
/// stage clamps ids to stay above it; on the host, an id equal to INT64_MIN reads as never
/// staged, so its row is refused as missing routing rather than as an invalid id.
template <class Staged>
inline constexpr Staged unstaged = std::numeric_limits<Staged>::min();

/// @brief Staging path on a GPU, during the forward: the first K columns of a router output, as
/// int32 (ids outside the int32 range are clamped, so they stay invalid), into one layer of the
/// staging buffer [L, N_max, K]. One thread per (row, column), 32-bit index arithmetic as in
/// detail::capture_layer, launched as the library launches its capture kernels
/// (Backend::launch_dependent_async: a plain launch with no occupancy query or device lookup, its
/// start overlapping the router's end where the device allows).
template <class Source>
struct stage_layer {
  std::int32_t* staging;       ///< the layer's [N_max, K] slab
  const Source* source;        ///< [rows, stride], row-major
  std::int64_t source_stride;  ///< elements between source rows
  std::int32_t top_k;          ///< K
  std::int32_t items;          ///< rows * K (N_max * K fits: validated_config)

  /// @brief Enqueues the kernel for `rows` rows on `stream`.
  template <class Backend>
  static void launch(std::int32_t* staging, const Source* source, std::int64_t source_stride, std::int32_t top_k,
                     std::int64_t rows, typename Backend::stream_ref stream)
  {
    const auto items = static_cast<std::int32_t>(rows * top_k);
    Backend::launch_dependent_async(detail::blocks_for(items), detail::kernel_block_threads,
                                    stage_layer{staging, source, source_stride, top_k, items}, stream);
  }

  /// @brief Stages element block * threads + thread (row i / K, column i % K) if it is one.
  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int32_t block, std::int32_t thread) const noexcept
  {
    const auto i = detail::item_of<std::int32_t>(block, thread);
    if (i >= items) { return; }
    const std::int32_t row = i / top_k;
    const std::int32_t col = i - row * top_k;
    const auto id          = static_cast<std::int64_t>(source[static_cast<std::int64_t>(row) * source_stride + col]);
    constexpr std::int64_t hi = INT32_MAX;  // a macro: nvcc refuses std::numeric_limits in device code
    constexpr std::int64_t lo = std::int64_t{unstaged<std::int32_t>} + 1;  // above the mark
    staging[i] = static_cast<std::int32_t>(id > hi ? hi : (id < lo ? lo : id));
  }
};

/// @brief Staging path, at the end of the step: the merge of the end-of-step kernel
/// (capture_buffer::end_step), so that moving the staged rows costs no launch of its own. For the
/// (layer slot, row) of the calling thread it moves the staged ids of a row of the step into D's
/// cell, narrowed and checked as device_ref::record() does (an id outside [0, E) is stored as the
/// sentinel and reported with its value), and resets the staged cell to `unstaged` for every row
/// below R.
template <class Index, class Staged>
struct merge_staged {
  Staged* staging;           ///< [L, N_max, K]
  std::int64_t reset_rows;   ///< R >= N: rows any staged capture may have written
  std::int64_t max_rows;     ///< N_max
  std::int64_t num_experts;  ///< E
  std::int32_t top_k;        ///< K

  /// @brief Rows whose staged cells the end-of-step kernel must visit: R.
  [[nodiscard]] ROUTING_REPLAY_HOST_DEVICE std::int64_t rows() const noexcept { return reset_rows; }

  /// @brief Moves (rows of the step) and resets the staged cell of (`layer`, `row`) into `cell`.
  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int32_t layer,
                                             std::int32_t row,
                                             bool in_step,
                                             Index* cell,
                                             detail::step_status* status) const noexcept
  {
    Staged* staged = staging + (static_cast<std::int64_t>(layer) * max_rows + row) * top_k;
    for (std::int32_t col = 0; col < top_k; ++col) {
      const Staged id = staged[col];
      staged[col]     = unstaged<Staged>;
      if (!in_step || id == unstaged<Staged>) { continue; }  // never staged: D keeps what it holds
      if (index_traits<Index>::is_valid(id, num_experts)) {
        cell[col] = static_cast<Index>(id);
      } else {
        cell[col] = index_traits<Index>::sentinel;
        status->invalid_id.report(id, layer, row, col);
      }
    }
  }
};

/// @brief Resets staged rows [0, R) of every layer (no step). One thread per element.
template <class Staged>
struct reset_staged {
  Staged* staging;          ///< [L, N_max, K]
  std::int64_t reset_rows;  ///< R
  std::int64_t max_rows;    ///< N_max
  std::int32_t top_k;       ///< K

  /// @brief Resets element `i` of the first R rows of every layer.
  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t i) const noexcept
  {
    const std::int64_t per_layer = reset_rows * top_k;
    const std::int64_t slot      = i / per_layer;
    staging[slot * max_rows * top_k + i % per_layer] = unstaged<Staged>;
  }
};

}  // namespace routing_replay::python
