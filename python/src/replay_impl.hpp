/// @file
/// replay_impl: one RoutingReplay instantiation behind replay_base, plus the staging path of the
/// drop-in capturer. Included by the host translation units (g++) and the CUDA one (nvcc); the
/// backend's stream handles are converted by stream_cast<Backend>.
#pragma once

#include "replay_base.hpp"

#include <routing_replay/detail/kernels.hpp>
#include <routing_replay/detail/macros.hpp>
#include <routing_replay/host_backend.hpp>
#include <routing_replay/routing_replay.hpp>

#if defined(__SSE2__) && !defined(__CUDACC__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

namespace routing_replay::python {

/// @brief Turns an integer stream handle into the backend's stream reference.
template <class Backend>
struct stream_cast;

/// @brief Host backend: the handle is the address of a host_stream the binding owns.
template <>
struct stream_cast<host_backend> {
  /// @brief The stream reference for a handle.
  static host_stream_ref from(std::uintptr_t handle)
  {
    if (handle == 0) { throw error{errc::invalid_argument, "host backend: null stream handle"}; }
    return host_stream_ref{*reinterpret_cast<host_stream*>(handle)};  // NOLINT: handle protocol
  }
};

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

/// @brief One compiled instantiation behind replay_base.
template <class Backend, class Index, class Layout, class Copy, class Storage>
class replay_impl final : public replay_base {
  using replay_type  = RoutingReplay<Backend, Index, Layout, Copy, Storage>;
  using streams      = stream_cast<Backend>;
  static constexpr bool block_slot = std::is_same_v<Storage, block_slot_storage>;
  // The host binding reads every router output as int64 during the call (Python writes are not
  // ordered with host streams: a copy, or the capture itself on an idle stream), so host kernels
  // are compiled for int64 only.
  static constexpr bool on_host = std::is_same_v<Backend, host_backend>;
  using staged_id               = staged_id_t<Backend>;

 public:
  /// @brief Builds the replay; `copy_stream` only for strategies with a side stream; `staging`
  /// allocates the staging buffer of the drop-in capturer's path.
  replay_impl(policy_names names, replay_config config, std::optional<std::uintptr_t> copy_stream, bool staging)
    : names_(std::move(names)), replay_(make(std::move(config), copy_stream))
  {
    if constexpr (!on_host) {
      scratch_.resize(static_cast<std::size_t>(replay_.config().max_tokens_per_step) *
                      static_cast<std::size_t>(replay_.top_k()));
    }
    if (staging) {
      staging_.assign(static_cast<std::size_t>(replay_.num_layers()) *
                        static_cast<std::size_t>(replay_.config().max_tokens_per_step) *
                        static_cast<std::size_t>(replay_.top_k()),
                      unstaged<staged_id>);
    }
  }

  [[nodiscard]] const policy_names& policies() const noexcept override { return names_; }
  [[nodiscard]] dtype_code index_dtype() const noexcept override { return dtype_of<Index>(); }
  [[nodiscard]] const replay_config& config() const noexcept override { return replay_.config(); }
  [[nodiscard]] bool slot_indexed() const noexcept override { return block_slot; }
  [[nodiscard]] std::int32_t num_layers() const noexcept override { return replay_.num_layers(); }
  [[nodiscard]] std::size_t device_bytes() const noexcept override { return replay_.device_bytes(); }
  [[nodiscard]] std::size_t snapshot_bytes() const noexcept override { return replay_.snapshot_bytes(); }
  [[nodiscard]] std::size_t staging_bytes() const noexcept override
  {
    return staging_.size() * sizeof(staged_id);
  }
  [[nodiscard]] std::size_t host_bytes() const noexcept override { return replay_.host_bytes(); }
  [[nodiscard]] std::size_t steps_in_flight() const noexcept override { return replay_.steps_in_flight(); }
  [[nodiscard]] std::size_t num_requests() const noexcept override { return replay_.num_requests(); }
  void wait_for_host_memory_ahead() const override { replay_.wait_for_host_memory_ahead(); }
  [[nodiscard]] std::int32_t layer_slot(std::int32_t model_layer) const override
  {
    return replay_.layer_slot(model_layer);
  }

