/// @file
/// Rows stored at KV-cache slots that only the device knows: the engine hands each step's slots as a
/// device array (SGLang's `out_cache_loc`), and a kernel writes every row straight into a pinned,
/// device-mapped host pool indexed by slot. The host never sees the slots of a step: an end of step
/// costs one launch and one event record for a small step (the end-of-step kernel stores the rows
/// itself), two launches and one or two event records for a larger one, never a wait.
#pragma once

#include <routing_replay/backend.hpp>
#include <routing_replay/buffer_layout.hpp>
#include <routing_replay/data_path/capture_buffer.hpp>
#include <routing_replay/detail/slot_rows/slot_rows_errors.hpp>
#include <routing_replay/detail/slot_rows/slot_rows_kernels.hpp>
#include <routing_replay/detail/slot_rows/slot_rows_reader.hpp>
#include <routing_replay/detail/slot_rows/slot_rows_store.hpp>
#include <routing_replay/detail/validate_config.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/index_type.hpp>
#include <routing_replay/slot_rows_config.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <vector>

namespace routing_replay {

/// @brief A step's rows, captured into the device buffer D during the forward, stored at the KV slots
/// the device holds, in a pinned host pool `[num_slots, L, K]` of `Index` that a kernel writes.
///
/// Each step: captures write D (capture(), layer_view(), ref()); end_step(slots, N, compute)
/// enqueues, on `compute`, the end-of-step kernel that checks rows [0, N), snapshots them and the
/// step's slots (the engine may reuse its array at once) and resets D, and then the scatter (on a
/// side stream after an event, or on `compute`) that writes each row at its slot and publishes the
/// step's status; a step of at most slot_rows_config::fused_scatter_max_rows rows is checked,
/// stored and published by the end-of-step kernel alone. Nothing waits. A step is retired when the
/// host sees its scatter done (poll(), wait()); a failed step (an invalid id, a row of a
/// captured layer left unwritten, a slot outside the pool) left the sentinel at its slots, and its
/// error is thrown once by throw_failure().
///
/// A layer no capture path was ever handed (a dense layer in a pool sized for every layer) is not
/// checked and reads as slot_read_options::uncaptured_value; once a layer has been handed to a
/// capture path, a row of it left unwritten is an error, and so is reading a row of it that no step
/// wrote. Not thread-safe: one thread drives it.
template <backend Backend, expert_index Index, buffer_layout Layout = layer_major>
class slot_rows {
  using traits = index_traits<Index>;
  using buffer_type = capture_buffer<Backend, Index, Layout>;

 public:
  /// @brief The stored id type.
  using index_type = Index;
  /// @brief Stream handle taken by every call that enqueues work.
  using stream_ref = typename Backend::stream_ref;
  /// @brief Trivially copyable device reference for an engine's own top-k kernel.
  using ref_type = typename buffer_type::ref_type;
  /// @brief Per-layer [rows, K] view of D.
  using layer_view_type = typename buffer_type::layer_view_type;

  /// @brief Allocates D, the snapshots and the pool (filled with the sentinel, so pages are faulted
  /// in here, not in a step).
  /// @throws error invalid_config, index_type_too_narrow, unknown_layer
  explicit slot_rows(const slot_rows_config& config)
    : config_(validated(config)),
      buffer_(buffer_config(config_), layer_map{buffer_config(config_)}),
      reader_(config_.num_model_layers, config_.top_k, config_.num_slots, buffer_.layers()),
      row_elems_(static_cast<std::int64_t>(buffer_.layers().num_layers()) * config_.top_k),
      pool_bytes_(static_cast<std::size_t>(config_.num_slots * row_elems_) * sizeof(Index)),
      pool_(static_cast<Index*>(Backend::allocate_pinned(std::max<std::size_t>(pool_bytes_, 1))))
  {
    std::memset(static_cast<void*>(pool_), traits::sentinel_byte, pool_bytes_);
    reader_.attach(pool_);
    const auto rows = static_cast<std::size_t>(config_.max_tokens_per_step);
    for (std::int32_t i = 0; i < config_.steps_in_flight; ++i) {
      ring_.push_back(std::make_unique<place>(rows, static_cast<std::size_t>(row_elems_)));
    }
    buffer_.begin_step(0, side_.ref());  // steps are always open: every capture counts for the next end
  }

  slot_rows(const slot_rows&)            = delete;
  slot_rows& operator=(const slot_rows&) = delete;
  slot_rows(slot_rows&&)                 = delete;
  slot_rows& operator=(slot_rows&&)      = delete;

