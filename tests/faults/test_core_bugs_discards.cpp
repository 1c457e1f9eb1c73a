// Core bugs of steps discarded after something else had already relied on them (docs/reliability.md
// section 3), one deterministic test each, asserting the fixed behaviour: each failed before its fix.
// The earlier core bugs are in test_core_bugs.cpp.
#include "../support/error_checks.hpp"
#include "../support/small_replay.hpp"

#include <routing_replay/routing_replay.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace rr = routing_replay;
using rr_test::expect_error;
using rr_test::small_replay;

namespace {

using sync_block_slot  = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::token_major, rr::sync_copy, rr::block_slot_storage>;
using async_block_slot = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major, rr::async_event, rr::block_slot_storage>;

std::int64_t valid_id(std::int32_t, std::int64_t, std::int32_t) { return 3; }

}  // namespace

// CORE-BUG-19: where rows are claimed when a step begins, a step's draft group counts as filed once
// its rows are claimed, so accept_draft committed the accepted positions at once, even while the
// step was open or in flight. A discard of that step then undid T only if nothing had moved it since
// the step began: the acceptance had, so the request kept rows that were never stored (they read as
// missing). Found by the fuzzer (tests/fuzz/core_bugs/core-bug-19-drafts-accepted-in-a-discarded-step).
TEST_CASE_TEMPLATE("CORE-BUG-19: drafts accepted before their step is filed commit with it, and not if it is discarded",
                   RR, sync_block_slot, async_block_slot)
{
  small_replay<RR> s{rr_test::small_config()};
  s.rr().add_request(1);
  const std::int64_t block0[] = {0};
  const std::int64_t slots[]  = {0, 1, 2};
  rr::step_plan plan;  // position 0, then drafts at positions 1 and 2
  plan.schedule({.id = 1, .first_position = 0, .num_tokens = 3, .num_draft_tokens = 2, .slots = slots});
  plan.add_fresh_blocks(block0);
  constexpr bool deferred = std::is_same_v<RR, async_block_slot>;

  SUBCASE("accepted while the step is open, which is then discarded")
  {
    s.rr().begin_step(plan, s.stream());
    s.rr().accept_draft(1, 1);
    s.forward(3, valid_id, /*skip_slot=*/1);
    if constexpr (deferred) {
      s.end_step();
      expect_error([&] { s.rr().drain(); }, rr::errc::missing_routing, {"step 1"});
    } else {
      expect_error([&] { s.end_step(); }, rr::errc::missing_routing, {"step 1"});
    }
    CHECK(s.rr().recorded_rows(1) == 0);
    CHECK(s.rr().extract(1).num_rows() == 0);
  }

  SUBCASE("accepted while the step is in flight, which is then discarded")
  {
    if constexpr (deferred) {
      s.rr().begin_step(plan, s.stream());
      s.forward(3, valid_id, /*skip_slot=*/1);
      s.end_step();
      s.rr().accept_draft(1, 2);
      expect_error([&] { static_cast<void>(s.rr().recorded_rows(1)); }, rr::errc::missing_routing, {"step 1"});
      CHECK(s.rr().recorded_rows(1) == 0);
    }
  }

  SUBCASE("accepted while the step is open or in flight, which is then filed")
  {
    s.rr().begin_step(plan, s.stream());
    s.rr().accept_draft(1, 1);
    CHECK(s.rr().recorded_rows(1) == 0);  // the open step's rows, accepted drafts included, wait for it
    s.forward(3, valid_id);
    s.end_step();
    CHECK(s.rr().recorded_rows(1) == 2);
    const auto rows = s.rows(1);
    REQUIRE(rows.size() == 2 * 4);
    CHECK(std::count(rows.begin(), rows.end(), std::int16_t{3}) == 8);
  }
}

// CORE-BUG-20: block-slot storage kept a prefix position's mapping when a prefix hit was bound again
// while its slot was claimed, even where only the open step claimed it (for another request's
// position): nothing had written that slot. Once that step was discarded and a later step filled the
// slot for its own position, the prefix position read that row, another position's routing, where
// the prefix hit had named a slot with no row (missing). Found by the fuzzer
// (tests/fuzz/core_bugs/core-bug-20-prefix-bound-over-an-open-claim).
TEST_CASE("CORE-BUG-20: a prefix bound again over a slot only the open step claimed follows the new slot")
{
  small_replay<sync_block_slot> s{rr_test::small_config()};
  s.rr().add_request(1);
  const std::int64_t block1[]   = {1};
  const std::int64_t slots_4[]  = {4};
  const std::int64_t first[]    = {4};   // request 2's position 0, at slot 4 (claimed below, no row)
  const std::int64_t again[]    = {12};  // bound again: slot 12, which holds nothing
  rr::step_plan plan;
  plan.schedule({.id = 1, .first_position = 0, .num_tokens = 1, .slots = slots_4});
  plan.add_fresh_blocks(block1);
  s.rr().begin_step(plan, s.stream());
  s.rr().add_request(2, {.cached_slots = first});
  s.rr().add_cached_prefix(2, again);
  s.forward(1, valid_id, /*skip_slot=*/1);
  expect_error([&] { s.end_step(); }, rr::errc::missing_routing, {"step 1"});
  rr::step_plan retry;  // request 1's position 0 at slot 4 after all, in the same block generation
  retry.schedule({.id = 1, .first_position = 0, .num_tokens = 1, .slots = slots_4});
  s.step(retry, 1);
  const auto rows = s.rows(2);
  REQUIRE(rows.size() == 4);
  CHECK(std::all_of(rows.begin(), rows.end(), [](std::int16_t v) { return v == -1; }));
  CHECK(s.rows(1) != rows);
}

