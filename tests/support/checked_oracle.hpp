/// @file
/// checked_oracle: how the contract checker runs a library call and judges it: the call under a
/// fault-injection scope (what it threw, whether an injected fault fired), the state snapshot
/// before a call that may be refused and the check that a refused call changed nothing, which
/// steps a call filed and whether each was reported as it must be, the counters after a step, and
/// the capture() call of a write. Derives from checked_predictions (checked_predictions.hpp);
/// checked_reads (checked_reads.hpp) derives from it.
#pragma once

#include "checked_predictions.hpp"
#include "checked_writes.hpp"
#include "fault_injection.hpp"
#include "synthetic_router.hpp"

#include <routing_replay/routing_replay.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <map>
#include <new>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

namespace rr_test {

/// @brief The third layer of checked_replay: running and judging calls (see the file comment).
template <class RR>
class checked_oracle : public checked_predictions<RR> {
  using predictions = checked_predictions<RR>;

 public:
  using typename predictions::engine;
  using typename predictions::index;
  using typename predictions::outcome;
  using predictions::claims_when_planned;
  using predictions::last;
  using predictions::library;
  using predictions::max_source_offset;
  using predictions::slot_storage;
  using predictions::slots;
  using predictions::predictions;

  /// @brief drain(), checked: every step in flight is filed, each reported as it must be.
  void drain()
  {
    trace("drain");
    const std::size_t before = lib_->steps_in_flight();
    const outcome out        = invoke("drain", [&] { lib_->drain(); });
    const bool consumed      = account(before, 0, out);
    if (out.threw && !consumed && !out.faulted) { violation("drain threw " + describe(out) + " for no step it filed"); }
    if (!out.threw && lib_->steps_in_flight() != 0) { violation("drain left steps in flight"); }
  }

 protected:
  using typename predictions::flight;
  using predictions::apply;
  using predictions::calls_;
  using predictions::cell_of;
  using predictions::config_;
  using predictions::describe;
  using predictions::discard_after_fault;
  using predictions::drop_groups;
  using predictions::expected_host_bytes;
  using predictions::flights_;
  using predictions::full_snapshots_;
  using predictions::ids16_;
  using predictions::ids32_;
  using predictions::ids64_;
  using predictions::known_;
  using predictions::last_;
  using predictions::lib_;
  using predictions::live_;
  using predictions::meta_;
  using predictions::oldest_pending;
  using predictions::open_;
  using predictions::physical_entries;
  using predictions::physical_map_;
  using predictions::predicted;
  using predictions::retired;
  using predictions::row_elems_;
  using predictions::source_width;
  using predictions::stream_;
  using predictions::trace;
  using predictions::trace_;
  using predictions::violation;

  struct counter_snapshot {
    std::size_t num_requests = 0;
    std::size_t host_bytes   = 0;
    std::vector<bool> contains;
    bool operator==(const counter_snapshot&) const = default;
  };
  struct state_snapshot {
    counter_snapshot counters;
    std::size_t steps_in_flight = 0;
    std::map<std::string, std::int64_t> recorded;
    std::map<std::string, std::vector<index>> rows;
    std::vector<index> pool;
    bool full = false;
    bool operator==(const state_snapshot&) const = default;
  };

