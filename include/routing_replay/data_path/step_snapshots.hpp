/// @file
/// Step snapshots: the device side of an engine that hands each step's routing out as it finishes
/// (vLLM 0.33's routed-experts capturer and its output copy). Captures go into a token-major
/// capture_buffer; at the end of a step one kernel on the compute stream checks the step's rows,
/// writes them into a ring slot's device snapshot in the output type and resets D; later, on the
/// output copy stream, one copy moves the snapshot (and the step's status) to host memory and an
/// event marks it. The compute stream never waits for a copy: a slot is reused by a harvest that
/// waits (on the device) for the slot's previous copy.
#pragma once

#include <routing_replay/backend.hpp>
#include <routing_replay/buffer_layout.hpp>
#include <routing_replay/config.hpp>
#include <routing_replay/data_path/capture_buffer.hpp>
#include <routing_replay/detail/snapshot_kernels.hpp>
#include <routing_replay/detail/step_status.hpp>
#include <routing_replay/detail/validate_config.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/host_backend.hpp>
#include <routing_replay/index_type.hpp>
#include <routing_replay/layer_map.hpp>

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

namespace routing_replay {

/// @brief D (token-major `Index`), its capture paths, and a ring of device snapshots of `Out`.
///
/// Layers are addressed by their index in [0, L). A layer never captured since construction is a
/// layer the model does not route (dense): its ids read as 0. A captured layer that leaves a row of
/// a step unwritten fails that step (status().unwritten), as does an id outside [0, E)
/// (status().invalid_id). Not thread-safe; every call takes its stream explicitly.
template <backend Backend, expert_index Index, class Out>
class step_snapshots {
  static_assert(sizeof(Out) <= sizeof(Index), "the output type is as wide as the index type or narrower");

 public:
  /// @brief Stream handle of the backend.
  using stream_ref = typename Backend::stream_ref;

  /// @brief D for `max_rows` rows of `num_layers` x `top_k` ids of `num_experts` experts, and
  /// `ring_depth` snapshots (at least the steps in flight at once).
  /// @throws error invalid_config, index_type_too_narrow
  step_snapshots(std::int32_t num_layers, std::int32_t top_k, std::int32_t num_experts, std::int32_t max_rows,
                 std::int32_t ring_depth)
    : config_(make_config(num_layers, top_k, num_experts, max_rows)),
      layers_(config_),
      buffer_(config_, layers_),
      row_elems_(static_cast<std::int64_t>(num_layers) * top_k),
      depth_(ring_depth > 0 ? ring_depth : 1),
      slot_elems_(slot_elems(max_rows, row_elems_)),
      snapshots_(static_cast<std::size_t>(depth_) * slot_elems_),
      statuses_(static_cast<std::size_t>(depth_)),
      host_statuses_(static_cast<std::size_t>(depth_)),
      harvested_(static_cast<std::size_t>(depth_)),
      copied_(static_cast<std::size_t>(depth_)),
      slot_state_(static_cast<std::size_t>(depth_))
  {
  }

  /// @brief L.
  [[nodiscard]] std::int32_t num_layers() const noexcept { return layers_.num_layers(); }
  /// @brief Ids of one row (L * K).
  [[nodiscard]] std::int64_t row_elems() const noexcept { return row_elems_; }
  /// @brief N_max.
  [[nodiscard]] std::int32_t max_rows() const noexcept { return config_.max_tokens_per_step; }
  /// @brief Ring slots.
  [[nodiscard]] std::int32_t ring_depth() const noexcept { return depth_; }
  /// @brief Bytes of D.
  [[nodiscard]] std::size_t device_bytes() const noexcept { return buffer_.bytes(); }
  /// @brief Bytes of the snapshots.
  [[nodiscard]] std::size_t snapshot_bytes() const noexcept { return snapshots_.size() * sizeof(Out); }
  /// @brief The layers captured so far.
  [[nodiscard]] const detail::captured_layers& captured() const noexcept { return captured_; }

  /// @brief A layer's router output into D (capture_buffer::capture(); `layer` in [0, L)).
  template <source_index Source>
  void capture(std::int32_t layer, const Source* ids, std::int64_t num_tokens, stream_ref stream,
               const capture_options& options = {})
  {
    buffer_.capture(layer, ids, num_tokens, stream, options);
    captured_.add(layer);
  }