  request_handle add_request(request_key id, const request_options& options) override
  {
    return replay_.add_request(id, options);
  }
  [[nodiscard]] request_handle handle(request_key id) const override { return replay_.handle(id); }
  void add_cached_prefix(request_key id, std::span<const std::int64_t> slots) override
  {
    replay_.add_cached_prefix(id, slots);
  }
  [[nodiscard]] bool contains(request_key id) const override { return replay_.contains(id); }
  [[nodiscard]] std::int64_t recorded_rows(request_key id) override { return replay_.recorded_rows(id); }
  void accept_draft(request_key id, std::int32_t num_accepted) override { replay_.accept_draft(id, num_accepted); }

  [[nodiscard]] extraction extract(request_key id, const extract_options& options) override
  {
    auto rows = std::make_shared<routed_experts<Index>>(replay_.extract(id, options));
    extraction e;
    e.data           = rows->flat().data();
    e.rows           = rows->num_rows();
    e.layers         = rows->num_layers();
    e.top_k          = rows->top_k();
    e.first_position = rows->first_position();
    e.prompt_length  = rows->prompt_length();
    e.is_view        = rows->is_view();
    e.owner          = std::move(rows);
    return e;
  }

  void release(request_key id) override { replay_.release(id); }
  void abort(request_key id) override { replay_.abort(id); }

  void export_blocks(std::span<const std::int64_t> blocks, void* out, std::size_t elems) override
  {
    if constexpr (block_slot) {
      replay_.export_blocks(blocks, std::span<Index>{static_cast<Index*>(out), elems});
    } else {
      throw needs_block_slot("export_blocks");
    }
  }
  void import_blocks(std::span<const std::int64_t> blocks, const void* rows, std::size_t elems) override
  {
    if constexpr (block_slot) {
      replay_.import_blocks(blocks, std::span<const Index>{static_cast<const Index*>(rows), elems});
    } else {
      throw needs_block_slot("import_blocks");
    }
  }
  void copy_blocks(std::span<const std::int64_t> source, std::span<const std::int64_t> destination) override
  {
    if constexpr (block_slot) {
      replay_.copy_blocks(source, destination);
    } else {
      throw needs_block_slot("copy_blocks");
    }
  }

  void begin_step(const step_plan& plan, std::uintptr_t stream) override
  {
    replay_.begin_step(plan, streams::from(stream));
  }
  void end_step(std::uintptr_t stream) override { replay_.end_step(streams::from(stream)); }
  void drain() override { replay_.drain(); }
  void reset_device_buffer(std::uintptr_t stream) override
  {
    replay_.reset_device_buffer(streams::from(stream));
  }

  void capture(std::int32_t model_layer,
               const id_array& ids,
               std::int64_t num_tokens,
               std::uintptr_t stream,
               const capture_options& options) override
  {
    capture_options o   = options;
    o.source_row_stride = ids.row_stride;
    const auto s        = streams::from(stream);
    auto native         = [&](auto tag) {
      using source = decltype(tag);
      replay_.capture(model_layer, static_cast<const source*>(ids.data), num_tokens, s, o);
    };
    if constexpr (on_host) {
      require_host_int64(ids, "capture");
      native(std::int64_t{});
    } else {
      switch (ids.dtype) {
        case dtype_code::i64: native(std::int64_t{}); return;
        case dtype_code::i32: native(std::int32_t{}); return;
        case dtype_code::i16: native(std::int16_t{}); return;
        default: break;
      }
      // Other element types are converted to int32 in a scratch [N_max, K] first (one more small
      // kernel): capture kernels are compiled for int64, int32 and int16 sources only.
      const auto& c = replay_.config();
      static_cast<void>(replay_.layer_slot(model_layer));  // throws unknown_layer before anything is enqueued
      check_source(model_layer, ids, num_tokens, o.source_row_offset);
      if (num_tokens > 0) {
        visit_dtype(ids.dtype, [&](auto tag) {
          using source       = decltype(tag);
          const auto* first = static_cast<const source*>(ids.data) + o.source_row_offset * ids.row_stride;
          stage_layer<source>::template launch<Backend>(Backend::data(scratch_), first, ids.row_stride, c.top_k,
                                                        num_tokens, s);
        });
      }
      o.source_row_offset = 0;
      o.source_row_stride = c.top_k;
      replay_.capture(model_layer, static_cast<const std::int32_t*>(Backend::data(scratch_)), num_tokens, s, o);
    }
  }

