/// @file
/// replay_impl: one RoutingReplay instantiation behind replay_base, plus the staging path of the
/// drop-in capturer (its kernels and buffer layout: staging.hpp). Included by the host translation
/// units (g++) and the CUDA one (nvcc); the backend's stream handles are converted by
/// stream_cast<Backend>.
#pragma once

#include "replay_base.hpp"
#include "staging.hpp"

#include <routing_replay/detail/step_status.hpp>
#include <routing_replay/host_backend.hpp>
#include <routing_replay/routing_replay.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
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
  [[nodiscard]] routing_replay::host_memory_growth host_memory_growth() const noexcept override
  {
    return replay_.host_memory_growth();
  }
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

  row_range for_each_row_run(request_key id, const extract_options& options, row_run_sink& sink) override
  {
    const std::int64_t row = replay_.row_size();
    const std::int64_t k   = replay_.top_k();
    return replay_.for_each_row_run(
      id, options, [&](const Index* rows, std::int64_t n) { sink.rows(rows, n, row, k); },
      [&](std::int64_t n) { sink.missing(n); });
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

