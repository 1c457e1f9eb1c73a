/// @file
/// Step snapshots: the device side of an engine that hands each step's routing out as it finishes
/// (vLLM 0.33's routed-experts capturer and its output copy). Captures go into a token-major
/// capture_buffer; at the end of a step one kernel on the compute stream checks the step's rows,
/// writes them in the output type and resets D. A small step's rows go straight into the caller's
/// pinned host memory from that kernel (no copy, no call on the output stream), and its last block
/// sets a word of pinned memory that tells the host they are there without a driver call; a larger
/// step's go into a ring slot's device snapshot, and later, on the output copy stream, one copy
/// moves them to host memory and an event marks it. The step's status (what the device found
/// wrong) stays on the device unless the kernel flagged a report in a word of pinned memory: a
/// clean step costs no status copy and no reset. The compute stream never waits for a copy it has
/// not seen finish.
#pragma once

#include <routing_replay/backend.hpp>
#include <routing_replay/buffer_layout.hpp>
#include <routing_replay/config.hpp>
#include <routing_replay/data_path/capture_buffer.hpp>
#include <routing_replay/detail/data_path/snapshot_kernels.hpp>
#include <routing_replay/detail/step_status.hpp>
#include <routing_replay/detail/validate_config.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/host_backend.hpp>
#include <routing_replay/index_type.hpp>
#include <routing_replay/layer_map.hpp>

