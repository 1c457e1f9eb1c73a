// Core bugs found by the fuzzer and the fault sweeps (docs/reliability.md section 3), one
// deterministic test each, asserting the fixed behaviour: each failed, or crashed under ASan, before
// its fix.
#include "../support/error_checks.hpp"
#include "../support/fault_backend.hpp"
#include "../support/pipeline_stress.hpp"
#include "../support/small_replay.hpp"

#include <routing_replay/routing_replay.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <vector>

namespace rr = routing_replay;
using rr_test::expect_error;
using rr_test::fault_injector;
using rr_test::fault_source;
using rr_test::plan_for;
using rr_test::small_replay;

namespace {

using faulty_host = rr_test::faulty_backend<rr::host_backend>;
using host_sync       = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major, rr::sync_copy, rr::per_request_storage>;
using host_block_slot = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::token_major, rr::sync_copy, rr::block_slot_storage>;
using faulty_sync = rr::RoutingReplay<faulty_host, std::int16_t, rr::layer_major, rr::sync_copy, rr::per_request_storage>;
using faulty_async = rr::RoutingReplay<faulty_host, std::int16_t, rr::layer_major, rr::async_event, rr::per_request_storage>;

std::int64_t valid_id(std::int32_t, std::int64_t, std::int32_t) { return 3; }

// Ends the open step, `rows` rows, with a layer left unwritten: the step (`step`, "step N" as its
// error names it) is discarded.
template <class Replay>
void end_discarded(small_replay<Replay>& s, std::int32_t rows, const char* step)
{
  s.forward(rows, valid_id, /*skip_slot=*/1);
  expect_error([&] { s.end_step(); }, rr::errc::missing_routing, {step});
}

// Fails the `occurrence`-th backend operation named `op` from here on, then stops.
struct fail_backend_op {
  fail_backend_op(const char* op, std::uint64_t occurrence) { fault_injector::get().arm_op(op, occurrence); }
  fail_backend_op(const fail_backend_op&)            = delete;
  fail_backend_op& operator=(const fail_backend_op&) = delete;
  ~fail_backend_op() { fault_injector::get().disarm(); }
};

// Fails the `k`-th host allocation inside a library call marked as `call`.
struct fail_allocation {
  fail_allocation(std::uint64_t k, const char* call) : scope(call)
  {
    fault_injector::get().arm(fault_source::host_new, k);
  }
  fail_allocation(const fail_allocation&)            = delete;
  fail_allocation& operator=(const fail_allocation&) = delete;
  ~fail_allocation() { fault_injector::get().disarm(); }
  fault_injector::call_scope scope;
};

// Opens a gate (a flag a wait_for_gate "kernel" spins on) after `delay`, from another thread.
std::thread open_gate_after(std::vector<int>& gate, std::chrono::milliseconds delay)
{
  return std::thread{[&gate, delay] {
    std::this_thread::sleep_for(delay);
    cuda::atomic_ref<int, cuda::thread_scope_system>{gate[0]}.store(1);
  }};
}

}  // namespace

// CORE-BUG-1: begin_step accepts step_plan::set_padded_rows past max_tokens_per_step, and the
// end-of-step kernel then resets rows past the end of D: a heap overflow on the host backend, an
// out-of-bounds device write on CUDA. The plan must be refused with too_many_tokens.
TEST_CASE("CORE-BUG-1: a declared padding past max_tokens_per_step is refused")
{
  small_replay<host_sync> s;
  std::vector<std::int64_t> slots;
  s.rr().add_request(1);
  auto plan = plan_for(1, 0, 2, slots);
  plan.set_padded_rows(9);  // max_tokens_per_step is 8
  expect_error([&] { s.rr().begin_step(plan, s.stream()); }, rr::errc::too_many_tokens, {"9"});
  s.step(plan_for(1, 0, 2, slots), 1);
  CHECK(s.rr().recorded_rows(1) == 2);
}

