/// @file
/// Data path, part 3: the capture buffer. The device buffer D in the chosen layout, the three
/// capture paths that write it during the forward (capture(), layer_view(), ref()), and the
/// end-of-step kernel that checks, snapshots and resets it.
#pragma once

#include <routing_replay/backend.hpp>
#include <routing_replay/buffer_layout.hpp>
#include <routing_replay/config.hpp>
#include <routing_replay/detail/kernels.hpp>
#include <routing_replay/detail/step_status.hpp>
#include <routing_replay/device_ref.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/index_type.hpp>
#include <routing_replay/layer_map.hpp>
#include <routing_replay/row_span.hpp>

#include <cuda/std/array>
#include <cuda/std/mdspan>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace routing_replay {

/// @brief Options of capture().
struct capture_options {
  /// @brief Elements between consecutive rows of the router output; 0 means K plus
  /// num_fused_shared_experts (the shared-expert columns that follow the first K are skipped).
  std::int64_t source_row_stride = 0;
  /// @brief Data parallel with naive dispatch: the router output holds every rank's tokens and
  /// this rank's rows start here.
  std::int64_t source_row_offset = 0;
  /// @brief Device map from physical expert (after EPLB replication) to logical expert; nullptr
  /// when the router already yields logical ids.
  const std::int32_t* physical_to_logical = nullptr;
  /// @brief Entries of physical_to_logical.
  std::int64_t num_physical_experts = 0;
  /// @brief Data parallel inside CUDA graphs: this rank's span of the router output, in device
  /// memory, read when the kernel runs (added to source_row_offset); num_tokens then bounds the
  /// rows captured. nullptr: every one of num_tokens rows is captured.
  const row_span* device_row_span = nullptr;
  /// @brief Whether an id outside [0, E) is reported (invalid_id, the step is refused) besides being
  /// stored as the sentinel. false leaves only the sentinel, which the end-of-step check reports as
  /// an unwritten cell if its row belongs to the step: for engines whose router marks the padding
  /// rows of a CUDA graph with -1 (SGLang), rows the capture cannot tell from the step's own.
  bool report_invalid_ids = true;
  /// @brief Row of D the first captured row goes to: micro-batches of one step (dual-batch
  /// overlap) capture their tokens at their offset in the step.
  std::int64_t destination_row_offset = 0;
};

/// @brief D, `N_max * L * K` ids of `Index` in `Layout` order, the sentinel wherever no capture
/// path wrote during the step, plus the device status that capture paths report problems to.
///
/// D's address never changes, so every capture path is safe inside CUDA graphs. Every row a capture
/// path is handed is reset after the step, so a stale row can never pass for a later step's.
template <backend Backend, expert_index Index, buffer_layout Layout>
class capture_buffer {
  using traits = index_traits<Index>;

 public:
  /// @brief Stream handle taken by every call that enqueues work.
  using stream_ref = typename Backend::stream_ref;
  /// @brief Trivially copyable device reference (capture path c).
  using ref_type = device_ref<Index, Layout>;
  /// @brief Per-layer [rows, K] view of D: contiguous row-major for layer_major (FlashInfer's
  /// routing_replay_out when Index is int16_t), strided for token_major.
  using layer_view_type = cuda::std::mdspan<
    Index,
    cuda::std::dextents<std::int64_t, 2>,
    std::conditional_t<layout_traits<Layout>::token_rows_contiguous,
                       cuda::std::layout_stride,
                       cuda::std::layout_right>>;

  /// @brief Allocates D (filled with the sentinel) for a validated configuration.
  capture_buffer(const replay_config& config, const layer_map& layers)
    : layers_(layers),
      num_experts_(config.num_experts),
      top_k_(config.top_k),
      source_stride_(config.top_k + config.num_fused_shared_experts),
      max_rows_(config.max_tokens_per_step),
      row_elems_(static_cast<std::int64_t>(layers.num_layers()) * config.top_k),
      buffer_(static_cast<std::size_t>(max_rows_ * row_elems_), traits::sentinel),
      capture_status_(1)
  {
  }

  /// @brief Bytes of D: N_max * L * K * sizeof(Index).
  [[nodiscard]] std::size_t bytes() const noexcept { return buffer_.size() * sizeof(Index); }
  /// @brief The layer map the capture paths address layers through.
  [[nodiscard]] const layer_map& layers() const noexcept { return layers_; }

