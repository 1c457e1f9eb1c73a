/// @file
/// The error a refused slot_rows step is reported with: its code by priority, and a message naming
/// the step, the layer and row (or the slot) of the first offender, and how often it happened.
#pragma once

#include <routing_replay/detail/slot_rows/slot_rows_kernels.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/layer_map.hpp>

#include <cstdint>
#include <string>

namespace routing_replay::detail {

/// @brief The error of a step whose status `s` is not clean; `step` prefixes the message ("step 7: ").
[[nodiscard]] inline error describe_slot_step(const std::string& step, const slot_step_status& s, const layer_map& layers,
                                              std::int64_t num_slots, std::int64_t num_experts)
{
  const auto count = [](const problem_report& r) {
    return " (" + std::to_string(r.count) + " occurrence" + (r.count == 1 ? "" : "s") + ")";
  };
  const auto cell = [&](const problem_report& r) { return layers.describe(r.layer) + ", row " + std::to_string(r.row); };
  if (s.bad_slot.count != 0) {
    return error{errc::slot_out_of_range, step + "row " + std::to_string(s.bad_slot.row) + " has KV slot " +
                                            std::to_string(s.bad_slot.value) + ", outside the pool [0, " +
                                            std::to_string(num_slots) + ")" + count(s.bad_slot)};
  }
  if (s.rows.invalid_id.count != 0 || s.rows.out_of_range.count != 0) {
    const auto& r = s.rows.invalid_id.count != 0 ? s.rows.invalid_id : s.rows.out_of_range;
    return error{errc::invalid_expert_id, step + cell(r) + ", column " + std::to_string(r.column) + ": expert id " +
                                            std::to_string(r.value) + " outside [0, " + std::to_string(num_experts) +
                                            ")" + count(r)};
  }
  if (s.rows.out_of_bounds.count != 0) {
    const auto& r = s.rows.out_of_bounds;
    return error{errc::invalid_argument, step + "a device_ref::record outside the buffer (layer slot " +
                                           std::to_string(r.layer) + ", row " + std::to_string(r.row) + ", column " +
                                           std::to_string(r.column) + ")" + count(r)};
  }
  const auto& r = s.rows.unwritten;
  return error{errc::missing_routing,
               step + cell(r) + " holds no valid expert id: the layer was captured, but not for this row of the step, "
                                "or with an id outside [0, " + std::to_string(num_experts) + ")" + count(r)};
}

}  // namespace routing_replay::detail