  /// @brief A step's forward is about to be enqueued on `compute`: rows written outside steps
  /// (warm-up, graph recording) are reset first. A step still open (never harvested) is closed
  /// with its rows reset and its reports dropped.
  void open_step(stream_ref compute)
  {
    if (buffer_.in_step()) {
      buffer_.end_step_with(0, -1, [&](auto d, detail::step_status* reports, std::int64_t reset_rows) {
        launch(make_kernel(d, nullptr, nullptr, reports, 0, reset_rows), compute);
      });
    }
    buffer_.begin_step(0, compute);
  }

  /// @brief Whether the kernels of this backend write host memory as they write device memory (the
  /// host backend): harvest() can then put a step's rows where copy_to_host() would have copied them.
  static constexpr bool kernels_write_host = std::is_same_v<Backend, host_backend>;

  /// @brief The step's forward is enqueued on `compute`: one kernel checks rows [0, num_rows),
  /// snapshots them into the next ring slot and resets D. Waits (on the device) for that slot's
  /// previous copy. `padded_rows` as step_plan::set_padded_rows() (-1: unknown). `host_rows`, where
  /// copy_to_host() will put the rows: with kernels_write_host the kernel writes them there at once
  /// and copy_to_host() then moves only the status (one pass over the rows fewer).
  /// @return the ring slot
  /// @throws error too_many_tokens
  std::int32_t harvest(std::int64_t num_rows, stream_ref compute, std::int64_t padded_rows = -1, Out* host_rows = nullptr)
  {
    if (num_rows < 0 || num_rows > max_rows()) {
      throw error{errc::too_many_tokens, "harvest: " + std::to_string(num_rows) + " rows, outside [0, max_tokens_per_step = " +
                                           std::to_string(max_rows()) + "]"};
    }
    const std::int32_t slot = next_slot_;
    slot_record& record     = slot_state_[static_cast<std::size_t>(slot)];
    if (record.copy_recorded) { Backend::wait(compute, copied_[static_cast<std::size_t>(slot)]); }
    if (record.status_dirty) {  // a harvest whose copy never came left its reports
      Backend::fill_2d_async(status_device(slot), sizeof(detail::step_status), 0, sizeof(detail::step_status), 1, compute);
    }
    // the kernel's device form moves whole words of D and of the ring slot, which must be aligned
    // for them; checked on every backend and in direct mode too, so that the host backend fails
    // where a GPU would fault
    detail::require_word_aligned<detail::word16>(buffer_.whole().data_handle());
    detail::require_word_aligned<typename detail::harvest_token_rows<Index, Out>::out_word>(snapshot(slot));
    const bool direct = kernels_write_host && host_rows != nullptr;
    Out* into         = direct ? host_rows : snapshot(slot);
    buffer_.end_step_with(num_rows, padded_rows, [&](auto d, detail::step_status* reports, std::int64_t reset_rows) {
      launch(make_kernel(d, into, status_device(slot), reports, num_rows, reset_rows), compute);
    });
    Backend::record(harvested_[static_cast<std::size_t>(slot)], compute);
    record.status_dirty = true;
    record.rows         = num_rows;
    record.direct       = direct;
    next_slot_          = (slot + 1) % depth_;
    return slot;
  }

  /// @brief On `copy`: the slot's rows (as many as harvested) into `host` (pinned for the CUDA
  /// backend; the harvest's `host_rows`, where it wrote them already) and its status into host
  /// memory, then an event. Waits (on the device) for the harvest.
  void copy_to_host(std::int32_t slot, Out* host, stream_ref copy)
  {
    slot_record& record = slot_state_[static_cast<std::size_t>(slot)];
    Backend::wait(copy, harvested_[static_cast<std::size_t>(slot)]);
    if (!record.direct) {
      Backend::copy_async(host, snapshot(slot), static_cast<std::size_t>(record.rows * row_elems_) * sizeof(Out), copy);
    }
    Backend::copy_async(Backend::data(host_statuses_) + slot, status_device(slot), sizeof(detail::step_status), copy);
    Backend::fill_2d_async(status_device(slot), sizeof(detail::step_status), 0, sizeof(detail::step_status), 1, copy);
    Backend::record(copied_[static_cast<std::size_t>(slot)], copy);
    record.copy_recorded = true;
    record.status_dirty  = false;
  }