  /// @brief Waits for every step in flight (its kernels write the pool), then frees the pool.
  ~slot_rows()
  {
    for (auto& p : ring_) {
      if (p->in_flight) {
        try {
          Backend::synchronize(p->scattered);
        } catch (...) {  // reported by no one now; the memory must still outlive the kernel
        }
      }
    }
    Backend::free_pinned(pool_, std::max<std::size_t>(pool_bytes_, 1));
  }

  /// @brief Records a layer's router output (`num_tokens` rows of `source_row_stride` ids, the first
  /// K kept; 0: K + num_fused_shared_experts) into D: one small kernel on `stream`, CUDA-graph safe.
  /// An id outside [0, E) is stored as the sentinel, which the end of the step reports if its row is
  /// one of the step's (padding rows of a graph, which some routers mark with -1, are not).
  /// @throws error unknown_layer, too_many_tokens, invalid_argument
  template <source_index Source>
  void capture(std::int32_t model_layer, const Source* topk_ids, std::int64_t num_tokens, stream_ref stream,
               std::int64_t source_row_stride = 0)
  {
    capture_options options;
    options.source_row_stride  = source_row_stride;
    options.report_invalid_ids = false;
    buffer_.capture(model_layer, topk_ids, num_tokens, stream, options);
    reader_.mark_captured(buffer_.layers().slot(model_layer));
    // only a capture larger than every graph's so far can raise the padding a replay may write
    if (num_tokens > graph_rows_ && Backend::is_capturing(stream)) { graph_rows_ = num_tokens; }
  }

  /// @brief The [num_rows, K] slab of D for kernels that write a layer themselves.
  /// @throws error unknown_layer, too_many_tokens, invalid_argument
  [[nodiscard]] layer_view_type layer_view(std::int32_t model_layer, std::int64_t num_rows)
  {
    auto view = buffer_.layer_view(model_layer, num_rows);
    reader_.mark_captured(buffer_.layers().slot(model_layer));
    return view;
  }

  /// @brief A device reference for an engine's own top-k kernel; every layer counts as captured.
  /// @throws error too_many_tokens, invalid_argument
  [[nodiscard]] ref_type ref(std::int64_t num_rows)
  {
    auto r = buffer_.ref(num_rows);
    for (std::int32_t l = 0; l < buffer_.layers().num_layers(); ++l) { reader_.mark_captured(l); }
    return r;
  }

  /// @brief Ends the step of the forward just enqueued on `compute`: its `num_rows` rows go to the KV
  /// slots `slots[0, num_rows)` (device memory, read by the end-of-step kernel, so the engine may
  /// reuse it as soon as `compute` has run that kernel). Returns the step's serial (1, 2, ...).
  /// Waits only if every place for a step in flight is taken (for the oldest's scatter).
  /// @throws error too_many_tokens, invalid_argument; backend_error; a failure of the oldest step
  /// is not thrown here but kept for throw_failure()
  template <std::integral Slot>
  std::uint64_t end_step(const Slot* slots, std::int64_t num_rows, stream_ref compute,
                         const slot_step_options& options = {})
  {
    if (num_rows < 0 || num_rows > config_.max_tokens_per_step || (slots == nullptr && num_rows > 0)) {
      throw error{num_rows > config_.max_tokens_per_step ? errc::too_many_tokens : errc::invalid_argument,
                  "end_step: " + std::to_string(num_rows) + " rows" + (slots == nullptr ? " and no slots" : "") +
                    ", outside [0, max_tokens_per_step = " + std::to_string(config_.max_tokens_per_step) + "]"};
    }
    if (count_ == ring_.size()) { retire_oldest(true); }
    place& p = *ring_[head_];
    if (p.status_dirty) {  // a step that failed to run left its status unzeroed
      Backend::fill_2d_async(Backend::data(p.status), sizeof(detail::slot_step_status), 0,
                             sizeof(detail::slot_step_status), 1, compute);
      Backend::fill_2d_async(Backend::data(p.blocks_done), sizeof(unsigned int), 0, sizeof(unsigned int), 1, compute);
      p.status_dirty = false;
    }
    const std::int64_t padded = options.graph_replayed ? std::max(options.padded_rows, graph_rows_)
                                                       : std::max<std::int64_t>(options.padded_rows, 0);
    const bool fused = config_.fused_scatter_max_rows > 0 && num_rows <= config_.fused_scatter_max_rows;
    try {
      if (fused) {
        store_step(p, slots, num_rows, padded, compute);
      } else {
        detail::slot_step_status* status = Backend::data(p.status);
        const detail::copy_step_slots<Slot> merge{slots, Backend::data(p.slots), &status->bad_slot, config_.num_slots,
                                                  static_cast<std::int32_t>(num_rows), reader_.required_layers()};
        buffer_.end_step(Backend::data(p.snapshot), &status->rows, num_rows, padded, compute, merge);
      }
    } catch (...) {
      buffer_.begin_step(0, compute);  // resets what the step's captures wrote before the next one
      throw;
    }
    buffer_.begin_step(0, compute);
    p.serial    = ++serial_;
    p.num_rows  = static_cast<std::int32_t>(num_rows);
    p.in_flight = true;
    head_       = (head_ + 1) % ring_.size();
    ++count_;
    try {
      if (fused || config_.scatter_on_compute_stream) {
        if (!fused) { scatter(p, compute); }
        Backend::record(p.scattered, compute);
      } else {
        Backend::record(p.snapshot_taken, compute);
        Backend::wait(side_.ref(), p.snapshot_taken);
        scatter(p, side_.ref());
        Backend::record(p.scattered, side_.ref());
        last_side_ = &p;
      }
    } catch (const error& e) {
      // the step is in the ring: it fails when retired, and its place is zeroed before reuse
      p.status_dirty = true;
      p.launch_failure = e.what();
    }
    return p.serial;
  }