  [[nodiscard]] layer_window layer_view(std::int32_t model_layer, std::int64_t num_rows) override
  {
    auto view = replay_.layer_view(model_layer, num_rows);
    return layer_window{view.data_handle(), view.extent(0), view.extent(1), view.stride(0)};
  }

  void stage_capture(std::int32_t model_layer,
                     const id_array& ids,
                     std::int64_t num_tokens,
                     std::uintptr_t stream) override
  {
    require_staging("stage_capture");
    const std::int32_t slot = replay_.layer_slot(model_layer);  // throws unknown_layer
    const auto& c           = replay_.config();
    check_source(model_layer, ids, num_tokens, 0);
    note_staged(num_tokens, stream);
    if (num_tokens == 0) { return; }
    staged_id* layer = Backend::data(staging_) + static_cast<std::int64_t>(slot) * c.max_tokens_per_step * c.top_k;
    if constexpr (on_host) {  // int64 ids into int64 staging: a copy of the first K columns of each row
      require_host_int64(ids, "capture");
      const auto* source    = static_cast<const std::int64_t*>(ids.data);
      const std::int64_t k  = c.top_k;
      const std::int64_t stride = ids.row_stride;
      streams::from(stream).queue().enqueue(
        [layer, source, k, stride, num_tokens] { stage_rows_bypassing_cache(layer, source, k, stride, num_tokens); });
    } else {
      visit_dtype(ids.dtype, [&](auto tag) {
        using source = decltype(tag);
        stage_layer<source>::template launch<Backend>(layer, static_cast<const source*>(ids.data), ids.row_stride,
                                                      c.top_k, num_tokens, streams::from(stream));
      });
    }
  }

  void commit_staged_step(const step_plan& plan, std::uintptr_t stream) override
  {
    require_staging("commit_staged_step");
    const auto s = streams::from(stream);
    try {
      replay_.begin_step(plan, s);
    } catch (...) {
      reset_staging(stream);  // a refused step must not leave its rows for the next one
      throw;
    }
    const auto& c = replay_.config();
    const merge_staged<Index, staged_id> merge{Backend::data(staging_), std::max(plan.num_rows(), rows_to_reset()),
                                    c.max_tokens_per_step, c.num_experts, c.top_k};
    replay_.end_step(s, [&](auto& buffer, const step_record<Index>& step, Index* snapshot,
                            detail::step_status* status, typename Backend::stream_ref compute) {
      buffer.end_step(snapshot, status, step.num_rows, step.padded_rows, compute, merge);
      eager_staged_rows_ = 0;  // the kernel that resets them is enqueued
    });
  }

  void reset_staging(std::uintptr_t stream) override
  {
    require_staging("reset_staging");
    const auto& c            = replay_.config();
    const std::int64_t reset = rows_to_reset();
    eager_staged_rows_       = 0;
    if (reset == 0) { return; }
    Backend::bulk_async(reset * replay_.row_size(),
                        reset_staged<staged_id>{Backend::data(staging_), reset, c.max_tokens_per_step, c.top_k},
                        streams::from(stream));
  }

 private:
  static replay_type make(replay_config config, std::optional<std::uintptr_t> copy_stream)
  {
    if constexpr (Copy::uses_side_stream) {
      if (copy_stream) { return replay_type{std::move(config), streams::from(*copy_stream)}; }
    } else if (copy_stream) {
      throw error{errc::invalid_argument,
                  std::string{"copy strategy '"} + Copy::name +
                    "' copies on the compute stream: it takes no copy stream"};
    }
    return replay_type{std::move(config)};
  }

  [[nodiscard]] error needs_block_slot(const char* what) const
  {
    return error{errc::invalid_argument,
                 std::string{what} + " needs block_slot storage; this replay uses " + names_.storage};
  }

