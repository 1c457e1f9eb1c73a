/// @file
/// The layer map: which model layers are captured, and at which captured index (layer slot).
#pragma once

#include <routing_replay/config.hpp>
#include <routing_replay/errors.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace routing_replay {

/// @brief Model layer index → captured MoE layer index ("layer slot"), from
/// replay_config::moe_layers. Dense layers and draft/MTP layers have no slot: addressing them is an
/// error, never a silent drop.
class layer_map {
 public:
  /// @brief Builds the map of a validated configuration (validated_config()).
  explicit layer_map(const replay_config& config)
    : moe_layers_(config.moe_layers), slots_(static_cast<std::size_t>(config.num_model_layers), -1)
  {
    for (std::size_t i = 0; i < moe_layers_.size(); ++i) {
      slots_[static_cast<std::size_t>(moe_layers_[i])] = static_cast<std::int32_t>(i);
    }
  }

  /// @brief L: captured layers.
  [[nodiscard]] std::int32_t num_layers() const noexcept
  {
    return static_cast<std::int32_t>(moe_layers_.size());
  }
  /// @brief Layers of the model, dense ones included.
  [[nodiscard]] std::int32_t num_model_layers() const noexcept
  {
    return static_cast<std::int32_t>(slots_.size());
  }

  /// @brief The layer slot of a model layer, or -1 if it is not captured (no check).
  [[nodiscard]] std::int32_t slot_or_none(std::int32_t model_layer) const noexcept
  {
    return model_layer >= 0 && model_layer < num_model_layers()
             ? slots_[static_cast<std::size_t>(model_layer)]
             : -1;
  }

  /// @brief The layer slot of a model layer.
  /// @throws error unknown_layer if the map does not capture it.
  [[nodiscard]] std::int32_t slot(std::int32_t model_layer) const
  {
    const std::int32_t s = slot_or_none(model_layer);
    if (s < 0) {
      throw error{errc::unknown_layer, "model layer " + std::to_string(model_layer) +
                                         " is not captured (the layer map captures " + listing() + ")"};
    }
    return s;
  }

  /// @brief The model layer of a layer slot in [0, num_layers()) (no check).
  [[nodiscard]] std::int32_t model_layer(std::int32_t slot) const noexcept
  {
    return moe_layers_[static_cast<std::size_t>(slot)];
  }

  /// @brief "layer 7 (slot 3)": how messages name a layer slot.
  [[nodiscard]] std::string describe(std::int32_t slot) const
  {
    if (slot < 0 || slot >= num_layers()) { return "layer slot " + std::to_string(slot); }
    return "layer " + std::to_string(moe_layers_[static_cast<std::size_t>(slot)]) + " (slot " +
           std::to_string(slot) + ")";
  }

 private:
  [[nodiscard]] std::string listing() const
  {
    std::string s = "model layers";
    for (std::size_t i = 0; i < moe_layers_.size() && i < 16; ++i) {
      s += (i == 0 ? " " : ", ") + std::to_string(moe_layers_[i]);
    }
    if (moe_layers_.size() > 16) { s += ", ..."; }
    return s;
  }

  std::vector<std::int32_t> moe_layers_;
  std::vector<std::int32_t> slots_;  // per model layer: its slot, -1 if not captured
};

}  // namespace routing_replay
