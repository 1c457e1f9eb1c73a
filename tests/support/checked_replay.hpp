/// @file
/// checked_replay: drives one RoutingReplay through any sequence of public calls, valid or not, and
/// checks every call against the documented contract:
/// - a call the contract refuses (docs/errors.md) must throw routing_replay::error with one of the
///   codes that apply, and leave every observable piece of state as it was (a snapshot of it is
///   compared before and after);
/// - a call the contract accepts must not throw, and what it returns must agree with the reference
///   model (reference_model.hpp) bit-exact;
/// - a step with a device-detected problem (an id outside [0, E), a cell left unwritten, a record
///   outside the buffer) must be reported, with its code and serial, by whichever call files it, and
///   discarded as a whole; a clean step must be filed silently.
///
/// The driver predicts everything from what it issued: the cells each capture path writes, which
/// requests are live, their draft groups, the host-storage growth policy, the steps in flight. It is
/// the oracle of the fuzzer (tests/fuzz) and of the fault sweeps (tests/faults), on any backend.
///
/// Where the contract deliberately leaves results to timing, the driver behaves as a careful engine
/// does, so that the model stays exact:
/// - block-slot storage, or device scatter (either storage), deferred strategies: rows are claimed
///   when a step begins, and a step with a device-detected problem keeps its claims until it is
///   filed, so steps planned meanwhile may defer to them (docs/design.md section 7). The driver files
///   such a step (drain) before it plans, binds a prefix or resolves drafts;
/// - block-slot storage claims a step's rows when it begins, the model when it ends: dropping a
///   request aborted during the step takes effect in the model after the step (its rows still land
///   at their slots), and the driver binds prefixes only to requests the open step does not
///   schedule (an engine binds a prefix when it admits a request, before it schedules it).
///
/// An injected fault (fault_injection.hpp) that fires inside a call is checked against the state
/// the documentation promises for that call: unchanged for every call but the ones that file
/// steps, whose failing step is discarded, and end_step, which closes its step whatever happens.
///
/// checked_replay is built in layers, each a class template deriving from the one below:
/// checked_state (checked_state.hpp: what the checker knows), checked_predictions
/// (checked_predictions.hpp: what the contract says a call must do), checked_oracle
/// (checked_oracle.hpp: running a call and judging its outcome), checked_reads (checked_reads.hpp:
/// the calls that read, transfer blocks or replace the object) and checked_replay
/// (checked_replay.hpp: requests and steps).
#pragma once

#include "checked_reads.hpp"
#include "checked_writes.hpp"
#include "fault_injection.hpp"
#include "synthetic_router.hpp"

#include <routing_replay/routing_replay.hpp>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace rr_test {

/// @brief See the file comment. `RR` is any RoutingReplay; its backend may inject faults.
template <class RR>
class checked_replay : public checked_reads<RR> {
  using reads = checked_reads<RR>;

 public:
  using typename reads::engine;
  using typename reads::model_type;
  using typename reads::outcome;
  using reads::claims_when_planned;
  using reads::cursor;
  using reads::live_keys;
  using reads::natural_slot;
  using reads::open_rows;
  using reads::slot_storage;
  using reads::slots;

  /// @brief Builds the library for `config` (its constructor may fail: see the fault sweeps).
  /// With `keep_log`, every model change is logged so that a step an injected fault discards
  /// after the model filed it can be taken out again.
  /// With `engine_copy_stream`, strategies with a side stream copy on a stream the driver owns and
  /// synchronizes before the object goes away, as an engine that owns its streams does.
  explicit checked_replay(routing_replay::replay_config config, bool keep_log = false,
                          bool engine_copy_stream = false)
    : reads(std::move(config), keep_log, engine_copy_stream)
  {
  }

  // ---- requests ----------------------------------------------------------------------------------

  void add_request(routing_replay::request_key id, std::int64_t prompt_length,
                   std::span<const std::int64_t> cached)
  {
    trace("add_request", id.to_string(), prompt_length, cached.size());
    settle_failed_steps();
    std::set<routing_replay::errc> expect;
    check_cached(cached, expect);
    if (live_.count(id.to_string()) != 0) { expect.insert(routing_replay::errc::duplicate_request); }
    remember(id);
    const bool accepted = run_checked("add_request", expect, false, [&] {
      lib_->add_request(id, {prompt_length, cached});
    });
    if (!accepted) { return; }
    request_mirror r{id};
    r.instance      = next_instance_++;
    r.prompt_length = prompt_length;
    r.cursor        = static_cast<std::int64_t>(cached.size());
    const auto key = model_key(r);
    const std::vector<std::int64_t> slots(cached.begin(), cached.end());
    apply([key, prompt_length, slots](model_type& m) { m.add_request(key, prompt_length, slots); });
    live_.emplace(id.to_string(), std::move(r));
  }

