/// @file
/// Construction-time checks of a replay_config, and the defaults they fill in.
#pragma once

#include <routing_replay/config.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/index_type.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace routing_replay::detail {

/// @brief Checks a configuration for an index type; fills num_model_layers when it is 0.
/// @throws error invalid_config, index_type_too_narrow
template <expert_index Index>
[[nodiscard]] replay_config validated_config(replay_config c)
{
  auto fail = [](const std::string& what) { throw error{errc::invalid_config, what}; };
  if (c.num_experts <= 0) { fail("num_experts must be > 0, got " + std::to_string(c.num_experts)); }
  if (c.top_k <= 0) { fail("top_k must be > 0, got " + std::to_string(c.top_k)); }
  if (c.num_fused_shared_experts < 0) {
    fail("num_fused_shared_experts must be >= 0, got " + std::to_string(c.num_fused_shared_experts));
  }
  if (c.max_tokens_per_step <= 0) {
    fail("max_tokens_per_step must be > 0, got " + std::to_string(c.max_tokens_per_step));
  }
  if (c.max_model_len <= 0) { fail("max_model_len must be > 0, got " + std::to_string(c.max_model_len)); }
  if (c.moe_layers.empty()) { fail("moe_layers (the layer map) must name at least one layer"); }
  const std::int32_t largest = *std::max_element(c.moe_layers.begin(), c.moe_layers.end());
  if (c.num_model_layers == 0) { c.num_model_layers = largest + 1; }
  std::vector<bool> seen(static_cast<std::size_t>(std::max(c.num_model_layers, largest + 1)), false);
  for (const std::int32_t layer : c.moe_layers) {
    if (layer < 0 || layer >= c.num_model_layers) {
      fail("moe_layers names model layer " + std::to_string(layer) + ", outside [0, " +
           std::to_string(c.num_model_layers) + ")");
    }
    if (seen[static_cast<std::size_t>(layer)]) {
      fail("moe_layers names model layer " + std::to_string(layer) + " twice");
    }
    seen[static_cast<std::size_t>(layer)] = true;
  }
  using traits = index_traits<Index>;
  if (c.num_experts > traits::max_experts) {
    throw error{errc::index_type_too_narrow,
                "index type of " + std::to_string(sizeof(Index)) + " byte(s) holds at most " +
                  std::to_string(traits::max_experts) + " experts plus the missing-row sentinel " +
                  std::to_string(static_cast<std::int64_t>(traits::sentinel)) + "; num_experts is " +
                  std::to_string(c.num_experts) + ": use a wider index type"};
  }
  const auto elems = static_cast<std::int64_t>(c.max_tokens_per_step) *
                     static_cast<std::int64_t>(c.moe_layers.size()) * c.top_k;
  if (elems > std::numeric_limits<std::int32_t>::max()) {
    fail("device buffer of " + std::to_string(elems) + " ids exceeds 2^31 - 1 elements");
  }
  return c;
}

}  // namespace routing_replay::detail