  /// @brief Blocks until the slot's copy is done; then status() holds the step's problems.
  void wait(std::int32_t slot) { Backend::synchronize(copied_[static_cast<std::size_t>(slot)]); }
  /// @brief Whether the slot's copy is done.
  [[nodiscard]] bool ready(std::int32_t slot) const { return Backend::ready(copied_[static_cast<std::size_t>(slot)]); }
  /// @brief What the slot's step reported (after wait()).
  [[nodiscard]] const detail::step_status& status(std::int32_t slot) const noexcept
  {
    return host_statuses_[static_cast<std::size_t>(slot)];
  }
  /// @brief Rows the slot's step harvested.
  [[nodiscard]] std::int64_t rows(std::int32_t slot) const noexcept { return slot_state_[static_cast<std::size_t>(slot)].rows; }

 private:
  struct slot_record {
    bool copy_recorded = false;  // copied_ was recorded at least once
    bool status_dirty  = false;  // the device status holds a harvest's reports not yet copied and zeroed
    bool direct        = false;  // the harvest wrote the rows to host memory itself
    std::int64_t rows  = 0;
  };

  static replay_config make_config(std::int32_t num_layers, std::int32_t top_k, std::int32_t num_experts, std::int32_t max_rows)
  {
    replay_config c;
    c.num_experts         = num_experts;
    c.top_k               = top_k;
    c.max_tokens_per_step = max_rows;
    c.max_model_len       = 1;
    c.moe_layers.resize(static_cast<std::size_t>(num_layers > 0 ? num_layers : 0));
    std::iota(c.moe_layers.begin(), c.moe_layers.end(), 0);
    return detail::validated_config<Index>(std::move(c));
  }

  // Ids of a ring slot: N_max rows, rounded up to whole 16-byte words so that every slot starts
  // where a word may (the kernel stores words of up to 16 bytes from a slot's start; a slot of 8
  // rows of 3 uint8 ids, 24 bytes, would put the next one 8 bytes off). At most 15 bytes a slot.
  static std::size_t slot_elems(std::int32_t max_rows, std::int64_t row_elems) noexcept
  {
    constexpr std::size_t per_word = sizeof(detail::word16) / sizeof(Out);
    const std::size_t rows_elems   = static_cast<std::size_t>(max_rows > 0 ? max_rows : 0) * static_cast<std::size_t>(row_elems);
    return (rows_elems + per_word - 1) / per_word * per_word;
  }

  [[nodiscard]] Out* snapshot(std::int32_t slot) noexcept
  {
    return Backend::data(snapshots_) + static_cast<std::size_t>(slot) * slot_elems_;
  }
  [[nodiscard]] detail::step_status* status_device(std::int32_t slot) noexcept { return Backend::data(statuses_) + slot; }

  template <class Mdspan>
  [[nodiscard]] detail::harvest_token_rows<Index, Out> make_kernel(Mdspan d, Out* into, detail::step_status* status,
                                                                    detail::step_status* reports, std::int64_t rows,
                                                                    std::int64_t reset_rows) const noexcept
  {
    return {d.data_handle(), into, status, reports, config_.num_experts, layers_.num_layers(), config_.top_k,
            rows * row_elems_, reset_rows * row_elems_, captured_};
  }

  static void launch(const detail::harvest_token_rows<Index, Out>& kernel, stream_ref stream)
  {
    if constexpr (std::is_same_v<Backend, host_backend>) {
      stream.queue().enqueue([kernel] { kernel.run_on_host(); });  // one vectorized pass, not a loop of threads
    } else {
      Backend::launch_async(detail::blocks_for(kernel.num_items()), detail::kernel_block_threads, kernel, stream);
    }
  }

  replay_config config_;
  layer_map layers_;
  capture_buffer<Backend, Index, token_major> buffer_;
  std::int64_t row_elems_;
  std::int32_t depth_;
  std::size_t slot_elems_;                                                      // N_max * L * K, rounded up to 16 bytes
  typename Backend::template device_vector<Out> snapshots_;                     // [depth][N_max, L, K], slot_elems_ apart
  typename Backend::template device_vector<detail::step_status> statuses_;      // per slot, on the device
  typename Backend::template pinned_vector<detail::step_status> host_statuses_; // per slot, copied back
  std::vector<typename Backend::event> harvested_;
  std::vector<typename Backend::event> copied_;
  std::vector<slot_record> slot_state_;
  std::int32_t next_slot_ = 0;
  detail::captured_layers captured_;
};

}  // namespace routing_replay