// CORE-BUG-8: begin_step checks `first_position + num_tokens > max_model_len`, which overflows for
// a first position near INT64_MAX (undefined behaviour; in practice it wraps negative and passes):
// the plan is accepted and rows are claimed at a position far past any storage.
TEST_CASE("CORE-BUG-8: a position near INT64_MAX is refused, not wrapped")
{
  small_replay<host_sync> s;
  std::vector<std::int64_t> slots = {0, 1, 2};
  s.rr().add_request(1);
  rr::step_plan plan;
  plan.schedule({1, std::numeric_limits<std::int64_t>::max() - 1, 3, 0, slots});
  expect_error([&] { s.rr().begin_step(plan, s.stream()); }, rr::errc::position_out_of_range, {"max_model_len"});
  CHECK(s.rr().host_bytes() == 0);
}

// CORE-BUG-9: a step that hands out no rows (N = 0, no capture path given rows) skips the
// end-of-step kernel, so what the capture paths reported during it (a device_ref::record outside
// the buffer) is neither reported for that step nor cleared: the next, clean step is discarded for
// it. Found by the fuzzer (tests/fuzz/core_bugs/core-bug-9-empty-step-report).
TEST_CASE("CORE-BUG-9: a record outside the buffer in an empty step is reported for that step")
{
  small_replay<host_sync> s;
  std::vector<std::int64_t> slots;
  s.rr().add_request(1);
  s.rr().begin_step(rr::step_plan{}, s.stream());  // no rows
  auto ref = s.rr().ref(0);
  rr::host_backend::bulk_async(1, rr_test::record_past_the_end<decltype(ref)>{ref}, s.stream());
  expect_error([&] { s.end_step(); }, rr::errc::invalid_argument, {"step 1", "outside the buffer"});
  s.step(plan_for(1, 0, 2, slots), 1);  // a clean step
  CHECK(s.rr().recorded_rows(1) == 2);
}

// CORE-BUG-10: block-slot storage claims a step's rows when it begins; a step that re-claims a
// slot already holding a row (overwrite_recomputed_rows, or a later write taking over a tentative
// draft row) and is then discarded writes the sentinel over that row and unclaims it: a row stored
// before the error is lost. Found by the fuzzer (tests/fuzz/core_bugs/).
TEST_CASE("CORE-BUG-10: a discarded step does not erase the rows it would have replaced")
{
  small_replay<host_block_slot> s{rr_test::small_config(/*overwrite_recomputed_rows=*/true)};
  std::vector<std::int64_t> slots;
  s.rr().add_request(1);
  auto first = plan_for(1, 0, 2, slots);
  const std::int64_t block0[] = {0};
  first.add_fresh_blocks(block0);
  s.step(first, 1);
  const auto before = s.rows(1);
  s.rr().begin_step(plan_for(1, 0, 1, slots), s.stream());  // recompute position 0 at its slot
  end_discarded(s, 1, "step 2");
  CHECK(s.rows(1) == before);
}

// CORE-BUG-12: block-slot storage; a step re-claims the slot of a tentative draft row, its request
// is aborted while the step is open, and the step is then discarded. The discard asked whether the
// draft's group still held the row; the request was gone, so it read the handle's reset state and
// let the row go (sentinel), though slot-indexed rows outlive their request and the row was stored
// before the step. Found by the fuzzer (tests/fuzz/core_bugs/core-bug-12-discard-after-abort-drops-slot-row).
TEST_CASE("CORE-BUG-12: a step discarded after its request was aborted leaves the slot rows stored before it")
{
  small_replay<host_block_slot> s{rr_test::small_config()};
  s.rr().add_request(1);
  const std::int64_t slots_a[] = {0, 1};
  const std::int64_t block0[]  = {0};
  rr::step_plan a;
  a.schedule({.id = 1, .first_position = 0, .num_tokens = 2, .num_draft_tokens = 1, .slots = slots_a});
  a.add_fresh_blocks(block0);
  s.step(a, 1);  // position 1 is a tentative draft row at slot 1
  const std::int64_t blocks[] = {0};
  std::vector<std::int16_t> before(static_cast<std::size_t>(4 * s.rr().row_size()));
  s.rr().export_blocks(blocks, before);
  const std::int64_t slots_b[] = {1};
  rr::step_plan b;
  b.schedule({.id = 1, .first_position = 1, .num_tokens = 1, .slots = slots_b});  // takes the draft row over
  s.rr().begin_step(b, s.stream());
  s.rr().abort(1);
  end_discarded(s, 1, "step 2");
  std::vector<std::int16_t> after(before.size());
  s.rr().export_blocks(blocks, after);
  CHECK(after == before);
}

