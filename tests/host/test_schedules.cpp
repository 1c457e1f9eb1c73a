// Randomized engine schedules on the host backend, bit-exact against the reference model: the
// combinations with unsigned index types (test_schedules_signed.cpp has the others; two translation
// units so that two cores build them at once).
#include "../support/harness.hpp"
#include "../support/policy_combinations.hpp"

#include <doctest/doctest.h>

namespace rr = routing_replay;

TEST_CASE_TEMPLATE_DEFINE("randomized schedules match the reference model (8/16-bit unsigned ids)", RR, schedules_host)
{
  rr_test::check_randomized_schedules<RR>({1, 2, 3, 4, 8, 12});
}
TEST_CASE_TEMPLATE_APPLY(schedules_host, rr_test::unsigned_index_combinations<rr::host_backend, rr::sync_copy>);
