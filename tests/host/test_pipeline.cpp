// Ordering of the copy pipeline on the host backend, whose streams are real worker threads: the
// stress run (slow copies, many steps in flight, mid-pipeline extraction) for every strategy, and
// the gate that proves end_step() and the compute stream never wait for a copy.
#include "../support/pipeline_stress.hpp"
#include "../support/strategy_lists.hpp"

#include <doctest/doctest.h>

namespace rr = routing_replay;

TEST_CASE_TEMPLATE_DEFINE("pipeline stress: slow copies, many steps in flight, extraction mid-pipeline", RR,
                          stress_host)
{
  rr_test::check_pipeline_stress<RR>(/*copy_delay_us=*/300, /*decode_steps=*/60);
}
TEST_CASE_TEMPLATE_APPLY(stress_host, rr_test::one_per_strategy<rr::host_backend>);

TEST_CASE_TEMPLATE_DEFINE("with the copy stream shut, end_step returns and the compute stream runs on", RR,
                          gate_host)
{
  rr_test::check_compute_never_waits_for_copies<RR>();
}
TEST_CASE_TEMPLATE_APPLY(gate_host, rr_test::side_stream_strategies<rr::host_backend>);
