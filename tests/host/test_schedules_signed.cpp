// Randomized engine schedules on the host backend, bit-exact against the reference model: the
// combinations with signed index types (see test_schedules.cpp).
#include "../support/harness.hpp"
#include "../support/policy_combinations.hpp"

#include <doctest/doctest.h>

namespace rr = routing_replay;

TEST_CASE_TEMPLATE_DEFINE("randomized schedules match the reference model (16/32-bit signed ids)", RR, schedules_host_signed)
{
  for (std::uint64_t seed : {1u, 2u, 3u, 4u, 8u, 12u}) {
    CAPTURE(seed);
    rr_test::harness_shape shape;
    shape.overwrite = seed == 3;  // preemption policy: first write wins, or overwrite
    rr_test::replay_harness<RR> harness{rr_test::schedule_for_seed(seed), shape, seed};
    harness.run();
  }
}
TEST_CASE_TEMPLATE_APPLY(schedules_host_signed, rr_test::signed_index_combinations<rr::host_backend, rr::sync_copy>);
