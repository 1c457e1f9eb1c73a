// Randomized engine schedules on the CUDA backend, bit-exact against the reference model (the same
// harness as the host backend's): every combination with the sync and async_event strategies
// (test_cuda_schedules_ring.cu has the ring strategies; two translation units build in parallel),
// and the same at realistic scale (scale.cuh), which reuses these instantiations.
#include "../support/harness.hpp"
#include "../support/policy_combinations.hpp"
#include "scale.cuh"

#include <routing_replay/routing_replay.cuh>

#include <doctest/doctest.h>

#include <cstdlib>

namespace rr = routing_replay;

TEST_CASE_TEMPLATE_DEFINE("CUDA: randomized schedules match the reference model", RR, schedules_cuda)
{
  rr_test::check_randomized_schedules<RR>({1, 2, 3, 4});
}
TEST_CASE_TEMPLATE_APPLY(schedules_cuda, rr_test::concat<rr_test::all_combinations<rr::cuda_backend, rr::sync_copy>,
                                                         rr_test::all_combinations<rr::cuda_backend, rr::async_event>>);

using scale_types_sync_async =
  std::tuple<rr::RoutingReplay<rr::cuda_backend, std::int16_t, rr::layer_major, rr::sync_copy, rr::per_request_storage>,
             rr::RoutingReplay<rr::cuda_backend, std::int16_t, rr::layer_major, rr::sync_copy, rr::block_slot_storage>,
             rr::RoutingReplay<rr::cuda_backend, std::int16_t, rr::layer_major, rr::async_event, rr::per_request_storage>,
             rr::RoutingReplay<rr::cuda_backend, std::int16_t, rr::token_major, rr::async_event, rr::block_slot_storage>>;

TEST_CASE_TEMPLATE_DEFINE("CUDA at scale (N_max 8192, L 48, K 8): randomized schedules match the reference model",
                          RR, scale_cuda)
{
  rr_test::check_at_scale<RR>();
}
TEST_CASE_TEMPLATE_APPLY(scale_cuda, scale_types_sync_async);

TEST_CASE_TEMPLATE_DEFINE("CUDA soak: device and host memory flat after warm-up" * doctest::skip(), RR, soak_cuda)
{
  rr_test::soak_at_scale<RR>();
}
TEST_CASE_TEMPLATE_APPLY(soak_cuda, scale_types_sync_async);

namespace {
[[maybe_unused]] const bool soaks_registered = rr_test::register_soaks(static_cast<scale_types_sync_async*>(nullptr));
}  // namespace

// Every registered combination (this TU's four and test_cuda_schedules_ring.cu's four) at once, one
// thread each in this process: ROUTING_REPLAY_SOAK_STEPS steps each (default 100000), only those
// named in ROUTING_REPLAY_SOAK_ONLY ("sync/block_slot,async_event/per_request"; default all), under
// a watchdog of ROUTING_REPLAY_SOAK_DEADLINE_S seconds (default none). scripts/gpu_check.sh, part soak.
TEST_CASE("CUDA concurrent soak: every combination at once in threads, bit-exact, device and host memory flat" *
          doctest::skip())
{
  const char* only     = std::getenv("ROUTING_REPLAY_SOAK_ONLY");
  const char* deadline = std::getenv("ROUTING_REPLAY_SOAK_DEADLINE_S");
  rr_test::cuda_soak_all_at_once(rr_test::soak_steps_from_env(), only != nullptr ? only : "",
                            deadline != nullptr ? std::strtoll(deadline, nullptr, 10) : 0);
}
