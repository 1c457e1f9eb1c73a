/// @file
/// Error scenarios for any backend: each triggers one error, checks its code and that its message
/// names the bad value, then checks that nothing stored changed and that the object still works.
#pragma once

#include "small_replay.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

namespace rr_test {

/// @brief Runs `fn`, requires it to throw routing_replay::error with `code`, and requires every
/// fragment in the message.
inline void expect_error(const std::function<void()>& fn,
                         routing_replay::errc code,
                         std::initializer_list<std::string_view> fragments)
{
  bool thrown = false;
  try {
    fn();
  } catch (const routing_replay::error& e) {
    thrown                    = true;
    const std::string message = e.what();
    CAPTURE(message);
    CHECK(e.code() == code);
    for (const auto fragment : fragments) {
      CAPTURE(fragment);
      CHECK(message.find(fragment) != std::string::npos);
    }
  }
  CHECK_MESSAGE(thrown, "expected routing_replay::error");
}

/// @brief Everything an engine can observe about stored requests.
template <class RR>
struct stored_state {
  std::vector<std::int64_t> recorded;
  std::vector<std::vector<typename RR::index_type>> rows;
  std::size_t num_requests = 0;
  std::size_t host_bytes   = 0;

  static stored_state take(small_replay<RR>& s, std::initializer_list<routing_replay::request_key> ids)
  {
    stored_state out;
    for (const auto& id : ids) {
      out.recorded.push_back(s.rr().recorded_rows(id));
      out.rows.push_back(s.rows(id));
    }
    out.num_requests = s.rr().num_requests();
    out.host_bytes   = s.rr().host_bytes();
    return out;
  }
  bool operator==(const stored_state&) const = default;
};

/// @brief A plan for request `id`: `count` tokens from `first` (with slots first.. for block-slot).
inline routing_replay::step_plan plan_for(routing_replay::request_key id, std::int64_t first,
                                          std::int32_t count, std::vector<std::int64_t>& slots,
                                          std::int32_t drafts = 0)
{
  slots.clear();
  for (std::int64_t p = first; p < first + count; ++p) { slots.push_back(p); }
  routing_replay::step_plan plan;
  plan.schedule({id, first, count, drafts, slots});
  return plan;
}

/// @brief A "fused kernel" that writes one out-of-range value through a layer view.
template <class View>
struct write_out_of_range {
  View view;
  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t) const { view(1, 0) = 9; }
};

/// @brief A "top-k kernel" that records one row past what its reference covers.
template <class Ref>
struct record_past_the_end {
  Ref ref;
  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t) const { ref.record(0, 2, 0, 1); }
};

/// @brief Device-detected problems: each discards its step, names the offender, loses nothing.
/// Deferred strategies report the problem when they file the step: at the drain here.
template <class RR>
void check_device_detected_errors()
{
  namespace rr = routing_replay;
  small_replay<RR> s;
  std::vector<std::int64_t> slots;
  s.rr().add_request(5);
  s.step(plan_for(5, 0, 4, slots), 1);
  const auto before = stored_state<RR>::take(s, {5});
  REQUIRE(before.recorded[0] == 4);

  SUBCASE("an expert id outside [0, E) from capture()")
  {
    s.rr().begin_step(plan_for(5, 4, 3, slots), s.stream());
    s.forward(3, [](std::int32_t slot, std::int64_t row, std::int32_t k) -> std::int64_t {
      return slot == 1 && row == 2 && k == 1 ? 1000 : 1;
    });
    expect_error([&] { s.end_step_and_drain(); }, rr::errc::invalid_expert_id,
                 {"expert id 1000", "layer 2", "request 5", "position 6", "column 1", "discarded"});
  }
  SUBCASE("a negative id from capture()")
  {
    s.rr().begin_step(plan_for(5, 4, 2, slots), s.stream());
    s.forward(2, [](std::int32_t, std::int64_t row, std::int32_t) -> std::int64_t { return row == 1 ? -3 : 2; });
    expect_error([&] { s.end_step_and_drain(); }, rr::errc::invalid_expert_id, {"expert id -3", "position 5"});
  }
  SUBCASE("a layer that was never captured")
  {
    s.rr().begin_step(plan_for(5, 4, 2, slots), s.stream());
    s.forward(2, [](std::int32_t, std::int64_t, std::int32_t) -> std::int64_t { return 3; }, 0);
    expect_error([&] { s.end_step_and_drain(); }, rr::errc::missing_routing,
                 {"layer 1", "unwritten", "request 5", "position 4", "2 (layer, row)"});
  }
  SUBCASE("fewer rows captured than the step schedules")
  {
    s.rr().begin_step(plan_for(5, 4, 3, slots), s.stream());
    s.forward(2, [](std::int32_t, std::int64_t, std::int32_t) -> std::int64_t { return 3; });
    expect_error([&] { s.end_step_and_drain(); }, rr::errc::missing_routing, {"position 6", "unwritten"});
  }
  SUBCASE("a value outside [0, E) written through a layer view")
  {
    s.rr().begin_step(plan_for(5, 4, 2, slots), s.stream());
    s.forward(2, [](std::int32_t, std::int64_t, std::int32_t) -> std::int64_t { return 3; });
    auto view = s.rr().layer_view(2, 2);
    RR::backend_type::bulk_async(1, write_out_of_range<decltype(view)>{view}, s.stream());
    expect_error([&] { s.end_step_and_drain(); }, rr::errc::invalid_expert_id,
                 {"value 9", "written through a view", "layer 2", "position 5"});
  }
  SUBCASE("a device_ref record outside the buffer")
  {
    s.rr().begin_step(plan_for(5, 4, 2, slots), s.stream());
    s.forward(2, [](std::int32_t, std::int64_t, std::int32_t) -> std::int64_t { return 3; });
    auto ref = s.rr().ref(2);
    RR::backend_type::bulk_async(1, record_past_the_end<decltype(ref)>{ref}, s.stream());
    expect_error([&] { s.end_step_and_drain(); }, rr::errc::invalid_argument,
                 {"outside the buffer", "row 2"});
  }

  // nothing stored changed, and the next step works
  CHECK(stored_state<RR>::take(s, {5}) == before);
  s.step(plan_for(5, 4, 2, slots), 2);
  auto rows = s.rows(5);
  REQUIRE(rows.size() == 6 * 4);
  const auto expected = small_row<typename RR::index_type>(1, 2);  // position 5 is row 1 of the step
  CHECK(std::vector<typename RR::index_type>(rows.begin() + 20, rows.end()) == expected);
}

}  // namespace rr_test
