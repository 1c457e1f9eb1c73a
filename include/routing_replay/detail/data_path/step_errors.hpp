/// @file
/// How a problem the device reported about a step becomes an error: its code, and a message that
/// names the step, the first offender's layer, row, request and position, and the count.
#pragma once

#include <routing_replay/data_path/request_registry.hpp>
#include <routing_replay/data_path/step_record.hpp>
#include <routing_replay/detail/step_status.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/layer_map.hpp>

#include <cstdint>
#include <string>

namespace routing_replay::detail {

/// @brief The code of a step status that is not clean, by priority: invalid ids, then writes
/// outside the buffer, then unwritten rows.
[[nodiscard]] inline errc device_problem_code(const step_status& s) noexcept
{
  if (s.invalid_id.count != 0 || s.out_of_range.count != 0) { return errc::invalid_expert_id; }
  if (s.out_of_bounds.count != 0) { return errc::invalid_argument; }
  return errc::missing_routing;
}

/// @brief "row 5 (request 'chat-7', position 12)", or a row of a request that did not opt in.
template <class Index>
[[nodiscard]] std::string describe_row(const step_record<Index>& step,
                                       const request_registry& requests,
                                       std::int64_t row)
{
  for (const auto& run : step.runs) {
    if (row >= run.first_row && row < run.first_row + run.num_tokens) {
      const auto& r = requests[run.handle];
      const std::string who =
        r.generation == run.generation && r.id ? r.id->to_string() : std::string{"(aborted)"};
      return "row " + std::to_string(row) + " (request " + who + ", position " +
             std::to_string(run.first_position + (row - run.first_row)) + ")";
    }
  }
  return "row " + std::to_string(row) + " (a request that did not opt in)";
}

/// @brief The message of a step status that is not clean (see device_problem_code()).
template <class Index>
[[nodiscard]] std::string describe_device_problem(const step_status& s,
                                                  const step_record<Index>& step,
                                                  const request_registry& requests,
                                                  const layer_map& layers,
                                                  std::int64_t num_experts,
                                                  std::int32_t top_k)
{
  const std::string head  = "step " + std::to_string(step.serial) + ": ";
  const std::string tail  = "; the step was discarded, nothing of it was stored";
  const std::string range = " outside [0, num_experts = " + std::to_string(num_experts) + ")";
  auto where              = [&](const problem_report& p) {
    return layers.describe(p.layer) + ", " + describe_row(step, requests, p.row) + ", column " +
           std::to_string(p.column);
  };
  if (s.invalid_id.count != 0) {
    const auto& p = s.invalid_id;
    return head + "expert id " + std::to_string(p.value) + range + " captured at " + where(p) + "; " +
           std::to_string(p.count) + " invalid id(s)" + tail;
  }
  if (s.out_of_range.count != 0) {
    const auto& p = s.out_of_range;
    return head + "value " + std::to_string(p.value) + range + " written through a view at " + where(p) +
           "; " + std::to_string(p.count) + " such value(s)" + tail;
  }
  if (s.out_of_bounds.count != 0) {
    const auto& p = s.out_of_bounds;
    return head + "device_ref::record outside the buffer: layer slot " + std::to_string(p.layer) + ", row " +
           std::to_string(p.row) + ", column " + std::to_string(p.column) + " (buffer: " +
           std::to_string(layers.num_layers()) + " layers, " + std::to_string(top_k) +
           " columns, rows bounded by ref(num_rows)); " + std::to_string(p.count) + " refused" + tail;
  }
  const auto& p = s.unwritten;
  return head + layers.describe(p.layer) + " left " + describe_row(step, requests, p.row) +
         " unwritten (it still holds the sentinel); " + std::to_string(p.count) +
         " (layer, row) pair(s) unwritten; every captured layer must write rows [0, " +
         std::to_string(step.num_rows) + ") each step" + tail;
}

}  // namespace routing_replay::detail