  void add_cached_prefix(routing_replay::request_key id, std::span<const std::int64_t> cached)
  {
    trace("add_cached_prefix", id.to_string(), cached.size());
    settle_failed_steps();
    std::set<routing_replay::errc> expect;
    const auto it = live_.find(id.to_string());
    if (it == live_.end()) {
      expect.insert(routing_replay::errc::unknown_request);
    } else {
      check_cached(cached, expect);
      if (slot_storage && expect.empty() && scheduled_in_open_step(it->second)) {
        return;  // an engine binds a prefix when it (re)admits a request, before it schedules it
      }
    }
    remember(id);
    if (!run_checked("add_cached_prefix", expect, false, [&] { lib_->add_cached_prefix(id, cached); })) {
      return;
    }
    auto& r  = it->second;
    r.cursor = std::max(r.cursor, static_cast<std::int64_t>(cached.size()));
    const std::vector<std::int64_t> slots(cached.begin(), cached.end());
    const auto key = model_key(r);
    apply([key, slots](model_type& m) { m.add_cached_prefix(key, slots); });
  }

  void release(routing_replay::request_key id)
  {
    trace("release", id.to_string());
    std::set<routing_replay::errc> expect;
    const auto it = live_.find(id.to_string());
    if (it == live_.end()) {
      expect.insert(routing_replay::errc::unknown_request);
    } else if (scheduled_in_open_step(it->second)) {
      expect.insert(routing_replay::errc::invalid_state);
    }
    remember(id);
    if (run_checked("release", expect, false, [&] { lib_->release(id); })) { forget(it); }
  }

  void abort(routing_replay::request_key id)
  {
    trace("abort", id.to_string());
    std::set<routing_replay::errc> expect;
    const auto it = live_.find(id.to_string());
    if (it == live_.end()) { expect.insert(routing_replay::errc::unknown_request); }
    remember(id);
    if (run_checked("abort", expect, false, [&] { lib_->abort(id); })) { forget(it); }
  }

  void accept_draft(routing_replay::request_key id, std::int32_t accepted)
  {
    trace("accept_draft", id.to_string(), accepted);
    settle_failed_steps();
    std::set<routing_replay::errc> expect;
    const auto it        = live_.find(id.to_string());
    group_mirror* target = nullptr;
    if (it == live_.end()) {
      expect.insert(routing_replay::errc::unknown_request);
    } else {
      target = oldest_pending(it->second);
      if (target == nullptr || accepted < 0 || accepted > target->count) {
        expect.insert(routing_replay::errc::draft_error);
      }
    }
    remember(id);
    if (!run_checked("accept_draft", expect, false, [&] { lib_->accept_draft(id, accepted); })) { return; }
    target->accepted = accepted;
    if (target->filed_in_model) { apply_accept(it->second, *target); }
  }

  // ---- steps -------------------------------------------------------------------------------------

  /// @brief begin_step with any plan (its spans need only live through this call).
  void begin_step(const routing_replay::step_plan& plan)
  {
    trace("begin_step", plan_text(plan));
    settle_failed_steps();
    growth g;
    const auto expect = predict_plan(plan, g);
    if (!run_checked("begin_step", expect, false, [&] { lib_->begin_step(plan, stream_.ref()); })) { return; }

    open_step step;
    step.serial   = ++serial_;
    step.num_rows = plan.num_rows();
    step.cells.assign(static_cast<std::size_t>(config_.max_tokens_per_step * row_elems_), cell_sentinel);
    step.fresh.assign(plan.fresh_blocks().begin(), plan.fresh_blocks().end());
    for (const auto& e : plan.entries()) {
      planned_entry p;
      p.skipped    = e.skipped;
      p.num_tokens = e.request.num_tokens;
      if (!e.skipped) {
        auto& r = live_.at(e.request.id.to_string());
        p.instance       = r.instance;
        p.first_position = e.request.first_position;
        p.num_draft      = e.request.num_draft_tokens;
        if constexpr (slot_storage) { p.slots.assign(e.request.slots.begin(), e.request.slots.end()); }
        r.scheduled_in = step.serial;
        r.cursor       = e.request.first_position + e.request.num_tokens - e.request.num_draft_tokens;
        if (!slot_storage) {
          grow_storage(r.capacity_bytes, e.request.first_position + e.request.num_tokens, g.exact);
          if (claims_when_planned && e.request.num_tokens > 0) { r.last_claim = step.serial; }
        }
        if (p.num_draft > 0) { r.groups.push_back(group_mirror{step.serial, p.num_draft}); }
      }
      step.entries.push_back(std::move(p));
    }
    if (slot_storage) {  // per-request storage ignores fresh blocks, even outside the pool
      const std::vector<std::int64_t> fresh = step.fresh;
      apply([fresh](model_type& m) {
        routing_replay::step_plan blocks;
        blocks.add_fresh_blocks(fresh);
        m.begin_step(blocks);
      });
    }
    open_.emplace(std::move(step));
  }