  // Runs one library call; catches what it throws and whether an injected fault fired in it.
  template <class F>
  outcome invoke(const char* name, F&& f)
  {
    ++calls_;
    outcome out;
    auto& injector           = fault_injector::get();
    const std::uint64_t fired = injector.fired();
    try {
      fault_injector::call_scope call{name};
      f();
    } catch (const routing_replay::error& e) {
      out.threw   = true;
      out.code    = e.code();
      out.message = e.what();
    } catch (const std::bad_alloc& e) {
      out.threw   = true;
      out.message = std::string{"std::bad_alloc: "} + e.what();
    } catch (const contract_violation&) {
      throw;
    } catch (const std::exception& e) {
      violation(std::string{name} + " threw a " + typeid(e).name() + " (" + e.what() +
                "), not routing_replay::error");
    }
    // a fault the library ignores by contract (unregister_host) leaves the call as if none fired
    if (injector.fired() != fired && injector.fired_kind() != fault_kind::ignored) {
      out.faulted = true;
      out.kind    = injector.fired_kind();
      if (!out.threw) { violation(std::string{name} + " swallowed the injected fault " + injector.fired_op()); }
    } else if (out.threw && !out.code) {
      violation(std::string{name} + " threw " + out.message + " with no fault injected");
    }
    if (trace_) {
      std::fprintf(stderr, "    -> %s%s\n", describe(out).c_str(), out.faulted ? " (injected fault)" : "");
    }
    last_ = out;
    return out;
  }

  // A call that files no steps: refused exactly when `expect` is non-empty, with one of its codes,
  // and then (or after an injected fault) nothing observable changed. Returns whether it was
  // accepted.
  template <class F>
  bool run_checked(const char* name, const std::set<routing_replay::errc>& expect, bool files, F&& f)
  {
    if (!expect.empty() && full_snapshots_) { prepare_filing_call(); }
    const auto snap   = snapshot(may_skip_snapshot(expect));
    const outcome out = invoke(name, std::forward<F>(f));
    return settle(out, expect, snap, files, name);
  }

  // Checks a call's outcome against the codes that apply; returns whether it was accepted.
  bool settle(const outcome& out, const std::set<routing_replay::errc>& expect,
              const std::optional<state_snapshot>& before, bool files, const char* name = "the call")
  {
    if (out.faulted) {
      if (before) { check_unchanged(*before, files, name); }
      return false;
    }
    if (expect.empty()) {
      if (out.threw) { violation(std::string{name} + " refused a valid call: " + describe(out)); }
      return true;
    }
    if (!out.threw) { violation(std::string{name} + " accepted a call the contract refuses" + codes(expect)); }
    if (!out.code || expect.count(*out.code) == 0) {
      violation(std::string{name} + " threw " + describe(out) + "; expected" + codes(expect));
    }
    if (before) { check_unchanged(*before, files, name); }
    return false;
  }

  static std::string codes(const std::set<routing_replay::errc>& expect)
  {
    std::string s;
    for (const auto c : expect) { s += " " + std::to_string(static_cast<int>(c)); }
    return s;
  }

  // Whether a call predicted to succeed may go without a snapshot (not while faults are injected:
  // then any call may fail, and must leave the state as it was).
  [[nodiscard]] static bool may_skip_snapshot(const std::set<routing_replay::errc>& expect)
  {
    return expect.empty() && !fault_injector::get().armed();
  }

  // The state before a call that may be refused: the counters always, every row too in full mode.
  std::optional<state_snapshot> snapshot(bool skip = false)
  {
    if (skip) { return std::nullopt; }
    if (full_snapshots_ && lib_->steps_in_flight() == 0) { return full_snapshot(); }
    state_snapshot s;
    s.counters        = counters();
    s.steps_in_flight = lib_->steps_in_flight();
    return s;
  }

  void check_unchanged(const state_snapshot& before, bool files, const char* name)
  {
    state_snapshot after;
    if (before.full) {
      after = full_snapshot();
    } else {
      after.counters        = counters();
      after.steps_in_flight = lib_->steps_in_flight();
    }
    if (files) { after.steps_in_flight = before.steps_in_flight; }  // filing is allowed
    if (!(after == before)) {
      violation(std::string{name} + " was refused (" + describe(last_) + ") but changed the object's state" +
                (after.counters == before.counters ? " (rows or the pool)" : " (counters)"));
    }
  }

  counter_snapshot counters()
  {
    counter_snapshot s;
    s.num_requests = lib_->num_requests();
    s.host_bytes   = lib_->host_bytes();
    for (const auto& id : known_) { s.contains.push_back(lib_->contains(id.key())); }
    return s;
  }

