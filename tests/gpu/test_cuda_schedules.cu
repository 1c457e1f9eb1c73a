// Randomized engine schedules on the CUDA backend, bit-exact against the reference model (the same
// harness as the host backend's): every combination with the sync and async_event strategies
// (test_cuda_schedules_ring.cu has the ring strategies; two translation units build in parallel).
#include "../support/harness.hpp"
#include "../support/policy_combinations.hpp"

#include <routing_replay/routing_replay.cuh>

#include <doctest/doctest.h>

namespace rr = routing_replay;

TEST_CASE_TEMPLATE_DEFINE("CUDA: randomized schedules match the reference model", RR, schedules_cuda)
{
  rr_test::check_randomized_schedules<RR>({1, 2, 3, 4});
}
TEST_CASE_TEMPLATE_APPLY(schedules_cuda, rr_test::concat<rr_test::all_combinations<rr::cuda_backend, rr::sync_copy>,
                                                         rr_test::all_combinations<rr::cuda_backend, rr::async_event>>);