  /// @brief (a) Records a layer's router output: the first K columns of `topk_ids`, a row-major
  /// device array of any integer type, narrowed once to Index. One small kernel on `stream`.
  /// @throws error unknown_layer, too_many_tokens, invalid_argument
  template <source_index Source>
  void capture(std::int32_t model_layer,
               const Source* topk_ids,
               std::int64_t num_tokens,
               stream_ref stream,
               const capture_options& options = {})
  {
    const std::int32_t slot = layers_.slot(model_layer);
    check_rows_argument(num_tokens, "capture");
    const std::int64_t stride = options.source_row_stride != 0 ? options.source_row_stride : source_stride_;
    const bool bad_map = options.physical_to_logical != nullptr && options.num_physical_experts <= 0;
    const std::int64_t to = options.destination_row_offset;
    if (stride < top_k_ || options.source_row_offset < 0 || (topk_ids == nullptr && num_tokens > 0) || bad_map ||
        to < 0 || to + num_tokens > max_rows_) {
      throw error{errc::invalid_argument,
                  "capture: layer " + std::to_string(model_layer) + " got source_row_stride " +
                    std::to_string(stride) + " (needs >= K = " + std::to_string(top_k_) +
                    "), source_row_offset " + std::to_string(options.source_row_offset) +
                    (topk_ids == nullptr ? ", a null id pointer" : "") +
                    (bad_map ? ", a physical map without entries" : "") +
                    (to < 0 || to + num_tokens > max_rows_
                       ? ", rows [" + std::to_string(to) + ", " + std::to_string(to + num_tokens) +
                           ") of D, outside [0, max_tokens_per_step = " + std::to_string(max_rows_) + ")"
                       : std::string{})};
    }
    if (num_tokens == 0) { return; }
    note_rows_written(to + num_tokens);
    const auto items = static_cast<std::int32_t>(num_tokens * top_k_);
    // rows from `to` on: the same mapping over a base moved to row `to` (its strides do not depend
    // on where the rows start)
    const buffer_mdspan<Index, Layout> target =
      to == 0 ? whole()
              : buffer_mdspan<Index, Layout>{&whole()(0, static_cast<std::int32_t>(to), 0), layers_.num_layers(),
                                            static_cast<std::int32_t>(max_rows_), top_k_};
    const detail::capture_layer<Index, Layout, Source> kernel{target,
                                                              Backend::data(capture_status_),
                                                              topk_ids + options.source_row_offset * stride,
                                                              stride,
                                                              options.physical_to_logical,
                                                              options.num_physical_experts,
                                                              num_experts_,
                                                              slot,
                                                              top_k_,
                                                              items,
                                                              options.report_invalid_ids};
    // a dependent launch: the router output it reads is the previous kernel's
    if (options.device_row_span != nullptr) {
      Backend::launch_dependent_async(detail::blocks_for(items), detail::kernel_block_threads,
                                      detail::capture_layer_span<Index, Layout, Source>{kernel, options.device_row_span},
                                      stream);
    } else {
      Backend::launch_dependent_async(detail::blocks_for(items), detail::kernel_block_threads, kernel, stream);
    }
  }

  /// @brief (b) The [num_rows, K] slab of D for a model layer, for kernels that write routing
  /// themselves. Nothing checks the write; the end-of-step kernel does.
  /// @throws error unknown_layer, too_many_tokens, invalid_argument
  [[nodiscard]] layer_view_type layer_view(std::int32_t model_layer, std::int64_t num_rows)
  {
    const std::int32_t slot = layers_.slot(model_layer);
    check_rows_argument(num_rows, "layer_view");
    note_rows_written(num_rows);
    Index* base = &whole()(slot, 0, 0);
    if constexpr (layout_traits<Layout>::token_rows_contiguous) {
      using extents = cuda::std::dextents<std::int64_t, 2>;
      using mapping = typename cuda::std::layout_stride::template mapping<extents>;
      return layer_view_type{
        base, mapping{extents{num_rows, top_k_}, cuda::std::array<std::int64_t, 2>{row_elems_, 1}}};
    } else {
      return layer_view_type{base, num_rows, top_k_};
    }
  }

  /// @brief (c) A device reference whose record() an engine's own top-k kernel calls inline;
  /// `num_rows` bounds the rows it may write.
  /// @throws error too_many_tokens, invalid_argument
  [[nodiscard]] ref_type ref(std::int64_t num_rows)
  {
    check_rows_argument(num_rows, "ref");
    note_rows_written(num_rows);
    return make_ref(num_rows);
  }