// CORE-BUG-2 (a): the status of a step whose end_step failed while enqueuing its copy is never
// reset: the ring slot's next step inherits its problem and is discarded for it.
TEST_CASE("CORE-BUG-2a: a step whose status reset failed to enqueue does not poison the next one")
{
  small_replay<faulty_sync> s;
  std::vector<std::int64_t> slots;
  s.rr().add_request(1);
  s.rr().begin_step(plan_for(1, 0, 2, slots), s.stream());
  s.forward(2, valid_id, /*skip_slot=*/1);  // layer 2 left unwritten: the step has a problem
  {
    fail_backend_op fail{"fill_2d_async", 1};  // the reset of the step's status
    expect_error([&] { s.end_step(); }, rr::errc::backend_error, {"fill_2d_async"});
  }
  s.step(plan_for(1, 0, 2, slots), 2);  // a clean step, in the same ring slot
  CHECK(s.rr().recorded_rows(1) == 2);
}

// CORE-BUG-2 (b): work enqueued for a step before its end_step failed is still queued when the
// ring slot is reused; its status reset runs after the next step's check and erases it, so an id
// outside [0, E) is filed as routing.
TEST_CASE("CORE-BUG-2b: a failed step's queued work cannot erase the next step's problem")
{
  rr::host_stream compute;
  rr::host_stream copies;
  faulty_async r{rr_test::small_config(), copies.ref()};
  std::vector<int> gate(1, 0);
  rr::host_backend::bulk_async(1, rr_test::wait_for_gate{gate.data()}, copies.ref());  // copies held
  std::thread opener = open_gate_after(gate, std::chrono::milliseconds(300));
  std::vector<std::int64_t> slots;
  std::vector<std::int64_t> ids(2 * 3, 2);  // [2 rows, K + 1 shared], every id valid
  r.add_request(1);
  r.begin_step(plan_for(1, 0, 2, slots), compute.ref());
  r.capture(1, ids.data(), 2, compute.ref());
  r.capture(2, ids.data(), 2, compute.ref());
  {
    fail_backend_op fail{"record", 2};  // the step's last operation: its copies are enqueued
    expect_error([&] { r.end_step(compute.ref()); }, rr::errc::backend_error, {"record"});
  }
  r.begin_step(plan_for(1, 0, 2, slots), compute.ref());
  r.capture(1, ids.data(), 2, compute.ref());
  r.capture(2, ids.data(), 2, compute.ref());
  auto view = r.layer_view(1, 2);
  rr::host_backend::bulk_async(1, rr_test::write_out_of_range<decltype(view)>{view}, compute.ref());  // 9 >= E
  r.end_step(compute.ref());
  opener.join();
  expect_error([&] { r.drain(); }, rr::errc::invalid_expert_id, {"value 9"});
  rr::host_backend::synchronize(compute.ref());
  rr::host_backend::synchronize(copies.ref());
}

// CORE-BUG-2 (c): when the end-of-step kernel fails to launch, D and the capture status keep what
// the failed step wrote and reported: the next step inherits its invalid ids.
TEST_CASE("CORE-BUG-2c: a step whose end-of-step kernel failed to launch does not poison the next one")
{
  small_replay<faulty_sync> s;
  std::vector<std::int64_t> slots;
  s.rr().add_request(1);
  s.rr().begin_step(plan_for(1, 0, 2, slots), s.stream());
  s.forward(2, [](std::int32_t, std::int64_t row, std::int32_t) -> std::int64_t { return row == 1 ? 100 : 1; });
  {
    fail_backend_op fail{"launch_async", 1};  // the end-of-step kernel
    expect_error([&] { s.end_step(); }, rr::errc::backend_error, {"launch_async"});
  }
  s.step(plan_for(1, 0, 2, slots), 2);
  CHECK(s.rr().recorded_rows(1) == 2);
}

