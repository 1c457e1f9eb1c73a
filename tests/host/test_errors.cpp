// Every error of the library: triggered, its code and message checked, and the state checked
// unchanged afterwards (nothing stored lost, the object still usable).
#include "../support/error_checks.hpp"
#include "../support/policy_combinations.hpp"
#include "../support/small_replay.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

namespace rr = routing_replay;
using rr_test::expect_error;
using rr_test::plan_for;
using rr_test::small_replay;
using rr_test::stored_state;

using per_request_replay = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major,
                                             rr::sync_copy, rr::per_request_storage>;
using block_slot_replay  = rr::RoutingReplay<rr::host_backend, std::uint8_t, rr::token_major,
                                             rr::sync_copy, rr::block_slot_storage>;
// claims the common runs of a plan while it validates it (row_filer::plans_fresh_runs)
using scattered_replay   = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major,
                                             rr::device_scatter<2>, rr::per_request_storage>;

TEST_CASE_TEMPLATE("device-detected problems discard the step and lose nothing", RR,
                   per_request_replay, block_slot_replay,
                   rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major, rr::async_event,
                                     rr::per_request_storage>,
                   rr::RoutingReplay<rr::host_backend, std::int32_t, rr::token_major,
                                     rr::double_buffered<3>, rr::block_slot_storage>,
                   rr::RoutingReplay<rr::host_backend, std::uint8_t, rr::token_major,
                                     rr::device_scatter<2>, rr::block_slot_storage>,
                   rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major,
                                     rr::device_scatter<1>, rr::block_slot_storage>)
{
  rr_test::check_device_detected_errors<RR>();
}

TEST_CASE("invalid configurations are refused with the offending value")
{
  auto c = rr_test::small_config();
  SUBCASE("zero experts")
  {
    c.num_experts = 0;
    expect_error([&] { per_request_replay{c}; }, rr::errc::invalid_config, {"num_experts", "0"});
  }
  SUBCASE("no layer map")
  {
    c.moe_layers.clear();
    expect_error([&] { per_request_replay{c}; }, rr::errc::invalid_config, {"moe_layers"});
  }
  SUBCASE("a layer twice")
  {
    c.moe_layers = {1, 1};
    expect_error([&] { per_request_replay{c}; }, rr::errc::invalid_config, {"layer 1 twice"});
  }
  SUBCASE("a layer outside the model")
  {
    c.moe_layers = {1, 7};
    expect_error([&] { per_request_replay{c}; }, rr::errc::invalid_config, {"model layer 7", "[0, 3)"});
  }
  SUBCASE("block-slot storage without a pool")
  {
    c.num_blocks = 0;
    expect_error([&] { block_slot_replay{c}; }, rr::errc::invalid_config, {"num_blocks 0"});
  }
  SUBCASE("block-slot pool over the memory limit")
  {
    c.host_memory_limit = 100;  // 32 slots x 4 ids x 1 byte = 128 bytes
    expect_error([&] { block_slot_replay{c}; }, rr::errc::host_memory_exhausted, {"128 bytes", "100"});
  }
}

TEST_CASE("an index type without room for the sentinel is refused at construction")
{
  auto c        = rr_test::small_config();
  c.num_experts = 256;
  expect_error([&] { rr::RoutingReplay<rr::host_backend, std::uint8_t>{c}; },
               rr::errc::index_type_too_narrow, {"at most 255 experts", "sentinel 255", "256"});
  c.num_experts = 255;
  CHECK_NOTHROW(rr::RoutingReplay<rr::host_backend, std::uint8_t>{c});
  c.num_experts = 40000;
  expect_error([&] { rr::RoutingReplay<rr::host_backend, std::int16_t>{c}; },
               rr::errc::index_type_too_narrow, {"32768", "40000"});
  CHECK_NOTHROW(rr::RoutingReplay<rr::host_backend, std::uint16_t>{c});
}