  /// @brief A step opens: rows that capture paths were handed while no step was open (graph
  /// recording, warm-up) are reset on `compute` before the forward, with what they reported, so
  /// they can never pass for this step's. `num_rows` is the step's N.
  void begin_step(std::int64_t num_rows, stream_ref compute)
  {
    if (dirty_outside_steps_) { reset_rows(std::max(rows_outside_steps_, num_rows), compute); }
    rows_this_step_ = 0;
    in_step_        = true;
  }

  /// @brief The step closes: one kernel on `compute` checks rows [0, num_rows) into `status`,
  /// snapshots them token-major into `snapshot` ([num_rows, L, K]) and resets every row a capture
  /// path may have written (at least `padded_rows` when declared, else every row handed out outside
  /// a step), so the next forward may write D as soon as it has run. `merge` writes rows kept
  /// outside D into it first, in the same kernel (detail::harvest_rows); by default none.
  template <class Merge = detail::no_merge>
  void end_step(Index* snapshot,
                detail::step_status* status,
                std::int64_t num_rows,
                std::int64_t padded_rows,
                stream_ref compute,
                const Merge& merge = {})
  {
    in_step_                      = false;
    const std::int64_t replayed   = padded_rows >= 0 ? padded_rows : rows_outside_steps_;
    // a step without rows still runs the kernel (one block): its thread 0 moves what the capture
    // paths reported during the step into the step's status
    const std::int64_t reset_rows =
      std::max({num_rows, rows_this_step_, replayed, static_cast<std::int64_t>(merge.rows()), std::int64_t{0}});
    // cells of K ids move as the widest word that divides them and that both D and the snapshot
    // start on (a cell's offset is a whole number of cells, so the word fits every cell then)
    const std::size_t cell_bytes = static_cast<std::size_t>(top_k_) * sizeof(Index);
    const auto bases = reinterpret_cast<std::uintptr_t>(Backend::data(buffer_)) | reinterpret_cast<std::uintptr_t>(snapshot);
    const auto fits  = [&](std::size_t word) { return (cell_bytes | bases) % word == 0; };
    try {
      if (fits(sizeof(detail::word16))) {
        harvest<detail::word16>(snapshot, status, num_rows, reset_rows, compute, merge);
      } else if (fits(sizeof(std::uint64_t))) {
        harvest<std::uint64_t>(snapshot, status, num_rows, reset_rows, compute, merge);
      } else {
        harvest<Index>(snapshot, status, num_rows, reset_rows, compute, merge);
      }
    } catch (...) {
      // the kernel never ran: D and what capture paths reported still hold this step's, so the
      // next step resets them first, as it does for rows written outside a step
      rows_outside_steps_  = std::max(rows_outside_steps_, reset_rows);
      dirty_outside_steps_ = true;
      throw;
    }
  }

  /// @brief As end_step(), with the caller's end-of-step kernel: `launch(buffer, capture_status,
  /// reset_rows)` must enqueue on the compute stream one kernel that reads rows [0, num_rows) of `buffer`,
  /// moves what `capture_status` (device memory) holds into its own report and zeroes it, and resets
  /// rows [0, reset_rows) of every layer to the sentinel. `reset_rows` covers every row a capture
  /// path may have written, as for end_step().
  template <class Launch>
  void end_step_with(std::int64_t num_rows, std::int64_t padded_rows, Launch&& launch)
  {
    in_step_                    = false;
    const std::int64_t replayed = padded_rows >= 0 ? padded_rows : rows_outside_steps_;
    const std::int64_t reset_rows = std::max({num_rows, rows_this_step_, replayed, std::int64_t{0}});
    try {
      launch(whole(), Backend::data(capture_status_), reset_rows);
    } catch (...) {
      rows_outside_steps_  = std::max(rows_outside_steps_, reset_rows);  // as in end_step()
      dirty_outside_steps_ = true;
      throw;
    }
  }

  /// @brief Whether a step is open (begin_step() without end_step() since).
  [[nodiscard]] bool in_step() const noexcept { return in_step_; }
  /// @brief Whether rows were written outside a step since the last reset (begin_step() resets them).
  [[nodiscard]] bool dirty_outside_steps() const noexcept { return dirty_outside_steps_; }

  /// @brief Resets every row capture paths may have written (N_max at least) and what they
  /// reported, on `stream`; for a forward replayed outside any step.
  void reset(stream_ref stream) { reset_rows(std::max(rows_outside_steps_, max_rows_), stream); }