  state_snapshot full_snapshot()
  {
    fault_injector::pause_scope pause;
    state_snapshot s;
    s.full            = true;
    s.counters        = counters();
    s.steps_in_flight = lib_->steps_in_flight();
    for (const auto& [name, r] : live_) {
      const auto key = r.id.key();
      s.recorded[name] = guarded([&] { return lib_->recorded_rows(key); });
      if (oldest_pending(r) == nullptr) {
        s.rows[name] = guarded([&] {
          const auto got = lib_->extract(key);
          return std::vector<index>(got.flat().begin(), got.flat().end());
        });
      }
    }
    if constexpr (slot_storage) {
      if (!open_) {
        std::vector<std::int64_t> all(static_cast<std::size_t>(config_.num_blocks));
        for (std::size_t b = 0; b < all.size(); ++b) { all[b] = static_cast<std::int64_t>(b); }
        s.pool.resize(static_cast<std::size_t>(slots() * row_elems_));
        guarded([&] {
          lib_->export_blocks(all, s.pool);
          return 0;
        });
      }
    }
    return s;
  }

  // A read the snapshot needs; with nothing in flight it has no reason to fail.
  template <class F>
  auto guarded(F&& f)
  {
    try {
      return f();
    } catch (const routing_replay::error& e) {
      violation(std::string{"reading the state with nothing in flight threw: "} + e.what());
    }
  }

  // -- filing -----------------------------------------------------------------------------------

  // Before a call that files steps: full snapshots need nothing in flight.
  void prepare_filing_call()
  {
    if (full_snapshots_ && lib_->steps_in_flight() > 0) { drain(); }
  }

  // Block-slot storage: a step with a device-detected problem must be filed before anything can
  // depend on its claims (see the file comment).
  void settle_failed_steps()
  {
    if constexpr (claims_when_planned) {
      const bool failed_in_flight =
        std::any_of(flights_.begin(), flights_.end(), [](const flight& f) { return f.verdict.has_value(); });
      while (failed_in_flight && lib_->steps_in_flight() > 0) {
        const std::size_t before = lib_->steps_in_flight();
        drain();
        if (lib_->steps_in_flight() == before) { break; }
      }
    }
  }

  // The steps a call filed are the oldest in flight: `before + pushed - after` of them. The last one
  // may be the one the call threw for. Returns whether the call's error was a filing error.
  bool account(std::size_t before, std::size_t pushed, const outcome& out)
  {
    const std::size_t after = lib_->steps_in_flight();
    if (after > before + pushed) { violation("more steps in flight after the call than before"); }
    std::size_t filed = before + pushed - after;
    if (filed > flights_.size()) { violation("the library filed steps it never had"); }
    if (trace_ && filed > 0) {
      std::fprintf(stderr, "    filed %zu step(s) from serial %llu; %zu in flight\n", filed,
                   static_cast<unsigned long long>(flights_.front().serial), after);
    }
    bool consumed = false;
    while (filed-- > 0) {
      const flight f = flights_.front();
      flights_.pop_front();
      retired(f.serial);
      const bool last = filed == 0;
      const std::string tag = "step " + std::to_string(f.serial) + ": ";
      if (last && out.threw && out.faulted && out.kind == fault_kind::wait) {
        discard_after_fault(f.serial);  // its copy could not be waited for: discarded
        consumed = true;
      } else if (f.verdict) {
        // a host allocation failing while the error is built still discards the step
        const bool reported = last && out.threw &&
                              ((out.code == f.verdict && out.message.rfind(tag, 0) == 0) ||
                               (out.faulted && out.kind == fault_kind::host_new));
        if (!reported) {
          violation(tag + "had a device-detected problem (code " + std::to_string(static_cast<int>(*f.verdict)) +
                    ") but was filed with " + describe(out));
        }
        drop_groups(f.serial);
        consumed = true;
      } else if (last && out.threw && out.code && out.message.rfind(tag, 0) == 0) {
        violation(tag + "was clean but was reported: " + out.message);
      }
    }
    if (out.threw && !consumed && out.code &&
        (*out.code == routing_replay::errc::invalid_expert_id || *out.code == routing_replay::errc::missing_routing)) {
      violation("a device-detected error for no step filed: " + out.message);
    }
    if (after != flights_.size()) { violation("steps in flight differ from the steps ended and not filed"); }
    return consumed;
  }