  /// @brief One write of the forward through a capture path (in a step or outside any).
  void write(const write_spec& spec)
  {
    const write_spec& w = spec;
    trace("write", static_cast<int>(w.via), w.layer, w.num_rows, w.salt, static_cast<int>(w.bad), w.bad_cell,
          w.source_bits, w.stride, w.row_offset, w.null_ids, w.physical, w.empty_map);
    namespace rr = routing_replay;
    std::set<rr::errc> expect;
    const bool layer_known = known_layer(w.layer);
    if (w.via != write_spec::path::device_ref && !layer_known) { expect.insert(rr::errc::unknown_layer); }
    if (w.num_rows < 0) { expect.insert(rr::errc::invalid_argument); }
    if (w.num_rows > config_.max_tokens_per_step) { expect.insert(rr::errc::too_many_tokens); }
    if (w.via == write_spec::path::capture &&
        ((w.stride != 0 && w.stride < config_.top_k) || w.row_offset < 0 ||
         (w.null_ids && w.num_rows > 0) || w.empty_map)) {
      expect.insert(rr::errc::invalid_argument);
    }
    const std::int64_t rows = std::clamp<std::int64_t>(w.num_rows, 0, config_.max_tokens_per_step);
    const std::int64_t bad  = bad_value(w);
    const row_meta* meta    = engine::data(meta_);
    engine::bulk_async(rows + 1, detail_checked::salted_rows{engine::data(meta_), w.salt}, stream_.ref());
    bool accepted = false;
    switch (w.via) {
      case write_spec::path::capture:
        accepted = capture(w, expect, rows, bad);
        break;
      case write_spec::path::layer_view:
        accepted = run_checked("layer_view", expect, false, [&] {
          auto view = lib_->layer_view(w.layer, w.num_rows);
          engine::bulk_async(rows * config_.top_k,
                             write_layer_view<decltype(view)>{meta, view, config_.top_k, w.layer, config_.num_experts,
                                                              cell_of(w), bad},
                             stream_.ref());
        });
        break;
      case write_spec::path::device_ref:
        accepted = run_checked("ref", expect, false, [&] {
          auto ref = lib_->ref(w.num_rows);
          const std::int64_t past = w.bad == write_spec::defect::out_of_bounds ? 1 : 0;  // one row past it
          engine::bulk_async((rows + past) * config_.top_k,
                             record_through_ref<decltype(ref)>{meta, ref, config_.top_k, w.layer, config_.num_experts,
                                                               -1, cell_of(w), bad},
                             stream_.ref());
        });
        break;
    }
    if (accepted && open_) { predict_cells(w, rows, bad); }
  }

  void end_step()
  {
    trace("end_step");
    namespace rr = routing_replay;
    if (!open_) {
      run_checked("end_step", {rr::errc::invalid_state}, false, [&] { lib_->end_step(stream_.ref()); });
      return;
    }
    open_step step = std::move(*open_);
    open_.reset();
    const auto verdict       = classify(step);
    const std::size_t before = lib_->steps_in_flight();
    const outcome out        = invoke("end_step", [&] { lib_->end_step(stream_.ref()); });
    // end_step closes its step whatever happens; only a failure to enqueue it keeps it out of the ring
    const bool pushed = !(out.faulted && out.kind == fault_kind::enqueue);
    if (pushed) {
      flights_.push_back(flight{step.serial, verdict});
      if (verdict) {
        doom(step.serial);
      } else {
        file_in_model(step);
      }
    } else {
      drop_groups(step.serial);
    }
    for (const auto& zombie : step.zombies) {
      apply([zombie](model_type& m) { m.remove(zombie); });
    }
    const bool consumed = account(before, pushed ? 1 : 0, out);
    if (out.threw && !consumed && !out.faulted) { violation("end_step threw " + describe(out) + " for no step it filed"); }
    check_counters();
  }