  /// @brief D as an mdspan (layer slot, row, column), for kernels that merge rows captured on other
  /// ranks into it before the end of the step (pipeline parallel).
  [[nodiscard]] buffer_mdspan<Index, Layout> whole() noexcept
  {
    return buffer_mdspan<Index, Layout>{Backend::data(buffer_), layers_.num_layers(),
                                        static_cast<std::int32_t>(max_rows_), top_k_};
  }

 private:
  [[nodiscard]] ref_type make_ref(std::int64_t num_rows) noexcept
  {
    return ref_type{whole(), static_cast<std::int32_t>(num_rows), num_experts_,
                    Backend::data(capture_status_)};
  }

  template <class Word, class Merge>
  void harvest(Index* snapshot,
               detail::step_status* status,
               std::int64_t num_rows,
               std::int64_t reset_rows,
               stream_ref compute,
               const Merge& merge)
  {
    // rows of one layer that fill a 32-byte sector together
    const auto cell_bytes      = static_cast<std::int32_t>(static_cast<std::size_t>(top_k_) * sizeof(Index));
    const std::int32_t grouped = std::max(1, 32 / cell_bytes);
    const detail::harvest_rows<Index, Layout, Word, Merge> kernel{whole(),
                                                                  snapshot,
                                                                  status,
                                                                  Backend::data(capture_status_),
                                                                  num_experts_,
                                                                  static_cast<std::int32_t>(num_rows),
                                                                  static_cast<std::int32_t>(reset_rows),
                                                                  grouped,
                                                                  merge};
    Backend::launch_async(std::max(1, detail::blocks_for(kernel.num_items())), detail::kernel_block_threads, kernel,
                          compute);
  }

  void check_rows_argument(std::int64_t num_rows, const char* what) const
  {
    if (num_rows < 0) {
      throw error{errc::invalid_argument, std::string{what} + ": negative row count " + std::to_string(num_rows)};
    }
    if (num_rows > max_rows_) {
      throw error{errc::too_many_tokens, std::string{what} + ": " + std::to_string(num_rows) +
                                           " rows, outside [0, max_tokens_per_step = " +
                                           std::to_string(max_rows_) + "]"};
    }
  }

  // Rows handed out while no step is open (CUDA-graph recording, warm-up forwards) are written by
  // later replays that the host never sees: they count for every step unless a plan declares its
  // padded rows.
  void note_rows_written(std::int64_t num_rows) noexcept
  {
    if (in_step_) {
      rows_this_step_ = std::max(rows_this_step_, num_rows);
    } else {
      rows_outside_steps_  = std::max(rows_outside_steps_, num_rows);
      dirty_outside_steps_ = true;
    }
  }

  // Fills rows [0, rows) of every layer of D with the sentinel and forgets what capture paths
  // reported, on `stream`.
  void reset_rows(std::int64_t rows, stream_ref stream)
  {
    const std::size_t k_bytes = static_cast<std::size_t>(top_k_) * sizeof(Index);
    Index* d                  = Backend::data(buffer_);
    if constexpr (layout_traits<Layout>::token_rows_contiguous) {
      const std::size_t bytes = static_cast<std::size_t>(rows * row_elems_) * sizeof(Index);
      Backend::fill_2d_async(d, bytes, traits::sentinel_byte, bytes, 1, stream);
    } else {
      Backend::fill_2d_async(d, static_cast<std::size_t>(max_rows_) * k_bytes, traits::sentinel_byte,
                             static_cast<std::size_t>(rows) * k_bytes,
                             static_cast<std::size_t>(layers_.num_layers()), stream);
    }
    constexpr std::size_t status_bytes = sizeof(detail::step_status);
    Backend::fill_2d_async(Backend::data(capture_status_), status_bytes, 0, status_bytes, 1, stream);
    dirty_outside_steps_ = false;
  }

  layer_map layers_;
  std::int64_t num_experts_;
  std::int32_t top_k_;
  std::int64_t source_stride_;  // K + num_fused_shared_experts
  std::int64_t max_rows_;       // N_max
  std::int64_t row_elems_;      // L * K
  typename Backend::template device_vector<Index> buffer_;                        // D
  typename Backend::template device_vector<detail::step_status> capture_status_;  // reported in a forward
  std::int64_t rows_this_step_     = 0;  // rows capture paths were handed in the open step
  std::int64_t rows_outside_steps_ = 0;  // most rows handed out while no step was open
  bool dirty_outside_steps_        = false;
  bool in_step_                    = false;
};

}  // namespace routing_replay
