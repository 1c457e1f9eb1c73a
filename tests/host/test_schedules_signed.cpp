// Randomized engine schedules on the host backend, bit-exact against the reference model: the
// combinations with signed index types (see test_schedules.cpp).
#include "../support/harness.hpp"
#include "../support/policy_combinations.hpp"

#include <doctest/doctest.h>

namespace rr = routing_replay;

TEST_CASE_TEMPLATE_DEFINE("randomized schedules match the reference model (16/32-bit signed ids)", RR, schedules_host_signed)
{
  rr_test::check_randomized_schedules<RR>({1, 2, 3, 4, 8, 12});
}
TEST_CASE_TEMPLATE_APPLY(schedules_host_signed, rr_test::signed_index_combinations<rr::host_backend, rr::sync_copy>);