  // What the library's capture() refuses, refused the same way before a conversion or staging
  // kernel (which capture() does not check) is enqueued.
  void check_source(std::int32_t model_layer, const id_array& ids, std::int64_t num_tokens, std::int64_t row_offset) const
  {
    const auto& c = replay_.config();
    if (num_tokens >= 0 && num_tokens <= c.max_tokens_per_step && ids.row_stride >= c.top_k && row_offset >= 0 &&
        (ids.data != nullptr || num_tokens == 0)) {
      return;  // the call of every layer of every step: no message built
    }
    const std::string what = "capture: layer " + std::to_string(model_layer) + " got ";
    if (num_tokens < 0) { throw error{errc::invalid_argument, what + "a negative row count " + std::to_string(num_tokens)}; }
    if (num_tokens > c.max_tokens_per_step) {
      throw error{errc::too_many_tokens, what + std::to_string(num_tokens) + " rows, outside [0, max_tokens_per_step = " +
                                           std::to_string(c.max_tokens_per_step) + "]"};
    }
    if (ids.row_stride < c.top_k || row_offset < 0 || (ids.data == nullptr && num_tokens > 0)) {
      throw error{errc::invalid_argument, what + "row stride " + std::to_string(ids.row_stride) + " (needs >= K = " +
                                            std::to_string(c.top_k) + "), row offset " + std::to_string(row_offset) +
                                            (ids.data == nullptr ? ", a null id pointer" : "")};
    }
  }

  static void require_host_int64(const id_array& ids, const char* what)
  {
    if (ids.dtype != dtype_code::i64) {
      throw error{errc::invalid_argument, std::string{what} + ": the host backend takes int64 ids (the binding "
                                                              "converts every router output to them)"};
    }
  }

  void require_staging(const char* what) const
  {
    if (staging_.empty()) {
      throw error{errc::invalid_state, std::string{what} + ": this replay was built without a staging buffer"};
    }
  }

  policy_names names_;
  replay_type replay_;
  // Rows a forward may have staged since the last commit or reset, which those must reset: the most
  // rows an eager staged capture was handed since then, and the most a staged capture recorded
  // into a CUDA graph was ever handed (its replays stage them again, unseen by the host). Resetting
  // only these, not the most rows ever staged, keeps a decode step after an 8k prefill (or a warm-up
  // forward of N_max rows) from resetting N_max rows of staging every step.
  void note_staged(std::int64_t num_tokens, std::uintptr_t stream)
  {
    if (Backend::is_capturing(streams::from(stream))) {
      graph_staged_rows_ = std::max(graph_staged_rows_, num_tokens);
    } else {
      eager_staged_rows_ = std::max(eager_staged_rows_, num_tokens);
    }
  }
  [[nodiscard]] std::int64_t rows_to_reset() const noexcept { return std::max(eager_staged_rows_, graph_staged_rows_); }

  typename Backend::template device_vector<staged_id> staging_;  // [L, N_max, K]
  std::int64_t eager_staged_rows_ = 0;  // see note_staged()
  std::int64_t graph_staged_rows_ = 0;  // see note_staged()
  // CUDA: int32 ids converted from element types capture kernels are not compiled for; [N_max, K].
  // Captures of such types share it, so they must be ordered (one stream), as any scratch.
  typename Backend::template device_vector<std::int32_t> scratch_;
};

/// @brief A factory for one instantiation.
using replay_factory =
  std::function<std::unique_ptr<replay_base>(replay_config, std::optional<std::uintptr_t>, bool)>;

/// @brief The compiled instantiations of one backend, by "index/layout/copy/storage".
using factory_table = std::map<std::string, replay_factory>;

/// @brief The table key of a policy combination.
[[nodiscard]] inline std::string policy_key(const std::string& index,
                                            const std::string& layout,
                                            const std::string& copy,
                                            const std::string& storage)
{
  return index + "/" + layout + "/" + copy + "/" + storage;
}

/// @brief Adds the instantiation <Backend, Index, Layout, Copy, Storage> to `table`.
template <class Backend, class Index, class Layout, class Copy, class Storage>
void add_factory(factory_table& table, const char* backend, const char* index)
{
  const std::string layout = layout_traits<Layout>::name;
  policy_names names{backend, index, layout, Copy::name, Storage::name};
  table[policy_key(index, layout, Copy::name, Storage::name)] =
    [names](replay_config config, std::optional<std::uintptr_t> copy_stream, bool staging) {
      return std::make_unique<replay_impl<Backend, Index, Layout, Copy, Storage>>(
        names, std::move(config), copy_stream, staging);
    };
}

}  // namespace routing_replay::python