// CORE-BUG-3: after end_step failed to enqueue a step (here: its final event record), the copies
// already enqueued for it on the library's own copy stream are not waited for: the destructor
// frees the ring (declared last, destroyed first) while that stream still copies from it
// (heap-use-after-free on the host backend).
TEST_CASE("CORE-BUG-3: destruction after a failed end_step waits for the copies it enqueued")
{
  constexpr std::int32_t rows = 1 << 19;  // a large step: its copy takes a while
  auto config                 = rr_test::small_config();
  config.max_tokens_per_step  = rows;
  config.max_model_len        = rows;
  rr::host_stream compute;
  std::vector<int> gate(1, 0);
  std::vector<std::int64_t> ids(static_cast<std::size_t>(rows) * 3, 2);
  std::vector<std::int64_t> slots;
  {
    faulty_async r{config};  // copies on its own stream
    r.add_request(1);
    r.begin_step(plan_for(1, 0, rows, slots), compute.ref());
    r.capture(1, ids.data(), rows, compute.ref());
    r.capture(2, ids.data(), rows, compute.ref());
    rr::host_backend::bulk_async(1, rr_test::wait_for_gate{gate.data()}, compute.ref());  // hold the kernel
    // the failed end_step waits for the work it enqueued, so the gate opens on its own
    std::thread opener = open_gate_after(gate, std::chrono::milliseconds(300));
    {
      fail_backend_op fail{"record", 2};  // the final record: the copies are enqueued, the step discarded
      expect_error([&] { r.end_step(compute.ref()); }, rr::errc::backend_error, {"record"});
    }
    opener.join();
    rr::host_backend::synchronize(compute.ref());  // the engine's stream is done
  }
}

// CORE-BUG-4: add_request registers the id before it opens the request's storage; a failed host
// allocation after that leaves the request live although add_request threw.
TEST_CASE("CORE-BUG-4: add_request is strong when a host allocation fails")
{
  small_replay<faulty_sync> s;
  const std::string id = "a-request-id-long-enough-to-live-on-the-heap";
  for (std::uint64_t k = 1;; ++k) {
    CAPTURE(k);
    bool threw = false;
    {
      fail_allocation fail{k, "add_request"};
      try {
        s.rr().add_request(id);
      } catch (const std::bad_alloc&) {
        threw = true;
      }
    }
    if (!threw) { break; }
    CHECK_FALSE(s.rr().contains(id));
    CHECK(s.rr().num_requests() == 0);
  }
  CHECK(s.rr().contains(id));
}

// CORE-BUG-5: begin_step changes state (the step serial, fresh-block generations, request storage,
// draft groups, block-slot claims) before it makes its last allocations; a failed host allocation
// then leaves a step half-applied although begin_step threw.
TEST_CASE("CORE-BUG-5: begin_step is strong when a host allocation fails")
{
  small_replay<faulty_sync> s;
  std::vector<std::int64_t> slots;
  s.rr().add_request(1);
  s.rr().add_request(2);
  s.step(plan_for(1, 0, 2, slots), 1);
  const std::size_t bytes = s.rr().host_bytes();
  std::vector<std::int64_t> slots2 = {0, 1, 2};
  rr::step_plan plan;
  plan.schedule({1, 2, 3, 2, slots});    // request 1 with two drafts
  plan.schedule({2, 0, 3, 0, slots2});   // request 2 grows its storage
  for (std::uint64_t k = 1;; ++k) {
    CAPTURE(k);
    bool threw = false;
    {
      fail_allocation fail{k, "begin_step"};
      try {
        s.rr().begin_step(plan, s.stream());
      } catch (const std::bad_alloc&) {
        threw = true;
      }
    }
    if (!threw) { break; }
    CHECK(s.rr().host_bytes() == bytes);
    CHECK_NOTHROW((void)s.rr().extract(1));  // no draft group of a step that never began
  }
  s.forward(6, valid_id);
  s.end_step();
  CHECK(s.rr().recorded_rows(2) == 3);
}

