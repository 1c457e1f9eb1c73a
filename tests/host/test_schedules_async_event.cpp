// Randomized engine schedules on the host backend, bit-exact against the reference model: every
// index type x layout x storage with the async_event copy strategy (one translation unit per strategy,
// so that the cores build them at once).
#include "../support/harness.hpp"
#include "../support/policy_combinations.hpp"

#include <doctest/doctest.h>

namespace rr = routing_replay;

TEST_CASE_TEMPLATE_DEFINE("randomized schedules match the reference model (async_event)", RR, schedules_async_event)
{
  rr_test::check_randomized_schedules<RR>({1, 2, 3, 4, 8, 12});
}
TEST_CASE_TEMPLATE_APPLY(schedules_async_event, rr_test::all_combinations<rr::host_backend, rr::async_event>);