  void check_counters()
  {
    if (lib_->steps_in_flight() > static_cast<std::size_t>(RR::copy_type::ring_depth)) {
      violation("more steps in flight than the ring holds");
    }
    if (lib_->steps_in_flight() != flights_.size()) { violation("steps in flight differ from the steps ended"); }
    if (lib_->num_requests() != live_.size()) { violation("num_requests differs"); }
    if (lib_->host_bytes() != expected_host_bytes()) {
      violation("host_bytes " + std::to_string(lib_->host_bytes()) + ", expected " +
                std::to_string(expected_host_bytes()));
    }
  }

  // A block transfer: validated before it files anything, then files every step in flight.
  template <class F>
  bool transfer(const char* name, const std::set<routing_replay::errc>& expect, F&& f)
  {
    prepare_filing_call();
    const std::size_t before = lib_->steps_in_flight();
    const auto snap          = snapshot();
    const outcome out        = invoke(name, std::forward<F>(f));
    if (account(before, 0, out)) { return false; }
    if (!settle(out, expect, snap, true, name)) { return false; }
    if (lib_->steps_in_flight() != 0) { violation(std::string{name} + " left steps in flight"); }
    return true;
  }

  bool capture(const write_spec& w, const std::set<routing_replay::errc>& expect, std::int64_t rows,
               std::int64_t bad)
  {
    const std::int64_t width  = config_.top_k + config_.num_fused_shared_experts;
    const std::int64_t stride = w.stride != 0 ? w.stride : width;
    // the engine's buffer holds rows of max(stride, width) ids; never wider than it allocated
    const std::int64_t row_len = std::clamp<std::int64_t>(stride, 1, source_width());
    const std::int64_t offset  = std::clamp<std::int64_t>(w.row_offset, 0, max_source_offset);
    const std::int64_t modulo  = w.physical ? physical_entries() - 1 : config_.num_experts;
    const std::int32_t* map    = w.physical || w.empty_map ? engine::data(physical_map_) : nullptr;
    const std::int64_t entries = w.empty_map ? 0 : physical_entries();
    routing_replay::capture_options o;
    o.source_row_stride    = w.stride;
    o.source_row_offset    = w.row_offset;
    o.physical_to_logical  = map;
    o.num_physical_experts = map != nullptr ? entries : 0;
    auto run = [&](auto* buffer) {
      using source = std::remove_pointer_t<decltype(buffer)>;
      if (stride <= source_width()) {  // an engine never writes past its own buffer
        engine::bulk_async(rows * row_len,
                           write_router_output<source>{engine::data(meta_), buffer + offset * row_len, row_len,
                                                       config_.top_k, w.layer, modulo, cell_of(w), bad},
                           stream_.ref());
      }
      return run_checked("capture", expect, false, [&] {
        lib_->capture(w.layer, w.null_ids ? static_cast<const source*>(nullptr) : buffer, w.num_rows,
                      stream_.ref(), o);
      });
    };
    if ((stride > source_width() || w.row_offset > max_source_offset) && expect.empty() && rows > 0) {
      return false;  // would read past the engine's buffer: the engine's bug, not a call to make
    }
    switch (w.source_bits) {
      case 16: return run(engine::data(ids16_));
      case 32: return run(engine::data(ids32_));
      default: return run(engine::data(ids64_));
    }
  }
};

}  // namespace rr_test
