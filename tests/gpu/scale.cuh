/// @file
/// Realistic scale on CUDA (issue 11): randomized endless engine schedules at N_max 8192, L 48,
/// K 8, E 128 (Qwen3-30B-A3B's shape), bit-exact against the reference model, device memory
/// sampled (nothing is allocated after construction, so it must not grow). The schedule TUs run
/// check_at_scale for their strategies (thousands of steps), and soak_at_scale (the CUDA soak,
/// skipped unless asked for: scripts/soak.sh STEPS --cuda) for ROUTING_REPLAY_SOAK_STEPS steps.
#pragma once

#include "../support/soak.hpp"

#include <routing_replay/routing_replay.cuh>

#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <vector>

namespace rr_test {

/// @brief The host soak's engine at scale: prompts of up to ~2000 tokens in chunks of up to 8192 rows a
/// step, outputs of up to 256, on a pool for 32 running requests.
inline sim_config scale_schedule()
{
  auto c                = soak_schedule();
  c.max_tokens_per_step = 8192;
  c.max_model_len       = 4096;
  c.num_blocks          = 6144;
  c.num_requests        = 64;
  c.prompt_extra        = 2000;
  c.max_output          = 256;
  return c;
}

/// @brief L = 48 MoE layers of 49 (model layer 0 is dense), K = 8 of E = 128.
inline harness_shape scale_shape()
{
  harness_shape s;
  s.num_experts              = 128;
  s.top_k                    = 8;
  s.num_fused_shared_experts = 0;
  s.moe_layers.resize(48);
  std::iota(s.moe_layers.begin(), s.moe_layers.end(), 1);
  s.num_model_layers = 49;
  return s;
}

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

/// @brief The CUDA soak: ROUTING_REPLAY_SOAK_STEPS steps (default 100000), device and host memory
/// flat after warm-up.
template <class RR>
void soak_at_scale()
{
  const char* env          = std::getenv("ROUTING_REPLAY_SOAK_STEPS");
  const std::int64_t steps = env != nullptr ? std::strtoll(env, nullptr, 10) : 100000;
  std::vector<std::int64_t> rss;  // host resident memory, sampled with the device's
  const auto r = run_soak<RR>(scale_schedule(), scale_shape(), steps, 20261122, [&] {
    rss.push_back(resident_kib());
    return device_used_kib();
  });
  const std::int64_t rss_growth = rss.back() - rss[rss.size() / 5];
  std::printf("%s\n{\"soak\": \"cuda\", \"copy\": \"%s\", \"storage\": \"%s\", \"memory\": \"rss\", \"growth_kib\": %lld}\n",
              soak_json<RR>(r, "cuda", "device").c_str(), RR::copy_type::name, RR::storage_type::name,
              static_cast<long long>(rss_growth));
  std::fflush(stdout);
  CHECK(r.rows_checked > 0);
  CHECK_MESSAGE(r.growth() <= 2048, "device memory grew by " << r.growth() << " KiB after warm-up");
  CHECK_MESSAGE(rss_growth <= 8192, "host resident memory grew by " << rss_growth << " KiB after warm-up");
}

}  // namespace rr_test
