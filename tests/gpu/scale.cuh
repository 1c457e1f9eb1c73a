/// @file
/// Realistic scale on CUDA: randomized endless engine schedules at N_max 8192, L 48,
/// K 8, E 128 (Qwen3-30B-A3B's shape), bit-exact against the reference model, device memory
/// sampled (nothing is allocated after construction, so it must not grow). The schedule TUs run
/// check_at_scale for their strategies (thousands of steps), and soak_at_scale (the CUDA soak,
/// skipped unless asked for: scripts/soak.sh STEPS --cuda) for ROUTING_REPLAY_SOAK_STEPS steps;
/// they register their soaks, and soak_all_at_once runs every registered one in threads of one
/// process (scripts/gpu_check.sh, part soak).
#pragma once

#include "../support/soak.hpp"

#include <routing_replay/routing_replay.cuh>

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

namespace rr_test {

/// @brief Device memory in use, KiB.
inline std::int64_t device_used_kib()
{
  std::size_t free = 0;
  std::size_t total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) { return 0; }
  return static_cast<std::int64_t>((total - free) / 1024);
}

/// @brief Thousands of steps at scale, bit-exact, device memory flat.
template <class RR>
void check_at_scale()
{
  const auto r = run_soak<RR>(scale_schedule(), scale_shape(), 2000, 8192, device_used_kib);
  MESSAGE(soak_json<RR>(r, "cuda", "device"));
  CHECK(r.rows_checked > 0);
  CHECK_MESSAGE(r.growth() <= 2048, "device memory grew by " << r.growth() << " KiB after warm-up");
}

/// @brief The CUDA soak of one combination: `o.steps` steps at scale, bit-exact (the harness
/// fails at the first mismatch), device memory (cudaMemGetInfo) and host resident memory flat after
/// warm-up. Both probes are the whole device's and the whole process's: when `o.runs` runs share
/// them (soak_all_at_once), each run's window sees every run's memory, and the limits are the
/// single run's (2 MiB device, 8 MiB host) times `o.runs`. Prints one JSON line; returns whether
/// the run passed.
template <class RR>
bool soak_at_scale(const soak_options& o = soak_options{
                     .steps = soak_steps_from_env(), .runs = 1, .hooks = {}, .progress = nullptr})
{
  std::vector<std::int64_t> rss;  // host resident memory, sampled with the device's
  const auto chunk = std::max<std::int64_t>(o.steps / 50, 1);
  const auto r     = run_soak<RR>(scale_schedule(), scale_shape(), o.steps, 20261122, [&] {
    rss.push_back(resident_kib());
    if (o.progress != nullptr) { *o.progress += chunk; }
    return device_used_kib();
  }, o.hooks);
  const std::int64_t rss_growth   = rss.back() - rss[rss.size() / 5];
  const std::int64_t device_limit = 2048 * std::int64_t{o.runs};
  const std::int64_t rss_limit    = 8192 * std::int64_t{o.runs};
  const bool passed = r.rows_checked > 0 && r.growth() <= device_limit && rss_growth <= rss_limit;
  char extra[512];
  std::snprintf(extra, sizeof extra,
                "\"rss_kib_after_warmup\": %lld, \"rss_kib_end\": %lld, \"rss_growth_kib\": %lld, "
                "\"runs_sharing_probes\": %d, \"device_limit_kib\": %lld, \"rss_limit_kib\": %lld, \"verdict\": \"%s\"",
                static_cast<long long>(rss[rss.size() / 5]), static_cast<long long>(rss.back()),
                static_cast<long long>(rss_growth), o.runs, static_cast<long long>(device_limit),
                static_cast<long long>(rss_limit), passed ? "PASS" : "FAIL");
  std::printf("%s\n", soak_json<RR>(r, "cuda", "device", extra).c_str());
  std::fflush(stdout);
  CHECK(r.rows_checked > 0);
  CHECK_MESSAGE(r.growth() <= device_limit, "device memory grew by " << r.growth() << " KiB after warm-up");
  CHECK_MESSAGE(rss_growth <= rss_limit, "host resident memory grew by " << rss_growth << " KiB after warm-up");
  return passed;
}

/// @brief The combinations the schedule TUs registered (register_soaks), in registration order.
inline std::vector<soak_entry>& soak_registry()
{
  static std::vector<soak_entry> entries;
  return entries;
}

/// @brief Registers soak_at_scale of every type of the tuple (called at static initialization by
/// the TU that already instantiates them, so no TU compiles another's combinations).
template <class... RR>
bool register_soaks(std::tuple<RR...>* /*types*/)
{
  (soak_registry().push_back(
     {std::string{RR::copy_type::name} + "/" + RR::storage_type::name, &soak_at_scale<RR>}),
   ...);
  return true;
}

/// @brief The CUDA soak of every registered combination at once (soak_all_at_once), or of those
/// named in `only` ("copy/storage", comma-separated).
inline void cuda_soak_all_at_once(std::int64_t steps, const std::string& only, std::int64_t deadline_s)
{
  soak_all_at_once("cuda", soak_registry(), steps, only, deadline_s);
}

}  // namespace rr_test
