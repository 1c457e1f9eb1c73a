/// @file
/// The engine loop's results: the medians of one (policy, scenario, mode) run and the JSON line
/// benchmarks/engine_loop prints for it (engine_loop.hpp measures them).
#pragma once

#include "engine_loop_scenarios.hpp"

#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

namespace rr_bench {

// ---- results ------------------------------------------------------------------------------------

/// @brief The medians of one (policy, scenario, mode).
struct loop_result {
  std::string policy;
  std::string scenario;
  std::string mode;
  std::optional<double> host_us, fwd_gpu_us, fwd0_gpu_us, step_us, step0_us, extract_us;
  /// @brief Beyond the fields every engine loop prints (impl through correct): device-event time
  /// of what end_step() enqueues on the compute stream (the end-of-step kernel; with sync_copy also
  /// the copy), the GPU time the copy pipeline adds to the compute stream per step on top of
  /// fwd_gpu_us - fwd0_gpu_us.
  std::optional<double> eos_gpu_us;
  /// @brief Host time of the library's calls before the forward (add_request() of new requests
  /// and begin_step()), and the median over measured steps of step_us - step0_us taken step by
  /// step (each step runs without and then with the library, so the pair shares the machine's
  /// state; the difference of the two medians mixes steps and is noisier).
  std::optional<double> begin_us, overhead_us;
  bool correct = false;
};

/// @brief Median of samples; std::nullopt when there are none.
inline std::optional<double> median(std::vector<double> v)
{
  if (v.empty()) { return std::nullopt; }
  std::sort(v.begin(), v.end());
  const std::size_t m = v.size() / 2;
  return v.size() % 2 == 1 ? v[m] : (v[m - 1] + v[m]) / 2;
}

/// @brief One JSON object per line: the fields every engine loop prints (impl through correct),
/// then eos_gpu_us and the rest.
inline void print_json_line(const loop_result& r, const loop_options& o)
{
  auto number = [](const std::optional<double>& v) {
    if (!v) { return std::string{"null"}; }
    char buffer[32];
    std::snprintf(buffer, sizeof buffer, "%.2f", *v);
    return std::string{buffer};
  };
  std::printf(
    "{\"impl\": \"routing_replay\", \"policy\": \"%s\", \"scenario\": \"%s\", \"mode\": \"%s\", "
    "\"layers\": %d, \"topk\": %d, \"experts\": %d, \"host_us\": %s, \"fwd_gpu_us\": %s, "
    "\"fwd0_gpu_us\": %s, \"step_us\": %s, \"step0_us\": %s, \"extract_us\": %s, \"correct\": %s, "
    "\"eos_gpu_us\": %s, \"begin_us\": %s, \"overhead_us\": %s, \"capture_path\": \"%s\", "
    "\"host_memory_ahead\": %lld}\n",
    r.policy.c_str(), r.scenario.c_str(), r.mode.c_str(), o.layers, o.topk, o.experts,
    number(r.host_us).c_str(), number(r.fwd_gpu_us).c_str(), number(r.fwd0_gpu_us).c_str(),
    number(r.step_us).c_str(), number(r.step0_us).c_str(), number(r.extract_us).c_str(),
    r.correct ? "true" : "false", number(r.eos_gpu_us).c_str(), number(r.begin_us).c_str(),
    number(r.overhead_us).c_str(), o.capture_path.c_str(), static_cast<long long>(o.host_memory_ahead));
  std::fflush(stdout);
}

}  // namespace rr_bench