TEST_CASE_TEMPLATE("host-side errors name the bad value and change nothing", RR, per_request_replay,
                   block_slot_replay, scattered_replay)
{
  small_replay<RR> s;
  std::vector<std::int64_t> slots;
  s.rr().add_request(5);
  s.rr().add_request("chat-1");
  s.step(plan_for(5, 0, 4, slots), 1);
  const auto before = stored_state<RR>::take(s, {5, "chat-1"});

  SUBCASE("capture of a layer the map does not capture")
  {
    std::vector<std::int64_t> ids(8, 1);
    expect_error([&] { s.rr().capture(0, ids.data(), 2, s.stream()); }, rr::errc::unknown_layer,
                 {"model layer 0", "model layers 1, 2"});
    expect_error([&] { s.rr().capture(3, ids.data(), 2, s.stream()); }, rr::errc::unknown_layer,
                 {"model layer 3"});
    expect_error([&] { (void)s.rr().layer_view(-1, 2); }, rr::errc::unknown_layer, {"model layer -1"});
  }
  SUBCASE("more rows than max_tokens_per_step")
  {
    std::vector<std::int64_t> ids(64, 1);
    expect_error([&] { s.rr().capture(1, ids.data(), 9, s.stream()); }, rr::errc::too_many_tokens,
                 {"9 rows", "max_tokens_per_step = 8"});
    expect_error([&] { (void)s.rr().ref(9); }, rr::errc::too_many_tokens, {"9 rows"});
    rr::step_plan plan;
    plan.schedule({5, 4, 6, 0, slots});
    plan.skip(3);
    expect_error([&] { s.rr().begin_step(plan, s.stream()); }, rr::errc::too_many_tokens,
                 {"9 tokens", "max_tokens_per_step 8"});
  }
  SUBCASE("bad capture arguments")
  {
    std::vector<std::int64_t> ids(64, 1);
    rr::capture_options o;
    o.source_row_stride = 1;
    expect_error([&] { s.rr().capture(1, ids.data(), 2, s.stream(), o); }, rr::errc::invalid_argument,
                 {"source_row_stride 1", "K = 2"});
    expect_error([&] { s.rr().capture(1, static_cast<const std::int64_t*>(nullptr), 2, s.stream()); },
                 rr::errc::invalid_argument, {"null id pointer"});
  }
  SUBCASE("unknown requests")
  {
    expect_error([&] { s.step(plan_for(6, 0, 1, slots), 1); }, rr::errc::unknown_request, {"request 6"});
    expect_error([&] { (void)s.rr().extract("nope"); }, rr::errc::unknown_request, {"request 'nope'"});
    expect_error([&] { s.rr().release(6); }, rr::errc::unknown_request, {"request 6"});
    expect_error([&] { s.rr().abort("6"); }, rr::errc::unknown_request, {"request '6'"});  // not 6
    expect_error([&] { s.rr().accept_draft(6, 0); }, rr::errc::unknown_request, {"request 6"});
  }
  SUBCASE("duplicate requests")
  {
    expect_error([&] { s.rr().add_request(5); }, rr::errc::duplicate_request, {"request 5"});
    expect_error([&] { s.rr().add_request(std::string{"chat-1"}); }, rr::errc::duplicate_request,
                 {"request 'chat-1'"});
    slots = {4, 5};
    rr::step_plan plan;
    plan.schedule({5, 4, 1, 0, std::span<const std::int64_t>{slots.data(), 1}});
    plan.schedule({5, 5, 1, 0, std::span<const std::int64_t>{slots.data() + 1, 1}});
    expect_error([&] { s.rr().begin_step(plan, s.stream()); }, rr::errc::duplicate_request,
                 {"schedules request 5 twice"});
  }
  SUBCASE("positions outside [0, max_model_len)")
  {
    expect_error([&] { s.rr().begin_step(plan_for(5, 30, 3, slots), s.stream()); },
                 rr::errc::position_out_of_range, {"[30, 33)", "max_model_len = 32"});
    rr::step_plan plan;
    plan.schedule({5, -1, 1, 0, slots});
    expect_error([&] { s.rr().begin_step(plan, s.stream()); }, rr::errc::position_out_of_range, {"[-1, 0)"});
  }
  SUBCASE("a plan refused after runs it could claim")
  {
    // both requests' runs are new positions in storage they have: a device scatter claims them as
    // it checks the plan, and gives them back at the refusal
    slots = {4, 5, 6};
    rr::step_plan plan;
    plan.schedule({5, 4, 1, 0, std::span<const std::int64_t>{slots.data(), 1}});
    plan.schedule({"chat-1", 0, 0, 0, {}});
    plan.schedule({"nobody", 0, 1, 0, std::span<const std::int64_t>{slots.data() + 1, 1}});
    expect_error([&] { s.rr().begin_step(plan, s.stream()); }, rr::errc::unknown_request, {"request 'nobody'"});
    plan.clear();
    plan.schedule({5, 4, 1, 0, std::span<const std::int64_t>{slots.data(), 1}});
    plan.schedule({"chat-1", 30, 3, 0, std::span<const std::int64_t>{slots.data(), 3}});
    expect_error([&] { s.rr().begin_step(plan, s.stream()); }, rr::errc::position_out_of_range,
                 {"request 'chat-1'", "[30, 33)"});
    plan.clear();
    plan.schedule({5, 4, 1, 0, std::span<const std::int64_t>{slots.data(), 1}});
    plan.schedule({5, 5, 1, 0, std::span<const std::int64_t>{slots.data() + 1, 1}});
    expect_error([&] { s.rr().begin_step(plan, s.stream()); }, rr::errc::duplicate_request,
                 {"schedules request 5 twice"});
  }
  SUBCASE("a malformed plan")
  {
    slots = {4, 5};
    rr::step_plan plan;
    plan.schedule({5, 4, 2, 3, slots});
    expect_error([&] { s.rr().begin_step(plan, s.stream()); }, rr::errc::invalid_plan,
                 {"3 draft tokens among 2"});
  }
  SUBCASE("memory and state errors")
  {
    expect_error([&] { s.rr().end_step(s.stream()); }, rr::errc::invalid_state, {"without an open step"});
    expect_error([&] { (void)s.rr().extract(5, {0, 9}); }, rr::errc::position_out_of_range,
                 {"rows [0, 9)", "4 recorded"});
    expect_error([&] { (void)s.rr().extract(5, {3, 2}); }, rr::errc::position_out_of_range, {"[3, 2)"});
    std::vector<typename RR::index_type> small(3);
    expect_error([&] { (void)s.rr().extract_into(5, small); }, rr::errc::invalid_argument,
                 {"needs 16 elements", "has 3"});
    expect_error([&] { s.rr().accept_draft(5, 0); }, rr::errc::draft_error, {"no pending draft"});
  }

  CHECK(stored_state<RR>::take(s, {5, "chat-1"}) == before);
  s.step(plan_for(5, 4, 2, slots), 3);  // still usable
  CHECK(s.rr().recorded_rows(5) == 6);
}