// CORE-BUG-6: release and abort forget the request, then append its handle to the free list; a
// failed host allocation there throws after the request is already gone.
TEST_CASE("CORE-BUG-6: release and abort are strong when a host allocation fails")
{
  small_replay<faulty_sync> s;
  s.rr().add_request(1);
  bool threw = false;
  {
    fail_allocation fail{1, "release"};
    try {
      s.rr().release(1);
    } catch (const std::bad_alloc&) {
      threw = true;
    }
  }
  if (threw) {  // it had to allocate: then it must have changed nothing
    CHECK(s.rr().contains(1));
    CHECK(s.rr().num_requests() == 1);
  } else {  // it released without allocating (room for the handle was made when it was added)
    CHECK_FALSE(s.rr().contains(1));
  }
}

// CORE-BUG-7: the host backend frees "device" memory without waiting for the streams, where CUDA's
// frees synchronize the device: destroying the object while a capture it enqueued is still queued
// on the engine's stream lets that capture write freed memory.
TEST_CASE("CORE-BUG-7: destroying the object waits for its work on the engine's stream (host backend)")
{
  rr::host_stream compute;
  std::vector<int> gate(1, 0);
  std::vector<std::int64_t> ids(8 * 3, 2);
  rr::host_backend::bulk_async(1, rr_test::wait_for_gate{gate.data()}, compute.ref());
  std::thread opener = open_gate_after(gate, std::chrono::milliseconds(300));
  {
    host_sync r{rr_test::small_config()};
    r.capture(1, ids.data(), 8, compute.ref());  // a warm-up capture, queued behind the gate
  }  // as on CUDA, freeing D waits for the capture (which waits for the gate)
  opener.join();
  rr::host_backend::synchronize(compute.ref());
}

// CORE-BUG-13: block-slot storage maps a step's positions when the step begins, but readers see
// filed steps only. A position recomputed into new blocks read as missing while the step was open
// (its new slot not yet filed), and one recomputed into a slot another request had already filled
// read that request's row at once, where it had its own prefix row until the step was filed. Found
// by the fuzzer (tests/fuzz/core_bugs/core-bug-13-recompute-into-held-slot-read-while-open).
TEST_CASE("CORE-BUG-13: a position recomputed by the open step reads as before the step until it is filed")
{
  const std::int64_t block2[] = {2};
  const std::int64_t block3[] = {3};
  const std::int64_t slots_8_9[]   = {8, 9};
  const std::int64_t slots_12_13[] = {12, 13};

  small_replay<host_block_slot> s{rr_test::small_config()};
  s.rr().add_request(1);
  rr::step_plan first;
  first.schedule({.id = 1, .first_position = 0, .num_tokens = 2, .slots = slots_8_9});
  first.add_fresh_blocks(block2);
  s.step(first, 1);
  const auto before = s.rows(1);
  rr::step_plan again;  // request 1's positions recomputed into a fresh block
  again.schedule({.id = 1, .first_position = 0, .num_tokens = 2, .slots = slots_12_13});
  again.add_fresh_blocks(block3);

  SUBCASE("recomputed into fresh blocks (preemption)")
  {
    s.rr().begin_step(again, s.stream());
    CHECK(s.rows(1) == before);
    s.forward(2, valid_id);
    s.end_step();
    CHECK(s.rows(1) == before);  // the first rows followed their positions
  }

  SUBCASE("recomputed into a slot another request filled")
  {
    s.rr().add_request(2);
    rr::step_plan other;
    other.schedule({.id = 2, .first_position = 0, .num_tokens = 2, .slots = slots_12_13});
    other.add_fresh_blocks(block3);
    s.step(other, 2);
    s.rr().add_request(3, {.cached_slots = slots_8_9});  // request 1's prefix
    REQUIRE(s.rows(3) == before);
    rr::step_plan recompute;
    recompute.schedule({.id = 3, .first_position = 0, .num_tokens = 2, .slots = slots_12_13});
    s.rr().begin_step(recompute, s.stream());  // request 2's rows stay there (first write wins)
    CHECK(s.rows(3) == before);
    s.forward(2, valid_id);
    s.end_step();
    CHECK(s.rows(3) == s.rows(2));  // filed: the position now maps to the slot's row
  }

  SUBCASE("a discarded recompute leaves the mapping as it was")
  {
    s.rr().begin_step(again, s.stream());
    end_discarded(s, 2, "step 2");
    CHECK(s.rows(1) == before);
  }
}

