// Randomized engine schedules, every policy combination on the CUDA backend, bit-exact against
// the reference model (the same harness as the host backend's).
#include "../support/harness.hpp"
#include "../support/policy_combinations.hpp"

#include <routing_replay/routing_replay.cuh>

#include <doctest/doctest.h>

namespace rr = routing_replay;

TEST_CASE_TEMPLATE_DEFINE("CUDA: randomized schedules match the reference model", RR, schedules_cuda)
{
  for (std::uint64_t seed : {1u, 2u, 3u, 4u}) {
    CAPTURE(seed);
    rr_test::harness_shape shape;
    shape.overwrite = seed == 3;
    rr_test::replay_harness<RR> harness{rr_test::schedule_for_seed(seed), shape, seed};
    harness.run();
  }
}
TEST_CASE_TEMPLATE_APPLY(schedules_cuda, rr_test::all_combinations<rr::cuda_backend, rr::sync_copy>);