  /// @brief Retires, without blocking, every step whose scatter is done, oldest first. Returns the
  /// serial of the newest step retired so far.
  std::uint64_t poll()
  {
    while (count_ > 0 && retire_oldest(false)) {}
    return retired_through_;
  }

  /// @brief Retires every step up to `serial`, waiting for their scatters: their rows are in the pool.
  void wait(std::uint64_t serial)
  {
    while (count_ > 0 && ring_[tail()]->serial <= serial) { retire_oldest(true); }
  }

  /// @brief Throws, once, the error of the oldest failed step up to `serial` not thrown yet.
  /// @throws error slot_out_of_range, invalid_expert_id, invalid_argument, missing_routing, backend_error
  void throw_failure(std::uint64_t serial)
  {
    if (failures_.empty() || failures_.front().serial > serial) { return; }
    const error e = failures_.front().what;
    failures_.pop_front();
    throw e;
  }

  /// @brief Writes the rows at `slots` into `out` as [slots.size(), num_model_layers, K] of `Out`
  /// (widening), from the pool as it is: the engine first waits for the steps that may write them.
  /// @throws error slot_out_of_range, missing_routing (a captured layer without a row there)
  template <class Out, std::integral Slot>
  void read(std::span<const Slot> slots, Out* out, const slot_read_options& options = {}) const
  {
    reader_.read(slots, out, options);
  }

  /// @brief Writes base64 (RFC 4648, padded) of the little-endian bytes that read() with `Out` would
  /// write, straight into `chars` (base64_chars<Out>(slots.size()) of them), without the array.
  /// @throws as read()
  template <class Out, std::integral Slot>
  void read_base64(std::span<const Slot> slots, char* chars, const slot_read_options& options = {}) const
  {
    reader_.template read_base64<Out>(slots, chars, options);
  }

  /// @brief Hands the rows at `slots` over where they lie in the pool, without copying them, with
  /// the layers of run_layers() (ids K apart in a layer; see detail::slot_rows_reader::for_each_run),
  /// from the pool as it is: the engine first waits for the steps that may write them.
  /// @throws error slot_out_of_range, missing_routing (a row with routing for some layers only)
  template <std::integral Slot, class Rows, class Missing>
  void for_each_run(std::span<const Slot> slots, Rows&& rows, Missing&& missing, const slot_read_options& options = {}) const
  {
    reader_.for_each_run(slots, options, rows, missing);
  }
  /// @brief The model layers for_each_run() hands over, in order: those captured so far (all of the
  /// pool's while none is).
  [[nodiscard]] std::vector<std::int32_t> run_layers() const
  {
    std::vector<std::int32_t> model_layers;
    for (const std::int32_t s : reader_.run_layers()) { model_layers.push_back(buffer_.layers().model_layer(s)); }
    return model_layers;
  }

  /// @brief Characters of read_base64() for `rows` rows.
  template <class Out>
  [[nodiscard]] std::size_t base64_chars(std::int64_t rows) const noexcept
  {
    return reader_.template base64_chars<Out>(rows);
  }

