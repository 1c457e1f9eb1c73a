// Randomized engine schedules on the CUDA backend, bit-exact against the reference model: every
// combination with double_buffered and device_scatter (see test_cuda_schedules.cu).
#include "../support/harness.hpp"
#include "../support/policy_combinations.hpp"

#include <routing_replay/routing_replay.cuh>

#include <doctest/doctest.h>

namespace rr = routing_replay;

TEST_CASE_TEMPLATE_DEFINE("CUDA: randomized schedules match the reference model (ring strategies)", RR,
                          schedules_cuda_ring)
{
  rr_test::check_randomized_schedules<RR>({1, 2, 3, 4});
}
TEST_CASE_TEMPLATE_APPLY(schedules_cuda_ring,
                         rr_test::concat<rr_test::all_combinations<rr::cuda_backend, rr::double_buffered<2>>,
                                         rr_test::all_combinations<rr::cuda_backend, rr::device_scatter<2>>>);
