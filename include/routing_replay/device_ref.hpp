/// @file
/// Trivially copyable reference to the device buffer, for recording routing inside an engine's own
/// top-k kernel with zero extra launches.
#pragma once

#include <routing_replay/buffer_layout.hpp>
#include <routing_replay/detail/macros.hpp>
#include <routing_replay/detail/step_status.hpp>
#include <routing_replay/index_type.hpp>

#include <cuda/std/cstdint>

#include <cstdint>

namespace routing_replay {

/// @brief A non-owning, trivially copyable view of the device buffer D plus the step's status.
///
/// Obtain it from RoutingReplay::ref(), pass it by value to a kernel, and call record() where the
/// router picks experts. Ids are narrowed to Index here, once. Invalid ids are stored as the sentinel
/// and reported at end of step; writes outside the buffer are refused and reported.
template <expert_index Index, buffer_layout Layout>
class device_ref {
 public:
  /// @brief The mdspan type of the whole buffer, indexed (layer slot, row, column).
  using buffer_type = buffer_mdspan<Index, Layout>;

  /// @brief Builds a reference; RoutingReplay::ref() is the public way.
  ROUTING_REPLAY_HOST_DEVICE device_ref(buffer_type buffer,
                                        std::int32_t num_rows,
                                        std::int64_t num_experts,
                                        detail::step_status* status) noexcept
    : buffer_(buffer), num_rows_(num_rows), num_experts_(num_experts), status_(status)
  {
  }

  /// @brief L: captured layers (valid layer slots are [0, L)).
  [[nodiscard]] ROUTING_REPLAY_HOST_DEVICE std::int32_t num_layers() const noexcept
  {
    return buffer_.extent(0);
  }
  /// @brief Rows this reference may write (at most N_max).
  [[nodiscard]] ROUTING_REPLAY_HOST_DEVICE std::int32_t num_rows() const noexcept
  {
    return num_rows_;
  }
  /// @brief K: columns per row.
  [[nodiscard]] ROUTING_REPLAY_HOST_DEVICE std::int32_t top_k() const noexcept
  {
    return buffer_.extent(2);
  }

  /// @brief Records that the router of captured layer `layer_slot` chose `expert` as the
  /// `column`-th expert of row `row` of the step.
  ///
  /// `layer_slot` comes from RoutingReplay::layer_slot(model_layer). An id outside [0, E) is stored
  /// as the sentinel and reported; a layer, row or column outside the buffer writes nothing and is
  /// reported. Either way end_step() refuses the step, so nothing is silently dropped.
  template <class Id>
  ROUTING_REPLAY_HOST_DEVICE void record(std::int32_t layer_slot,
                                         std::int32_t row,
                                         std::int32_t column,
                                         Id expert) const noexcept
  {
    if (layer_slot < 0 || layer_slot >= num_layers() || row < 0 || row >= num_rows_ ||
        column < 0 || column >= top_k()) {
      status_->out_of_bounds.report(static_cast<std::int64_t>(expert), layer_slot, row, column);
      return;
    }
    const auto id = static_cast<std::int64_t>(expert);
    if (index_traits<Index>::is_valid(id, num_experts_)) {
      buffer_(layer_slot, row, column) = static_cast<Index>(id);
    } else {
      buffer_(layer_slot, row, column) = index_traits<Index>::sentinel;
      status_->invalid_id.report(id, layer_slot, row, column);
    }
  }

 private:
  buffer_type buffer_;
  std::int32_t num_rows_;
  std::int64_t num_experts_;
  detail::step_status* status_;
};

}  // namespace routing_replay