// CORE-BUG-14: where rows are claimed when a step begins, readers count a request's rows as they
// were before the open step (step_run::recorded_before, taken when it began). Drafts accepted while
// the step was open did not raise it: recorded_rows and extract missed the accepted positions until
// the step was filed. Found by the fuzzer (tests/fuzz/core_bugs/core-bug-14-draft-accepted-while-step-open).
// The first fix then counted the open step's own drafts too, accepted before their rows were filed;
// found by the fuzzer again (that input was not kept; the second subcase reproduces it).
TEST_CASE("CORE-BUG-14: drafts accepted while a step is open count at once, unless they are its own")
{
  small_replay<host_block_slot> s{rr_test::small_config()};
  s.rr().add_request(1);
  const std::int64_t block0[] = {0};

  SUBCASE("an earlier step's drafts")
  {
    const std::int64_t slots_a[] = {0, 1};
    rr::step_plan a;
    a.schedule({.id = 1, .first_position = 0, .num_tokens = 2, .num_draft_tokens = 1, .slots = slots_a});
    a.add_fresh_blocks(block0);
    s.step(a, 1);  // position 1 is a draft
    CHECK(s.rr().recorded_rows(1) == 1);
    const std::int64_t slots_b[] = {2, 3};
    rr::step_plan b;
    b.schedule({.id = 1, .first_position = 2, .num_tokens = 2, .slots = slots_b});
    s.rr().begin_step(b, s.stream());
    s.rr().accept_draft(1, 1);
    CHECK(s.rr().recorded_rows(1) == 2);
    CHECK(s.rr().extract(1).num_rows() == 2);
    s.forward(2, valid_id);
    s.end_step();
    CHECK(s.rr().recorded_rows(1) == 4);
  }

  SUBCASE("the open step's own drafts wait for its rows")
  {
    const std::int64_t slots_a[] = {0, 1};
    rr::step_plan a;
    a.schedule({.id = 1, .first_position = 0, .num_tokens = 2, .slots = slots_a});
    a.add_fresh_blocks(block0);
    s.step(a, 2);
    CHECK(s.rr().recorded_rows(1) == 2);
    const std::int64_t slots_b[] = {2, 3};
    rr::step_plan b;
    b.schedule({.id = 1, .first_position = 2, .num_tokens = 2, .num_draft_tokens = 1, .slots = slots_b});
    s.rr().begin_step(b, s.stream());
    s.rr().accept_draft(1, 1);  // position 3, not filed yet
    CHECK(s.rr().recorded_rows(1) == 2);
    CHECK(s.rr().extract(1).num_rows() == 2);
    s.forward(2, valid_id);
    s.end_step();
    CHECK(s.rr().recorded_rows(1) == 4);
    CHECK(s.rr().extract(1).num_rows() == 4);
  }
}

