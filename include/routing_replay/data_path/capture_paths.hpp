/// @file
/// The three capture paths as members of an owning object that holds a capture buffer
/// (RoutingReplay, packet_worker): each forwards to that buffer (capture_buffer.hpp).
#pragma once

#include <routing_replay/backend.hpp>
#include <routing_replay/buffer_layout.hpp>
#include <routing_replay/data_path/capture_buffer.hpp>
#include <routing_replay/device_ref.hpp>
#include <routing_replay/index_type.hpp>

#include <cstdint>

namespace routing_replay {

/// @brief capture(), layer_view() and ref() of `Derived`, which provides `capture_target()`: its
/// capture_buffer<Backend, Index, Layout>, and `enter(name)`: its thread check for a call.
template <class Derived, backend Backend, expert_index Index, buffer_layout Layout>
class capture_paths {
  using buffer_type = capture_buffer<Backend, Index, Layout>;

 public:
  /// @brief Trivially copyable device reference (capture path c).
  using ref_type = device_ref<Index, Layout>;
  /// @brief Per-layer [rows, K] view of D (capture path b).
  using layer_view_type = typename buffer_type::layer_view_type;

  /// @name Capture paths (all CUDA-graph safe: fixed addresses, no host sync, no allocation)
  /// @{

  /// @brief (a) Records a layer's router output: the first K columns of `topk_ids`, a row-major
  /// [num_tokens, K + num_fused_shared_experts] device array of any integer type, narrowed once to
  /// Index. One small kernel on `stream`.
  /// @throws error unknown_layer, too_many_tokens, invalid_argument
  template <source_index Source>
  void capture(std::int32_t model_layer,
               const Source* topk_ids,
               std::int64_t num_tokens,
               typename Backend::stream_ref stream,
               const capture_options& options = {})
  {
    [[maybe_unused]] const auto inside = self().enter("capture");
    self().capture_target().capture(model_layer, topk_ids, num_tokens, stream, options);
  }

  /// @brief (b) The [num_rows, K] slab of D for a model layer, for kernels that write routing
  /// themselves (FlashInfer's routing_replay_out: pass layer_view(l, n).data_handle() with
  /// layer_major and Index = int16_t). No range check happens at the write; end_step() checks.
  /// @throws error unknown_layer, too_many_tokens
  [[nodiscard]] layer_view_type layer_view(std::int32_t model_layer, std::int64_t num_rows)
  {
    [[maybe_unused]] const auto inside = self().enter("layer_view");
    return self().capture_target().layer_view(model_layer, num_rows);
  }

  /// @brief (c) A trivially copyable device reference whose record() an engine's own top-k kernel
  /// calls inline: zero extra launches. `num_rows` bounds the rows it may write.
  /// @throws error too_many_tokens
  [[nodiscard]] ref_type ref(std::int64_t num_rows)
  {
    [[maybe_unused]] const auto inside = self().enter("ref");
    return self().capture_target().ref(num_rows);
  }
  /// @}

 private:
  [[nodiscard]] Derived& self() noexcept { return static_cast<Derived&>(*this); }
};

}  // namespace routing_replay