  /// @brief Whether a capture path was ever handed model layer `model_layer` (false outside the map).
  [[nodiscard]] bool layer_captured(std::int32_t model_layer) const noexcept
  {
    return reader_.model_layer_captured(model_layer);
  }
  /// @brief The layer map of the pool.
  [[nodiscard]] const layer_map& layers() const noexcept { return buffer_.layers(); }
  /// @brief The validated configuration.
  [[nodiscard]] const slot_rows_config& config() const noexcept { return config_; }
  /// @brief The pool, [num_slots, L, K] (host addresses, written by kernels).
  [[nodiscard]] const Index* pool() const noexcept { return pool_; }
  /// @brief Pinned host bytes: the pool and the published statuses.
  [[nodiscard]] std::size_t pinned_bytes() const noexcept
  {
    return pool_bytes_ + ring_.size() * sizeof(detail::slot_step_status);
  }
  /// @brief Device bytes: D, and per step in flight its snapshot and slots.
  [[nodiscard]] std::size_t device_bytes() const noexcept
  {
    const auto rows = static_cast<std::size_t>(config_.max_tokens_per_step);
    return buffer_.bytes() + ring_.size() * rows * (static_cast<std::size_t>(row_elems_) * sizeof(Index) + 8);
  }
  /// @brief Steps ended and not retired yet.
  [[nodiscard]] std::size_t steps_in_flight() const noexcept { return count_; }
  /// @brief The serial of the newest step ended (0: none yet).
  [[nodiscard]] std::uint64_t last_step() const noexcept { return serial_; }

 private:
  // one step in flight: its snapshot of D, its slots, its status and the events that order the scatter
  struct place {
    place(std::size_t rows, std::size_t row_elems)
      : snapshot(rows * row_elems), slots(rows), status(1), blocks_done(1), published(1)
    {
    }
    typename Backend::template device_vector<Index> snapshot;
    typename Backend::template device_vector<std::int64_t> slots;
    typename Backend::template device_vector<detail::slot_step_status> status;
    typename Backend::template device_vector<unsigned int> blocks_done;
    typename Backend::template pinned_vector<detail::slot_step_status> published;
    typename Backend::event snapshot_taken;
    typename Backend::event scattered;
    std::uint64_t serial = 0;
    std::int32_t num_rows = 0;
    bool in_flight    = false;
    bool status_dirty = false;
    std::string launch_failure;  // the scatter was never enqueued
  };

  struct failed_step {
    std::uint64_t serial;
    error what;
  };

  [[nodiscard]] static slot_rows_config validated(slot_rows_config c)
  {
    auto fail = [](const std::string& what) { throw error{errc::invalid_config, "slot_rows: " + what}; };
    if (c.num_model_layers <= 0) { fail("num_model_layers must be > 0, got " + std::to_string(c.num_model_layers)); }
    if (c.layers.empty()) {
      c.layers.resize(static_cast<std::size_t>(c.num_model_layers));
      std::iota(c.layers.begin(), c.layers.end(), 0);
    }
    if (static_cast<std::int64_t>(c.layers.size()) > detail::max_slot_rows_layers) {
      fail("at most " + std::to_string(detail::max_slot_rows_layers) + " layers, got " + std::to_string(c.layers.size()));
    }
    if (c.num_slots <= 0) { fail("num_slots must be > 0, got " + std::to_string(c.num_slots)); }
    if (c.page_size <= 0) { fail("page_size must be > 0, got " + std::to_string(c.page_size)); }
    if (c.steps_in_flight < 1) { fail("steps_in_flight must be >= 1, got " + std::to_string(c.steps_in_flight)); }
    if (c.fused_scatter_max_rows < 0) {
      fail("fused_scatter_max_rows must be >= 0, got " + std::to_string(c.fused_scatter_max_rows));
    }
    (void)detail::validated_config<Index>(buffer_config(c));  // E, K, N_max, the layer map
    return c;
  }

  [[nodiscard]] static replay_config buffer_config(const slot_rows_config& c)
  {
    replay_config r;
    r.num_experts              = c.num_experts;
    r.top_k                    = c.top_k;
    r.num_fused_shared_experts = c.num_fused_shared_experts;
    r.max_tokens_per_step      = c.max_tokens_per_step;
    r.max_model_len            = 1;
    r.num_model_layers         = c.num_model_layers;
    r.moe_layers               = c.layers;
    return r;
  }

  [[nodiscard]] std::size_t tail() const noexcept { return (head_ + ring_.size() - count_) % ring_.size(); }

