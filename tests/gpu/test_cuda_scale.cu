// CUDA at realistic scale and under faults (issue 11):
// - randomized endless engine schedules at N_max 8192, L 48, K 8, E 128 (Qwen3-30B-A3B's shape)
//   for thousands of steps, every copy strategy with every storage, bit-exact against the
//   reference model, device memory sampled (it must not grow: nothing is allocated after
//   construction);
// - the CUDA soak: the same for ROUTING_REPLAY_SOAK_STEPS steps (default 100000) per strategy,
//   device memory and host resident memory flat after warm-up. Skipped unless asked for:
//   scripts/soak.sh STEPS --cuda (gpu_tests --no-skip -tc="CUDA soak*");
// - fault injection over the CUDA backend: every backend operation and device/pinned allocation
//   fails once in the fault sweep's schedule (rr_test::faulty_backend<cuda_backend>).
// Part of gpu_tests, which returns 77 (CTest: skipped) without a GPU.
#include "../support/fault_backend.hpp"
#include "../support/fault_sweep.hpp"
#include "../support/soak.hpp"

#include <routing_replay/routing_replay.cuh>

#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <tuple>

namespace rr = routing_replay;

namespace {

/// Every copy strategy with every storage it takes.
using scale_types =
  std::tuple<rr::RoutingReplay<rr::cuda_backend, std::int16_t, rr::layer_major, rr::sync_copy, rr::per_request_storage>,
             rr::RoutingReplay<rr::cuda_backend, std::int16_t, rr::layer_major, rr::sync_copy, rr::block_slot_storage>,
             rr::RoutingReplay<rr::cuda_backend, std::int16_t, rr::layer_major, rr::async_event, rr::per_request_storage>,
             rr::RoutingReplay<rr::cuda_backend, std::int16_t, rr::token_major, rr::async_event, rr::block_slot_storage>,
             rr::RoutingReplay<rr::cuda_backend, std::int16_t, rr::layer_major, rr::double_buffered<2>, rr::per_request_storage>,
             rr::RoutingReplay<rr::cuda_backend, std::int16_t, rr::layer_major, rr::double_buffered<2>, rr::block_slot_storage>,
             rr::RoutingReplay<rr::cuda_backend, std::int16_t, rr::layer_major, rr::device_scatter<2>, rr::block_slot_storage>>;

/// The host soak's engine at scale: prompts of up to ~2000 tokens in chunks of up to 8192 rows a
/// step, outputs of up to 256, on a pool for 32 running requests.
rr_test::sim_config scale_schedule()
{
  auto c                = rr_test::soak_schedule();
  c.max_tokens_per_step = 8192;
  c.max_model_len       = 4096;
  c.num_blocks          = 6144;
  c.num_requests        = 64;
  c.prompt_extra        = 2000;
  c.max_output          = 256;
  return c;
}

/// L = 48 MoE layers of 49 (model layer 0 is dense), K = 8 of E = 128.
rr_test::harness_shape scale_shape()
{
  rr_test::harness_shape s;
  s.num_experts              = 128;
  s.top_k                    = 8;
  s.num_fused_shared_experts = 0;
  s.moe_layers.resize(48);
  std::iota(s.moe_layers.begin(), s.moe_layers.end(), 1);
  s.num_model_layers = 49;
  return s;
}

std::int64_t device_used_kib()
{
  std::size_t free = 0;
  std::size_t total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) { return 0; }
  return static_cast<std::int64_t>((total - free) / 1024);
}

}  // namespace

TEST_CASE_TEMPLATE_DEFINE("CUDA at scale (N_max 8192, L 48, K 8): randomized schedules match the reference model",
                          RR, scale_cuda)
{
  const auto r = rr_test::run_soak<RR>(scale_schedule(), scale_shape(), 2000, 8192, device_used_kib);
  MESSAGE(rr_test::soak_json<RR>(r, "cuda", "device"));
  CHECK(r.rows_checked > 0);
  CHECK_MESSAGE(r.growth() <= 2048, "device memory grew by " << r.growth() << " KiB after warm-up");
}
TEST_CASE_TEMPLATE_APPLY(scale_cuda, scale_types);

TEST_CASE_TEMPLATE_DEFINE("CUDA soak: device and host memory flat after warm-up" * doctest::skip(), RR, soak_cuda)
{
  const char* env         = std::getenv("ROUTING_REPLAY_SOAK_STEPS");
  const std::int64_t steps = env != nullptr ? std::strtoll(env, nullptr, 10) : 100000;
  std::vector<std::int64_t> rss;  // host resident memory, sampled with the device's
  const auto r = rr_test::run_soak<RR>(scale_schedule(), scale_shape(), steps, 20261122, [&] {
    rss.push_back(rr_test::resident_kib());
    return device_used_kib();
  });
  const std::int64_t rss_growth = rss.back() - rss[rss.size() / 5];
  std::printf("%s\n{\"soak\": \"cuda\", \"copy\": \"%s\", \"storage\": \"%s\", \"memory\": \"rss\", \"growth_kib\": %lld}\n",
              rr_test::soak_json<RR>(r, "cuda", "device").c_str(), RR::copy_type::name, RR::storage_type::name,
              static_cast<long long>(rss_growth));
  std::fflush(stdout);
  CHECK(r.rows_checked > 0);
  CHECK_MESSAGE(r.growth() <= 2048, "device memory grew by " << r.growth() << " KiB after warm-up");
  CHECK_MESSAGE(rss_growth <= 8192, "host resident memory grew by " << rss_growth << " KiB after warm-up");
}
TEST_CASE_TEMPLATE_APPLY(soak_cuda, scale_types);

TEST_CASE_TEMPLATE_DEFINE("CUDA: every backend operation and device/pinned allocation fails once: documented state, no hang",
                          RR, faults_cuda)
{
  rr_test::check_sweep(rr_test::sweep<RR>(rr_test::fault_source::backend), "CUDA backend");
}
TEST_CASE_TEMPLATE_APPLY(
  faults_cuda,
  std::tuple<rr::RoutingReplay<rr_test::faulty_backend<rr::cuda_backend>, std::int16_t, rr::layer_major, rr::sync_copy,
                               rr::per_request_storage>,
             rr::RoutingReplay<rr_test::faulty_backend<rr::cuda_backend>, std::uint8_t, rr::token_major,
                               rr::async_event, rr::block_slot_storage>,
             rr::RoutingReplay<rr_test::faulty_backend<rr::cuda_backend>, std::int16_t, rr::layer_major,
                               rr::device_scatter<2>, rr::block_slot_storage>>);