TEST_CASE("block-slot errors: slots outside the pool, miscounted or repeated")
{
  small_replay<block_slot_replay> s;
  std::vector<std::int64_t> slots;
  s.rr().add_request(1);
  s.step(plan_for(1, 0, 2, slots), 1);
  const auto before = stored_state<block_slot_replay>::take(s, {1});

  std::vector<std::int64_t> bad = {2, 32};
  rr::step_plan plan;
  plan.schedule({1, 2, 2, 0, bad});
  expect_error([&] { s.rr().begin_step(plan, s.stream()); }, rr::errc::slot_out_of_range,
               {"request 1", "slot 32", "[0, 32)"});
  const std::vector<std::int64_t> one = {2};
  rr::step_plan short_plan;
  short_plan.schedule({1, 2, 2, 0, one});
  expect_error([&] { s.rr().begin_step(short_plan, s.stream()); }, rr::errc::slot_out_of_range,
               {"1 slots for 2 tokens"});
  std::vector<std::int64_t> twice = {6, 6};
  rr::step_plan plan2;
  plan2.schedule({1, 2, 2, 0, twice});
  expect_error([&] { s.rr().begin_step(plan2, s.stream()); }, rr::errc::slot_out_of_range,
               {"slot 6 is used twice"});
  const std::int64_t fresh[] = {8};
  rr::step_plan plan3 = plan_for(1, 2, 1, slots);
  plan3.add_fresh_blocks(fresh);
  expect_error([&] { s.rr().begin_step(plan3, s.stream()); }, rr::errc::slot_out_of_range,
               {"fresh block 8", "[0, 8)"});
  const std::int64_t cached[] = {0, -4};
  expect_error([&] { s.rr().add_request(2, {-1, cached}); }, rr::errc::slot_out_of_range,
               {"request 2", "slot -4"});
  CHECK_FALSE(s.rr().contains(2));
  CHECK(stored_state<block_slot_replay>::take(s, {1}) == before);
}

TEST_CASE("the host memory limit is checked before anything changes")
{
  // rows of 4 ids live in segments of at least one page (4096 bytes: 512 rows of small_config)
  auto c              = rr_test::small_config();
  c.host_memory_limit = 4096;
  small_replay<per_request_replay> s{c};
  std::vector<std::int64_t> slots;
  s.rr().add_request(1);
  s.rr().add_request(2);
  s.step(plan_for(1, 0, 8, slots), 1);  // one page reserved
  const auto before = stored_state<per_request_replay>::take(s, {1, 2});
  CHECK(before.host_bytes == 4096);
  // request 2 needs a page of its own: 8192 > 4096
  expect_error([&] { s.step(plan_for(2, 0, 8, slots), 1); }, rr::errc::host_memory_exhausted,
               {"4096 more bytes", "host_memory_limit 4096", "4096 bytes are in use"});
  CHECK(stored_state<per_request_replay>::take(s, {1, 2}) == before);
  s.rr().release(1);
  CHECK(s.rr().host_bytes() == 0);
  s.step(plan_for(2, 0, 8, slots), 2);  // fits once request 1 is gone
  CHECK(s.rr().recorded_rows(2) == 8);
}

TEST_CASE("a step must be closed before the next opens, and its requests before release")
{
  small_replay<per_request_replay> s;
  std::vector<std::int64_t> slots;
  s.rr().add_request(1);
  auto plan = plan_for(1, 0, 2, slots);
  s.rr().begin_step(plan, s.stream());
  expect_error([&] { s.rr().begin_step(plan, s.stream()); }, rr::errc::invalid_state, {"still open"});
  expect_error([&] { s.rr().release(1); }, rr::errc::invalid_state, {"scheduled in the open step"});
  s.forward(2, [](std::int32_t, std::int64_t, std::int32_t) -> std::int64_t { return 1; });
  s.end_step();
  CHECK(s.rr().recorded_rows(1) == 2);
}