// CORE-BUG-15: block-slot storage claims a step's slots when it begins; readers see filed steps
// only. A claim that replaced a row another request reads through the prefix cache
// (overwrite_recomputed_rows) hid that row while the claiming step was open: it read as missing,
// though nothing had written the slot yet. And a reader filed only the steps it had scheduled or
// bound before, so a later step's claim of a slot it shares read as missing until something else
// filed that step. Found by the fuzzer (tests/fuzz/core_bugs/core-bug-15-shared-row-replaced-by-open-step).
TEST_CASE("CORE-BUG-15: a shared slot claimed again by a later step reads as the steps filed")
{
  auto config                      = rr_test::small_config();
  config.overwrite_recomputed_rows = true;
  const std::int64_t block2[]      = {2};
  const std::int64_t slots_8_9[]   = {8, 9};
  rr::step_plan first;
  first.schedule({.id = 1, .first_position = 0, .num_tokens = 2, .slots = slots_8_9});
  first.add_fresh_blocks(block2);
  rr::step_plan again;  // request 1 recomputes its prefix in place: the new rows replace the old
  again.schedule({.id = 1, .first_position = 0, .num_tokens = 2, .slots = slots_8_9});

  SUBCASE("while the step that replaces the row is open")
  {
    small_replay<host_block_slot> s{config};
    s.rr().add_request(1);
    s.step(first, 1);
    const auto prefix = s.rows(1);
    s.rr().add_request(2, {.cached_slots = slots_8_9});
    REQUIRE(s.rows(2) == prefix);
    s.rr().begin_step(again, s.stream());
    CHECK(s.rows(2) == prefix);
    s.forward(2, valid_id);
    s.end_step();
    const auto replaced = s.rows(2);
    CHECK(replaced != prefix);
    CHECK(replaced == s.rows(1));
  }

  SUBCASE("once that step has ended, before it is filed")
  {
    using block_slot = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::token_major, rr::async_event,
                                         rr::block_slot_storage>;
    small_replay<block_slot> s{config};
    s.rr().add_request(1);
    s.step(first, 1);
    const auto prefix = s.rows(1);
    s.rr().add_request(2, {.cached_slots = slots_8_9});
    REQUIRE(s.rows(2) == prefix);
    s.step(again, 2);           // filed by the next push, a drain or a read
    const auto replaced = s.rows(2);  // request 2 never scheduled or bound anything of step 2
    CHECK(replaced != prefix);
    CHECK(replaced == s.rows(1));
  }
}

TEST_CASE("CORE-BUG-16: a plan whose token counts sum below zero is refused as invalid, with a device scatter too")
{
  // a device scatter over per-request storage reserved the step's pieces for the plan's rows before
  // checking the runs: -1 rows made std::vector::reserve throw std::length_error
  using scattered = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major, rr::device_scatter<2>,
                                      rr::per_request_storage>;
  small_replay<scattered> s;
  s.rr().add_request(1);
  s.rr().add_request(2);
  std::vector<std::int64_t> no_slots;
  s.step(plan_for(1, 0, 2, no_slots), 1);
  rr::step_plan plan;
  plan.schedule({.id = 2, .first_position = 0, .num_tokens = -1});
  expect_error([&] { s.rr().begin_step(plan, s.stream()); }, rr::errc::invalid_plan, {"negative token count -1"});
  // a run claimed before the refusal, in a plan of fewer rows than that run's
  plan.clear();
  plan.schedule({.id = 1, .first_position = 2, .num_tokens = 3});
  plan.schedule({.id = 2, .first_position = 0, .num_tokens = -5});
  expect_error([&] { s.rr().begin_step(plan, s.stream()); }, rr::errc::invalid_plan, {"negative token count -5"});
  CHECK(s.rr().recorded_rows(1) == 2);
  s.step(plan_for(1, 2, 1, no_slots), 2);  // still usable, request 1's rows where they were
  CHECK(s.rr().recorded_rows(1) == 3);
}

TEST_CASE("CORE-BUG-18: a run without tokens reserves storage up to its position, with a device scatter too")
{
  // a device scatter over per-request storage took a zero-token run for a common one (nothing to
  // claim) and skipped the growth every other strategy makes for it
  using scattered = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major, rr::device_scatter<2>,
                                      rr::per_request_storage>;
  small_replay<host_sync> plain;
  small_replay<scattered> s;
  rr::step_plan plan;
  plan.schedule({.id = 42, .first_position = 8, .num_tokens = 0});
  plain.rr().add_request(42);
  s.rr().add_request(42);
  plain.step(plan, 1);
  s.step(plan, 1);
  CHECK(plain.rr().host_bytes() > 0);
  CHECK(s.rr().host_bytes() == plain.rr().host_bytes());
  CHECK(s.rr().recorded_rows(42) == 0);
}