  // A small step's end-of-step kernel, which stores its rows itself. It writes the pool on `compute`:
  // a larger step's scatter still running on the side stream may write the same slots, so `compute`
  // waits for it first (only right after such a step: rare in decode).
  template <class Slot>
  void store_step(place& p, const Slot* slots, std::int64_t num_rows, std::int64_t padded, stream_ref compute)
  {
    if (last_side_ != nullptr && last_side_->in_flight) { Backend::wait(compute, last_side_->scattered); }
    last_side_ = nullptr;
    const detail::store_step_args<Index, Slot> args{slots, pool_, Backend::data(p.snapshot), Backend::data(p.status),
                                                   Backend::data(p.published), Backend::data(p.blocks_done),
                                                   config_.num_slots, row_elems_, static_cast<std::int32_t>(num_rows),
                                                   config_.top_k, config_.num_experts, reader_.required_layers()};
    detail::launch_store_step<Backend, Layout>(buffer_, args, padded, compute);
  }

  // rows move as the widest word that divides a row and that both the snapshot and the pool start
  // on (both are allocations of their own, aligned far beyond 16 bytes; checked all the same)
  void scatter(place& p, stream_ref stream)
  {
    const std::size_t row_bytes = static_cast<std::size_t>(row_elems_) * sizeof(Index);
    const auto bases = reinterpret_cast<std::uintptr_t>(Backend::data(p.snapshot)) | reinterpret_cast<std::uintptr_t>(pool_);
    const auto fits  = [&](std::size_t word) { return (row_bytes | bases) % word == 0; };
    if (fits(sizeof(detail::word16))) {
      scatter_as<detail::word16>(p, stream);
    } else if (fits(sizeof(std::uint64_t))) {
      scatter_as<std::uint64_t>(p, stream);
    } else {
      scatter_as<Index>(p, stream);
    }
  }

  template <class Word>
  void scatter_as(place& p, stream_ref stream)
  {
    const auto words  = static_cast<std::int32_t>(static_cast<std::size_t>(row_elems_) * sizeof(Index) / sizeof(Word));
    const auto blocks = std::max(1, detail::blocks_for(static_cast<std::int64_t>(p.num_rows) * words));
    Backend::launch_async(blocks, detail::kernel_block_threads,
                          detail::scatter_slot_rows<Index, Word>{Backend::data(p.snapshot), Backend::data(p.slots), pool_,
                                                                 Backend::data(p.status), Backend::data(p.published),
                                                                 Backend::data(p.blocks_done), config_.num_slots,
                                                                 p.num_rows, words, blocks},
                          stream);
  }

  // Retires the oldest step in flight (waiting for it if `wait`); false if not done and not waiting.
  bool retire_oldest(bool wait)
  {
    place& p = *ring_[tail()];
    std::string backend_failure = p.launch_failure;
    if (backend_failure.empty()) {
      try {
        if (!wait && !Backend::ready(p.scattered)) { return false; }
        Backend::synchronize(p.scattered);
      } catch (const error& e) {
        backend_failure = e.what();
        p.status_dirty  = true;
      }
    }
    p.in_flight = false;
    p.launch_failure.clear();
    --count_;
    retired_through_ = p.serial;
    if (!backend_failure.empty()) {
      failures_.push_back({p.serial, error{errc::backend_error, step_name(p.serial) + backend_failure}});
    } else if (const detail::slot_step_status s = *Backend::data(p.published); !s.clean()) {
      failures_.push_back({p.serial, detail::describe_slot_step(step_name(p.serial), s, buffer_.layers(),
                                                                config_.num_slots, config_.num_experts)});
    }
    return true;
  }

  [[nodiscard]] static std::string step_name(std::uint64_t serial) { return "step " + std::to_string(serial) + ": "; }

  slot_rows_config config_;
  typename Backend::stream side_;  // the scatter's stream (unused when it runs on the compute stream)
  buffer_type buffer_;
  detail::slot_rows_reader<Index> reader_;
  std::int64_t row_elems_;  // L * K
  std::size_t pool_bytes_;
  Index* pool_;
  std::vector<std::unique_ptr<place>> ring_;
  std::size_t head_  = 0;  // the place of the next step
  std::size_t count_ = 0;  // steps in flight
  std::uint64_t serial_          = 0;
  std::uint64_t retired_through_ = 0;
  std::int64_t graph_rows_       = 0;  // most rows handed to capture() while a graph was recorded
  place* last_side_              = nullptr;  // the newest step scattered on the side stream, if any
  std::deque<failed_step> failures_;
};

}  // namespace routing_replay