namespace {
using scattered_per_request =
  rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major, rr::device_scatter<2>, rr::per_request_storage>;
}  // namespace

// CORE-BUG-21: where rows are claimed when a step begins, readers count a request's rows as they
// were before the open step (step_run::recorded_before). A prefix bound while a step that schedules
// the request was open did not raise it: recorded_rows and extract missed the prefix until the step
// was filed. Found by the fuzzer once it ran a device scatter over per-request storage on the seed
// corpus (tests/fuzz/core_bugs/core-bug-21-prefix-bound-while-scheduled).
TEST_CASE("CORE-BUG-21: a prefix bound while the request's step is open counts at once")
{
  small_replay<scattered_per_request> s;
  s.rr().add_request(1);
  rr::step_plan plan;
  plan.schedule({.id = 1, .first_position = 0, .num_tokens = 0});
  s.rr().begin_step(plan, s.stream());
  const std::int64_t cached[] = {0, 1, 2};
  s.rr().add_cached_prefix(1, cached);
  CHECK(s.rr().recorded_rows(1) == 3);
  CHECK(s.rr().extract(1).num_rows() == 3);
  s.forward(0, valid_id);
  s.end_step_and_drain();
  CHECK(s.rr().recorded_rows(1) == 3);
}

// CORE-BUG-22: a device scatter over per-request storage claims a step's rows when it begins, and
// readers see filed steps only. A position the open step claimed again over a row already there (a
// tentative draft row of an earlier step, taken over by a recompute of its position) read as
// missing while the step was open, though nothing had written it yet. Found by the fuzzer in the same
// run (tests/fuzz/core_bugs/core-bug-22-row-taken-over-by-open-step).
TEST_CASE("CORE-BUG-22: a row the open step claims again reads as before until that step is filed")
{
  small_replay<scattered_per_request> s;
  s.rr().add_request(1);
  rr::step_plan drafts;  // position 0, then a draft at position 1
  drafts.schedule({.id = 1, .first_position = 0, .num_tokens = 2, .num_draft_tokens = 1});
  s.step(drafts, 1);
  s.rr().drain();
  rr::step_plan recompute;  // position 1 again: takes the tentative draft row over
  recompute.schedule({.id = 1, .first_position = 1, .num_tokens = 2});
  s.rr().begin_step(recompute, s.stream());
  s.rr().accept_draft(1, 1);
  const auto before = s.rows(1);
  REQUIRE(before.size() == 2 * 4);
  CHECK(std::vector<std::int16_t>(before.begin() + 4, before.end()) == rr_test::small_row<std::int16_t>(1, 1));
  s.forward(2, valid_id);
  s.end_step_and_drain();
  const auto after = s.rows(1);
  REQUIRE(after.size() == 3 * 4);
  CHECK(std::count(after.begin() + 4, after.end(), std::int16_t{3}) == 8);
}

// CORE-BUG-23: CORE-BUG-22's fix kept the row a claim of the open step replaced readable until that
// step was filed, also where that row was a tentative draft row its group then rejected: the position
// read the rejected draft, where the drafts' resolution leaves it missing until the recompute is
// filed. Found by the fuzzer on that fix (tests/fuzz/core_bugs/core-bug-23-rejected-draft-taken-over).
TEST_CASE_TEMPLATE("CORE-BUG-23: a rejected draft row the open step took over reads as missing until that step is filed",
                   RR, scattered_per_request, sync_block_slot, async_block_slot)
{
  small_replay<RR> s;
  s.rr().add_request(1);
  const std::int64_t block0[] = {0};
  const std::int64_t slots[]  = {0, 1, 2, 3};
  rr::step_plan drafts;  // position 0, then a draft at position 1
  drafts.schedule({.id = 1, .first_position = 0, .num_tokens = 2, .num_draft_tokens = 1, .slots = {slots, 2}});
  drafts.add_fresh_blocks(block0);
  s.step(drafts, 1);
  rr::step_plan recompute;  // position 1 again, at the same slot: takes the tentative draft row over
  recompute.schedule({.id = 1, .first_position = 1, .num_tokens = 2, .slots = {slots + 1, 2}});
  s.rr().begin_step(recompute, s.stream());
  s.rr().accept_draft(1, 0);
  const std::int64_t cached[] = {0, 1, 2};
  s.rr().add_cached_prefix(1, cached);  // T reaches past the recompute before it is filed
  const auto before = s.rows(1);
  REQUIRE(before.size() == 3 * 4);
  CHECK(std::vector<std::int16_t>(before.begin(), before.begin() + 4) == rr_test::small_row<std::int16_t>(0, 1));
  CHECK(std::all_of(before.begin() + 4, before.end(), [](std::int16_t v) { return v == -1; }));
  s.forward(2, valid_id);
  s.end_step_and_drain();
  const auto after = s.rows(1);
  CHECK(std::count(after.begin() + 4, after.end(), std::int16_t{3}) == 8);
}
