// The threading model (docs/design/threading.md, section 6; docs/reliability.md): one host thread
// drives a RoutingReplay at a time. Handing the object to another thread between calls is fine; a
// call from a second thread while another thread is inside the object is misuse, which debug builds
// (and builds that define ROUTING_REPLAY_CHECK_THREADS) detect and refuse with error invalid_state.
#include "../support/error_checks.hpp"
#include "../support/pipeline_stress.hpp"
#include "../support/small_replay.hpp"

#include <routing_replay/detail/thread_check.hpp>
#include <routing_replay/routing_replay.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

namespace rr = routing_replay;
using rr_test::plan_for;
using rr_test::small_replay;

namespace {

using replay = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major, rr::sync_copy,
                                 rr::per_request_storage>;

}  // namespace

TEST_CASE("the object may be handed from thread to thread between calls")
{
  small_replay<replay> s;
  std::vector<std::int64_t> slots;
  s.rr().add_request(1);
  std::thread{[&] { s.step(plan_for(1, 0, 3, slots), 1); }}.join();
  std::thread{[&] { s.step(plan_for(1, 3, 2, slots), 2); }}.join();
  CHECK(s.rr().recorded_rows(1) == 5);
}

#if ROUTING_REPLAY_CHECK_THREADS
// The detection is detail::thread_check; release builds without
// ROUTING_REPLAY_CHECK_THREADS compile it out, and this test with it.
TEST_CASE("a call from a second thread while the first is inside a blocking call is refused")
{
  small_replay<replay> s;
  std::vector<std::int64_t> slots;
  s.rr().add_request(1);
  s.rr().begin_step(plan_for(1, 0, 2, slots), s.stream());
  s.forward(2, [](std::int32_t, std::int64_t, std::int32_t) -> std::int64_t { return 3; });
  // a "kernel" that holds the compute stream shut: sync_copy's end_step waits for it
  std::vector<int> gate(1, 0);
  rr::host_backend::bulk_async(1, rr_test::wait_for_gate{gate.data()}, s.stream());
  std::thread first{[&] { s.rr().end_step(s.stream()); }};
  // end_step cannot return while the gate is shut; give the thread ample time to be inside it
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  rr_test::expect_error([&] { s.rr().add_request(2); }, rr::errc::invalid_state, {"thread"});
  rr_test::expect_error([&] { (void)s.rr().recorded_rows(1); }, rr::errc::invalid_state, {"thread"});
  cuda::atomic_ref<int, cuda::thread_scope_system>{gate[0]}.store(1);
  first.join();
  rr::host_backend::synchronize(s.stream());
  // the refused calls changed nothing, and the first thread's step was filed
  CHECK_FALSE(s.rr().contains(2));
  CHECK(s.rr().recorded_rows(1) == 2);
}
#endif