  /// @brief Opens a clean step: every live request (up to `max_requests` and the step's budget) at
  /// its cursor with `tokens_each` tokens of which `drafts` are drafts, slots of its own blocks, and
  /// a fresh block wherever a token enters one. Returns whether the step opened.
  bool natural_begin(std::int32_t max_requests, std::int32_t tokens_each, std::int32_t drafts)
  {
    routing_replay::step_plan plan;
    std::deque<std::vector<std::int64_t>> slot_lists;
    std::vector<std::int64_t> fresh;
    std::int64_t rows = 0;
    for (const auto& key : live_keys()) {
      if (max_requests-- <= 0) { break; }
      const std::int64_t first = cursor(key);
      const auto n = static_cast<std::int32_t>(std::min<std::int64_t>(
        {tokens_each, config_.max_model_len - first, config_.max_tokens_per_step - rows}));
      if (n <= 0) { continue; }
      auto& slots = slot_lists.emplace_back();
      for (std::int64_t p = first; p < first + n; ++p) {
        slots.push_back(natural_slot(key, p));
        if (p % config_.block_size == 0) { fresh.push_back(slots.back() / config_.block_size); }
      }
      plan.schedule({key, first, n, std::clamp(drafts, 0, n - 1), slots});
      rows += n;
    }
    std::sort(fresh.begin(), fresh.end());
    fresh.erase(std::unique(fresh.begin(), fresh.end()), fresh.end());
    plan.add_fresh_blocks(fresh);
    begin_step(plan);
    return open_.has_value();
  }

  /// @brief Writes every captured layer for the open step's rows, each through a path chosen by
  /// `salt`; with a defect, layer slot 0 gets one bad id.
  void write_all(std::uint32_t salt, write_spec::defect bad = write_spec::defect::none)
  {
    for (std::int32_t l = 0; l < layers_; ++l) {
      write_spec w;
      w.via      = static_cast<write_spec::path>((salt + static_cast<std::uint32_t>(l)) % 3);
      w.layer    = w.via == write_spec::path::device_ref ? l : config_.moe_layers[static_cast<std::size_t>(l)];
      w.num_rows = open_rows();
      w.salt     = salt;
      w.source_bits = 16 << (salt % 3);
      if (l == 0) { w.bad = bad; }
      write(w);
    }
  }

  /// @brief A whole clean step (natural_begin, write_all, end_step); an open step is ended first.
  void natural_step(std::int32_t max_requests, std::int32_t tokens_each, std::int32_t drafts, std::uint32_t salt)
  {
    if (open_) { end_step(); }
    if (!natural_begin(max_requests, tokens_each, drafts)) { return; }
    write_all(salt);
    end_step();
  }

 protected:
  using typename reads::flight;
  using typename reads::group_mirror;
  using typename reads::growth;
  using typename reads::open_step;
  using typename reads::planned_entry;
  using typename reads::request_mirror;
  using reads::account;
  using reads::apply;
  using reads::apply_accept;
  using reads::bad_value;
  using reads::capture;
  using reads::cell_of;
  using reads::cell_sentinel;
  using reads::check_cached;
  using reads::check_counters;
  using reads::classify;
  using reads::config_;
  using reads::describe;
  using reads::doom;
  using reads::drop_groups;
  using reads::file_in_model;
  using reads::flights_;
  using reads::forget;
  using reads::grow_storage;
  using reads::invoke;
  using reads::known_layer;
  using reads::layers_;
  using reads::lib_;
  using reads::live_;
  using reads::meta_;
  using reads::model_key;
  using reads::next_instance_;
  using reads::oldest_pending;
  using reads::open_;
  using reads::predict_cells;
  using reads::predict_plan;
  using reads::remember;
  using reads::row_elems_;
  using reads::run_checked;
  using reads::scheduled_in_open_step;
  using reads::serial_;
  using reads::settle_failed_steps;
  using reads::stream_;
  using reads::trace;
  using reads::violation;

 private:
  static std::string plan_text(const routing_replay::step_plan& plan)
  {
    std::ostringstream s;
    for (const auto& e : plan.entries()) {
      if (e.skipped) {
        s << "skip " << e.request.num_tokens << "; ";
        continue;
      }
      s << e.request.id.to_string() << " @" << e.request.first_position << " n" << e.request.num_tokens << " d"
        << e.request.num_draft_tokens << " slots[";
      for (const auto slot : e.request.slots) { s << slot << " "; }
      s << "]; ";
    }
    s << "fresh[";
    for (const auto b : plan.fresh_blocks()) { s << b << " "; }
    s << "] padded " << plan.padded_rows();
    return s.str();
  }
};

}  // namespace rr_test
