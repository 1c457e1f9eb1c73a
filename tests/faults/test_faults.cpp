// Fault injection: a full schedule (prefill, decode with drafts, a warm-up write, a step with a
// device-detected problem, mid-flight extraction, a prefix hit, an abort inside a step, block
// transfers, moves, a replacement object) runs once per failure point, with that one failing:
// - every backend operation (stream and event creation, copies, fills, kernel launches, event
//   records, stream waits, event queries, waits) and every device and pinned allocation, through
//   rr_test::faulty_backend over the host backend;
// - every host allocation the library makes inside a call (the global operator new is replaced in
//   this translation unit: fault_host_allocations.hpp).
// For each, rr_test::checked_replay checks the documented state after the failing call (unchanged,
// or its step discarded), that the rest of the schedule agrees with the reference model, and the
// final state; ASan and LSan (CI builds this under them) check that nothing leaks or is used after
// it is freed; a deadline checks that nothing hangs, destruction included.
#include "../support/fault_backend.hpp"
#include "../support/fault_host_allocations.hpp"
#include "../support/fault_sweep.hpp"
#include "../support/strategy_lists.hpp"

#include <routing_replay/routing_replay.hpp>

#include <doctest/doctest.h>

namespace rr = routing_replay;
using rr_test::fault_source;
using faulty_host = rr_test::faulty_backend<rr::host_backend>;

TEST_CASE_TEMPLATE_DEFINE("every backend operation and device/pinned allocation fails once: documented state, no leak, no hang",
                          RR, backend_faults)
{
  rr_test::check_sweep(rr_test::sweep<RR>(fault_source::backend), "backend");
}
// every strategy with each storage it takes: block-slot storage under a side-stream strategy files
// steps after the next one was planned, which the per-request pairings do not reach
TEST_CASE_TEMPLATE_APPLY(backend_faults, rr_test::every_strategy_and_storage<faulty_host>);

TEST_CASE_TEMPLATE_DEFINE("every host allocation inside a library call fails once: strong guarantee, no leak, no hang",
                          RR, host_allocation_faults)
{
  rr_test::check_sweep(rr_test::sweep<RR>(fault_source::host_new), "host allocations");
}
TEST_CASE_TEMPLATE_APPLY(host_allocation_faults, rr_test::one_per_strategy<faulty_host>);