#include <cuda/atomic>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
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
      reported_(static_cast<std::size_t>(depth_)),
      landed_(static_cast<std::size_t>(depth_)),
      arrivals_(static_cast<std::size_t>(depth_)),
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

  /// @brief Whether open_step() would enqueue work (and so needs its stream): rows were written
  /// outside a step, or a step is still open.
  [[nodiscard]] bool open_step_enqueues() const noexcept { return buffer_.in_step() || buffer_.dirty_outside_steps(); }

  /// @brief Whether the kernels of this backend write host memory as they write device memory (the
  /// host backend): every harvest given host memory then writes the rows there.
  static constexpr bool kernels_write_host = std::is_same_v<Backend, host_backend>;

  /// @brief Steps of at most this many bytes of rows are written by the end-of-step kernel straight
  /// into the host memory harvest() is given: over PCIe that costs the compute stream a few
  /// microseconds at this size, where the copy it replaces costs the host three calls on the output
  /// stream. Larger steps go through the device snapshot and copy_to_host(), which leave the compute
  /// stream at device-memory speed.
  static constexpr std::size_t default_direct_write_bytes = std::size_t{128} << 10;

  /// @brief Sets the largest step (bytes of rows) harvest() writes straight into host memory; 0:
  /// none (on the host backend every step given host memory is written there in any case).
  void set_direct_write_bytes(std::size_t bytes) noexcept { direct_write_bytes_ = bytes; }
  /// @brief The largest step harvest() writes straight into host memory.
  [[nodiscard]] std::size_t direct_write_bytes() const noexcept { return direct_write_bytes_; }

  /// @brief The step's forward is enqueued on `compute`: one kernel checks rows [0, num_rows),
  /// writes them and resets D. `padded_rows` as step_plan::set_padded_rows() (-1: unknown).
  /// `host_rows` (from Backend::allocate_pinned, or null) is where copy_to_host() would put the
  /// rows: where the step is small enough (direct_write_bytes(); any size on the host backend) the
  /// kernel writes them there itself and copy_to_host() enqueues nothing; otherwise the kernel
  /// writes the next ring slot's snapshot, after waiting (on the device) for that slot's previous
  /// copy where the host has not seen it finish.
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
    const auto row_bytes    = static_cast<std::size_t>(num_rows * row_elems_) * sizeof(Out);
    const bool direct       = host_rows != nullptr && (kernels_write_host || row_bytes <= direct_write_bytes_);
    if (!direct && record.copy_unseen) { Backend::wait(compute, copied_[static_cast<std::size_t>(slot)]); }
    if (record.reports_unread) {  // a harvest never waited for may have left reports on the device
      // its flag stays: wait() then reads the status back, which holds this step's reports alone
      Backend::fill_2d_async(status_device(slot), sizeof(detail::step_status), 0, sizeof(detail::step_status), 1, compute);
    }
    // the kernel's device form moves whole words of D and of what it writes, which must be aligned
    // for them; checked on every backend, so that the host backend fails where a GPU would fault
    Out* into = direct ? host_rows : snapshot(slot);
    detail::require_word_aligned<detail::word16>(buffer_.whole().data_handle());
    detail::require_word_aligned<typename detail::harvest_token_rows<Index, Out>::out_word>(into);
    if (direct && ++record.sequence == 0) { record.sequence = 1; }  // 0: the word's value before any harvest
    buffer_.end_step_with(num_rows, padded_rows, [&](auto d, detail::step_status* reports, std::int64_t reset_rows) {
      auto kernel = make_kernel(d, into, status_device(slot), reports, num_rows, reset_rows, &reported_word(slot));
      if (direct) {  // the rows land in host memory: the kernel says so in a word the host can read
        kernel.landed   = &landed_word(slot);
        kernel.arrivals = Backend::data(arrivals_) + slot;
        kernel.sequence = record.sequence;
      }
      launch(kernel, compute);
    });
    // for copy_to_host() and blocking waits; a direct harvest's word does both jobs where a fault is
    // reported by every later driver call (see wait()), sparing a driver call in every small step
    if (!direct || kernels_write_host) { Backend::record(harvested_[static_cast<std::size_t>(slot)], compute); }
    record.reports_unread = true;
    record.copied         = false;
    record.rows           = num_rows;
    record.direct         = direct;
    next_slot_            = (slot + 1) % depth_;
    return slot;
  }

  /// @brief On `copy`: the slot's rows (as many as harvested) into `host` (pinned for the CUDA
  /// backend), then an event; waits (on the device) for the harvest. Nothing where the harvest wrote
  /// the rows into host memory itself (wrote_host()).
  void copy_to_host(std::int32_t slot, Out* host, stream_ref copy)
  {
    slot_record& record = slot_state_[static_cast<std::size_t>(slot)];
    if (record.direct) { return; }
    Backend::wait(copy, harvested_[static_cast<std::size_t>(slot)]);
    Backend::copy_async(host, snapshot(slot), static_cast<std::size_t>(record.rows * row_elems_) * sizeof(Out), copy);
    Backend::record(copied_[static_cast<std::size_t>(slot)], copy);
    record.copied      = true;
    record.copy_unseen = true;
  }

  /// @brief Whether the slot's harvest wrote its rows into host memory itself.
  [[nodiscard]] bool wrote_host(std::int32_t slot) const noexcept { return slot_state_[static_cast<std::size_t>(slot)].direct; }

  /// @brief Blocks until the slot's rows are in host memory (its copy, or its harvest where that
  /// wrote them: then the kernel's word of pinned memory says so, and no driver call is made once
  /// it has; on a device, such a harvest is waited for by polling that word); then status() holds
  /// the step's problems. Where the kernel flagged a report, the
  /// status is read back from the device and reset there first.
  void wait(std::int32_t slot)
  {
    slot_record& record = slot_state_[static_cast<std::size_t>(slot)];
    if (!landed(slot)) {
      if (waits_on_word(slot)) {
        wait_landed(slot);
      } else {
        Backend::synchronize(done_event(slot));
      }
    }
    if (record.copied) { record.copy_unseen = false; }  // a harvest's event says nothing of an older copy
    if (!record.reports_unread) { return; }
    record.reports_unread = false;
    if (reported_word(slot) == 0) {
      host_statuses_[static_cast<std::size_t>(slot)] = detail::step_status{};
      return;
    }
    fetch_status(slot);
  }
  /// @brief Whether the slot's rows are in host memory (for a harvest that wrote them there, one
  /// load of the kernel's word; otherwise an event query).
  [[nodiscard]] bool ready(std::int32_t slot) const
  {
    if (landed(slot)) { return true; }
    return !waits_on_word(slot) && Backend::ready(done_event(slot));
  }
  /// @brief What the slot's step reported (after wait()).
  [[nodiscard]] const detail::step_status& status(std::int32_t slot) const noexcept
  {
    return host_statuses_[static_cast<std::size_t>(slot)];
  }
  /// @brief Rows the slot's step harvested.
  [[nodiscard]] std::int64_t rows(std::int32_t slot) const noexcept { return slot_state_[static_cast<std::size_t>(slot)].rows; }

 private:
  struct slot_record {
    bool copy_unseen    = false;  // copied_ was recorded and no wait() has seen it finish since
    bool copied         = false;  // copy_to_host() enqueued the copy of the slot's last harvest
    bool reports_unread = false;  // the last harvest's reports (if any) are still on the device
    bool direct         = false;  // the harvest wrote the rows to host memory itself
    std::uint32_t sequence = 0;   // the last direct harvest's number: its kernel sets landed_ to it
    std::int64_t rows   = 0;
  };

  // Whether the slot's last harvest wrote host memory and its kernel has said all of it is there
  // (a load of pinned memory, no call into the driver).
  [[nodiscard]] bool landed(std::int32_t slot) const noexcept
  {
    const slot_record& record = slot_state_[static_cast<std::size_t>(slot)];
    if (!record.direct) { return false; }
    auto& word = const_cast<std::uint32_t&>(Backend::data(landed_)[slot]);  // written by the device
    return cuda::atomic_ref<std::uint32_t, cuda::thread_scope_system>{word}.load(cuda::std::memory_order_acquire) ==
           record.sequence;
  }

  // Whether the slot's last harvest was a direct one on a device: recorded by no event (harvest()),
  // so only the kernel's word says it is done.
  [[nodiscard]] bool waits_on_word(std::int32_t slot) const noexcept
  {
    return slot_state_[static_cast<std::size_t>(slot)].direct && !kernels_write_host;
  }

  // A direct harvest on a device, recorded by no event: polls its word. A kernel that faulted
  // never sets it, but leaves the context failed, which any driver call then reports: an event
  // query (of the slot's event, recorded or not) every so often throws it.
  void wait_landed(std::int32_t slot) const
  {
    for (std::uint32_t polls = 1; !landed(slot); ++polls) {
      if (polls % 256 == 0) { static_cast<void>(Backend::ready(harvested_[static_cast<std::size_t>(slot)])); }
      if (polls > 64) { std::this_thread::yield(); }
    }
  }

  [[nodiscard]] const typename Backend::event& done_event(std::int32_t slot) const noexcept
  {
    const slot_record& record = slot_state_[static_cast<std::size_t>(slot)];
    return record.copied ? copied_[static_cast<std::size_t>(slot)] : harvested_[static_cast<std::size_t>(slot)];
  }

  [[nodiscard]] std::uint32_t& reported_word(std::int32_t slot) noexcept { return Backend::data(reported_)[slot]; }
  [[nodiscard]] std::uint32_t& landed_word(std::int32_t slot) noexcept { return Backend::data(landed_)[slot]; }

  // The rare path: the kernel flagged a report, so the status comes back from the device (on a
  // stream of its own, made the first time; the harvest is known to be done) and is reset there.
  void fetch_status(std::int32_t slot)
  {
    if (!status_stream_) { status_stream_ = std::make_unique<typename Backend::stream>(); }
    const stream_ref s = status_stream_->ref();
    // the harvest is done: its event says so to this stream, or (a direct harvest, recorded by no
    // event on a device) the kernel's release of its word, which the host acquired, made every
    // store of the kernel visible at system scope, this stream's copy included
    if (!waits_on_word(slot)) { Backend::wait(s, harvested_[static_cast<std::size_t>(slot)]); }
    Backend::copy_async(Backend::data(host_statuses_) + slot, status_device(slot), sizeof(detail::step_status), s);
    Backend::fill_2d_async(status_device(slot), sizeof(detail::step_status), 0, sizeof(detail::step_status), 1, s);
    Backend::synchronize(s);
    reported_word(slot) = 0;
  }

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
                                                                    std::int64_t reset_rows,
                                                                    std::uint32_t* reported = nullptr) const noexcept
  {
    return {d.data_handle(), into, status, reports, config_.num_experts, layers_.num_layers(), config_.top_k,
            rows * row_elems_, reset_rows * row_elems_, captured_, reported};
  }

  static void launch(const detail::harvest_token_rows<Index, Out>& kernel, stream_ref stream)
  {
    if constexpr (std::is_same_v<Backend, host_backend>) {
      stream.queue().enqueue([kernel] { kernel.run_on_host(); });  // one vectorized pass, not a loop of threads
    } else {
      Backend::launch_async(kernel.num_blocks(), detail::kernel_block_threads, kernel, stream);  // block_done() counts as many
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
  typename Backend::template pinned_vector<detail::step_status> host_statuses_; // per slot, read back
  typename Backend::template pinned_vector<std::uint32_t> reported_;            // per slot: the kernel's report flag
  typename Backend::template pinned_vector<std::uint32_t> landed_;              // per slot: the number of its last direct harvest done
  typename Backend::template device_vector<std::uint32_t> arrivals_;            // per slot: blocks of its kernel done
  std::unique_ptr<typename Backend::stream> status_stream_;                     // made on the first report
  std::vector<typename Backend::event> harvested_;
  std::vector<typename Backend::event> copied_;
  std::vector<slot_record> slot_state_;
  std::int32_t next_slot_ = 0;
  std::size_t direct_write_bytes_ = default_direct_write_bytes;
  detail::captured_layers captured_;
};

}  // namespace routing_replay
