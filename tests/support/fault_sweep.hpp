/// @file
/// The fault sweep shared by the host and CUDA fault tests: a full schedule (prefill, decode with
/// drafts, a warm-up write, a step with a device-detected problem, mid-flight extraction, a prefix
/// hit, an abort inside a step, block transfers, moves, a replacement object) through
/// checked_replay, run once per failure point of a source with that one failing. checked_replay
/// checks the documented state after the failing call, the rest of the schedule against the
/// reference model, and the final state; a deadline checks that nothing hangs, destruction included.
#pragma once

#include "checked_replay.hpp"
#include "deadline.hpp"
#include "fault_injection.hpp"
#include "small_replay.hpp"

#include <routing_replay/routing_replay.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <span>
#include <string>
#include <vector>

namespace rr_test {

/// @brief The configuration the sweep runs: small_replay's shape (model layer 0 dense, K = 2 plus
/// a shared expert, N_max 8) with room for more experts and blocks.
inline routing_replay::replay_config fault_config()
{
  auto c        = small_config();
  c.num_experts = 16;
  c.num_blocks  = 16;
  return c;
}

/// @brief Resolves every pending draft group, keeping up to `keep` drafts of each.
template <class RR>
void accept_pending(checked_replay<RR>& d, std::int32_t keep)
{
  for (const auto& key : d.live_keys()) {
    const std::int32_t count = d.pending_drafts(key);
    if (count >= 0) { d.accept_draft(key, std::min(keep, count)); }
  }
}

/// @brief The schedule every failure point is injected into.
template <class RR>
void fault_schedule(checked_replay<RR>& d)
{
  const std::vector<std::int64_t> none;
  d.add_request(1, 3, none);
  d.add_request("s", -1, none);
  d.natural_step(2, 3, 0, 1);  // prefill
  d.natural_step(2, 3, 2, 2);  // decode: a token and two drafts each
  accept_pending(d, 1);
  d.natural_step(2, 1, 0, 3);

  rr_test::write_spec warm_up;  // a forward outside any step (warm-up, graph recording)
  warm_up.layer    = 1;
  warm_up.num_rows = 4;
  d.write(warm_up);
  d.reset_device_buffer();

  if (d.natural_begin(2, 1, 0)) {  // an id outside [0, E): the step is discarded when filed
    d.write_all(4, rr_test::write_spec::defect::above_range);
    d.end_step();
  }
  d.extract(1, {});
  d.recorded_rows("s");
  d.extract_into("s", {}, 0);

  const std::vector<std::int64_t> cached = {d.natural_slot(1, 0), d.natural_slot(1, 1)};
  d.add_request(3, 2, cached);  // a prefix hit on request 1's blocks
  d.natural_step(3, 2, 1, 5);
  accept_pending(d, 0);
  if (d.natural_begin(3, 1, 0)) {  // an abort while the step that schedules it is open
    d.abort("s");
    d.write_all(6);
    d.end_step();
  }
  d.release(1);
  const std::int64_t from[] = {0, 1};
  const std::int64_t to[]   = {10, 11};
  d.export_blocks(from, 0);
  d.copy_blocks(from, to);
  d.import_blocks(std::span<const std::int64_t>{to, 1}, 0, 2);
  d.write(warm_up);            // left for the next begin_step() to reset: a failure there comes
  d.natural_step(1, 1, 0, 7);  // after the plan was validated (device scatter: its runs claimed)
  d.move_round_trip();
  d.drain();
  d.check_everything();

  d.replace();  // a new object assigned over this one, steps in flight and all
  d.add_request(9, -1, none);
  d.natural_step(1, 2, 0, 8);
  d.check_everything();
}

/// @brief What a sweep found.
struct sweep_result {
  std::uint64_t points = 0;  ///< failure points of a clean run
  std::uint64_t fired  = 0;  ///< runs in which the fault fired
  std::vector<std::string> failures;
};

/// @brief Runs the schedule once per failure point of `source`, each time with that one failing.
template <class RR>
sweep_result sweep(fault_source source)
{
  auto& injector = fault_injector::get();
  sweep_result result;
  injector.arm(source, fault_injector::count_only);
  {
    checked_replay<RR> d{fault_config(), true, true};
    fault_schedule(d);
  }
  result.points = injector.count();
  // RR_FAULT_POINT=k reruns one failure point with every call traced (to read a failure)
  const char* only        = std::getenv("RR_FAULT_POINT");
  const std::uint64_t one = only != nullptr ? std::strtoull(only, nullptr, 10) : 0;
  for (std::uint64_t k = one != 0 ? one : 1; k <= (one != 0 ? one : result.points); ++k) {
    injector.arm(source, k);
    std::string failure;
    rr_test::within_deadline(std::chrono::seconds(60), "failure point " + std::to_string(k), [&] {
      try {
        checked_replay<RR> d{fault_config(), true, true};
        d.set_trace(one != 0);
        fault_schedule(d);
      } catch (const rr_test::contract_violation& v) {
        failure = v.what();
      } catch (const routing_replay::error& e) {  // only the constructor may fail outside a checked call
        if (injector.fired_kind() != rr_test::fault_kind::create) { failure = std::string{"unexpected: "} + e.what(); }
      } catch (const std::bad_alloc&) {
        if (injector.fired_op().find("in constructor") == std::string::npos &&
            injector.fired_op().find("in construction") == std::string::npos) {
          failure = "std::bad_alloc escaped from " + injector.fired_op();
        }
      }
    });
    result.fired += injector.fired();
    if (!failure.empty()) {
      result.failures.push_back(injector.fired_op() + " (point " + std::to_string(k) + "): " + failure);
    }
  }
  injector.disarm();
  return result;
}

/// @brief Reports a sweep; every contract failure fails the test.
inline void check_sweep(const sweep_result& r, const std::string& what)
{
  MESSAGE(what << ": " << r.points << " failure points, " << r.fired << " faults injected, " << r.failures.size()
               << " contract failures");
  CHECK(r.points > 0);
  CHECK(r.fired > 0);
  for (const auto& f : r.failures) { FAIL_CHECK(f); }
}

}  // namespace rr_test
