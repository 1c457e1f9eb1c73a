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
#pragma once

#include "fault_injection.hpp"
#include "reference_model.hpp"
#include "synthetic_router.hpp"

#include <routing_replay/routing_replay.hpp>

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <new>
#include <optional>
#include <set>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

namespace rr_test {

/// @brief The library broke its contract. Never a routing_replay::error, so nothing mistakes it for
/// an expected refusal; doctest reports it as a failure, the fuzzer as a crash.
class contract_violation : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

/// @brief The backend an engine uses for its own buffers and kernels: a fault-injecting backend
/// names the backend it wraps as `base_backend`, so the engine's work never counts as the library's.
template <class Backend>
struct engine_backend {
  using type = Backend;
};
template <class Backend>
  requires requires { typename Backend::base_backend; }
struct engine_backend<Backend> {
  using type = typename Backend::base_backend;
};
template <class Backend>
using engine_backend_t = typename engine_backend<Backend>::type;

/// @brief One write of a forward, as an engine issues it, with at most one bad cell.
struct write_spec {
  enum class path : std::uint8_t { capture, layer_view, device_ref };
  enum class defect : std::uint8_t {
    none,
    above_range,    ///< the id E (capture, record: invalid id; view: a value outside [0, E))
    negative,       ///< the id -2 (for a view: -2 cast to Index, outside [0, E) for every type)
    wide,           ///< an id wider than 16 bits (a 16-bit source narrows it, as the engine's would)
    out_of_bounds,  ///< device_ref: one more record, one row past the reference
  };

  path via = path::capture;
  std::int32_t layer   = 0;  ///< model layer (capture, layer_view) or layer slot (device_ref)
  std::int64_t num_rows = 0;
  std::uint32_t salt   = 0;  ///< ids are a pure function of (salt, layer, row, column)
  defect bad           = defect::none;
  std::int64_t bad_cell = 0;  ///< row * K + column of the bad id
  // capture() only
  std::int32_t source_bits = 64;  ///< source id type: 64, 32 or 16 bits
  std::int64_t stride      = 0;   ///< source_row_stride passed (0: the default, K + S)
  std::int64_t extra_columns = 0; ///< with the default stride: 0; else the buffer's row is this much wider than K
  std::int64_t row_offset  = 0;   ///< source_row_offset (at most 3)
  bool null_ids            = false;
  bool physical            = false;  ///< physical ids mapped through a device map
  bool empty_map           = false;  ///< a map pointer with num_physical_experts 0
};

namespace detail_checked {

/// @brief Fills the rows' metadata of one write: row i is "request" `salt`, position i, so its ids
/// are a pure function of (salt, layer, row, column) that the prediction evaluates on the host.
struct salted_rows {
  row_meta* meta;
  std::uint32_t salt;

  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t row) const noexcept
  {
    meta[row] = row_meta{static_cast<std::int64_t>(salt), row, 0};
  }
};

/// @brief Fills the physical-to-logical map: every entry valid but the last, which maps to -1.
struct fill_physical_map {
  std::int32_t* map;
  std::int64_t entries;
  std::int64_t num_experts;

  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t p) const noexcept
  {
    map[p] = p + 1 < entries ? static_cast<std::int32_t>((p * 7 + 3) % num_experts) : -1;
  }
};

}  // namespace detail_checked

/// @brief See the file comment. `RR` is any RoutingReplay; its backend may inject faults.
template <class RR>
class checked_replay {
 public:
  using index   = typename RR::index_type;
  using engine  = engine_backend_t<typename RR::backend_type>;
  using model_type = reference_model<index>;
  using traits  = routing_replay::index_traits<index>;
  static constexpr bool slot_storage =
    std::is_same_v<typename RR::storage_type, routing_replay::block_slot_storage>;
  static constexpr bool deferred = RR::copy_type::timing == routing_replay::scatter_timing::deferred;
  /// Rows are claimed when a step begins (block-slot storage, device scatter): steps planned
  /// meanwhile may defer to a failed step's claims, and a closed request's per-request segments stay
  /// in use until every step that claimed in them has been filed.
  static constexpr bool claims_when_planned =
    slot_storage || RR::copy_type::site == routing_replay::scatter_site::device;
  static constexpr std::int64_t max_source_offset = 3;
  static constexpr std::int64_t max_extra_columns = 3;

  /// @brief What happened to the last call.
  struct outcome {
    bool threw = false;
    std::optional<routing_replay::errc> code;  ///< set when it threw routing_replay::error
    std::string message;
    bool faulted = false;  ///< an injected fault fired inside the call
    fault_kind kind = fault_kind::none;
  };

  /// @brief Builds the library for `config` (its constructor may fail: see the fault sweeps).
  /// With `keep_log`, every model change is logged so that a step an injected fault discards
  /// after the model filed it can be taken out again.
  /// With `engine_copy_stream`, strategies with a side stream copy on a stream the driver owns and
  /// synchronizes before the object goes away, as an engine that owns its streams does.
  explicit checked_replay(routing_replay::replay_config config, bool keep_log = false,
                          bool engine_copy_stream = false)
    : config_(with_model_layers(std::move(config))),
      layers_(static_cast<std::int32_t>(config_.moe_layers.size())),
      row_elems_(static_cast<std::int64_t>(layers_) * config_.top_k),
      source_elems_(static_cast<std::size_t>((config_.max_tokens_per_step + max_source_offset) *
                                             source_width())),
      ids64_(source_elems_),
      ids32_(source_elems_),
      ids16_(source_elems_),
      physical_map_(static_cast<std::size_t>(physical_entries())),
      meta_(static_cast<std::size_t>(config_.max_tokens_per_step) + 1),
      model_(new_model()),
      keep_log_(keep_log),
      engine_copy_stream_(engine_copy_stream && RR::copy_type::uses_side_stream)
  {
    engine::bulk_async(physical_entries(),
                       detail_checked::fill_physical_map{engine::data(physical_map_), physical_entries(),
                                                         config_.num_experts},
                       stream_.ref());
    engine::synchronize(stream_.ref());
    fault_injector::call_scope call{"constructor"};
    lib_.emplace(make_library());
  }

  checked_replay(const checked_replay&)            = delete;
  checked_replay& operator=(const checked_replay&) = delete;

  /// @brief Waits for the engine's stream before anything it reads or writes goes away: the CUDA
  /// backend's frees synchronize the device, the host backend's do not (the engine's own duty).
  ~checked_replay() { synchronize_engine(); }

  // ---- shape and queries used to generate calls --------------------------------------------------

  [[nodiscard]] const routing_replay::replay_config& config() const noexcept { return config_; }
  [[nodiscard]] RR& library() noexcept { return *lib_; }
  [[nodiscard]] typename engine::stream_ref stream() noexcept { return stream_.ref(); }
  [[nodiscard]] bool in_step() const noexcept { return open_.has_value(); }
  /// @brief N of the open step; outside a step, half of N_max (a warm-up or graph-recording write).
  [[nodiscard]] std::int64_t open_rows() const noexcept
  {
    return open_ ? open_->num_rows : config_.max_tokens_per_step / 2;
  }
  [[nodiscard]] std::int64_t slots() const noexcept { return config_.num_blocks * config_.block_size; }
  /// @brief Keys of live requests, oldest first.
  [[nodiscard]] std::vector<routing_replay::request_key> live_keys() const
  {
    std::vector<std::pair<std::uint64_t, routing_replay::request_key>> by_age;
    for (const auto& [name, r] : live_) { by_age.emplace_back(r.instance, r.id.key()); }
    std::sort(by_age.begin(), by_age.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<routing_replay::request_key> out;
    for (const auto& [age, key] : by_age) { out.push_back(key); }
    return out;
  }
  /// @brief The next position a natural plan schedules for a live request.
  [[nodiscard]] std::int64_t cursor(routing_replay::request_key id) const
  {
    const auto it = live_.find(id.to_string());
    return it == live_.end() ? 0 : it->second.cursor;
  }
  /// @brief Rows the model holds for a live request (0 if unknown).
  [[nodiscard]] std::int64_t model_rows(routing_replay::request_key id) const
  {
    const auto it = live_.find(id.to_string());
    return it == live_.end() ? 0 : model_.recorded_rows(model_key(it->second));
  }
  /// @brief Library calls made so far.
  [[nodiscard]] std::uint64_t calls() const noexcept { return calls_; }
  /// @brief Rows compared against the model so far.
  [[nodiscard]] std::int64_t rows_compared() const noexcept { return rows_compared_; }
  /// @brief Whether content checks were given up after a fault made the model diverge by design.
  [[nodiscard]] bool diverged() const noexcept { return diverged_; }
  /// @brief The last call's outcome.
  [[nodiscard]] const outcome& last() const noexcept { return last_; }
  /// @brief Prints every call, its arguments and its outcome to stderr (to read a failing input).
  void set_trace(bool on) noexcept { trace_ = on; }
  /// @brief Full snapshots (every row of every request; the whole block pool) around refused
  /// calls instead of the cheap counters; the driver drains first, so nothing is in flight.
  void set_full_snapshots(bool full) noexcept { full_snapshots_ = full; }

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

  /// @brief Drafts of a live request's oldest unresolved group, -1 if none.
  [[nodiscard]] std::int32_t pending_drafts(routing_replay::request_key id) const
  {
    const auto it = live_.find(id.to_string());
    if (it == live_.end()) { return -1; }
    const auto* g = oldest_pending(it->second);
    return g == nullptr ? -1 : g->count;
  }

  /// @brief The KV slot natural plans use for a position: requests get disjoint block ranges.
  [[nodiscard]] std::int64_t natural_slot(routing_replay::request_key id, std::int64_t position) const
  {
    const auto it               = live_.find(id.to_string());
    const std::uint64_t inst    = it == live_.end() ? 0 : it->second.instance;
    const std::int64_t blocks   = config_.num_blocks;
    const std::int64_t block    = (static_cast<std::int64_t>(inst) * 3 + position / config_.block_size) % blocks;
    return block * config_.block_size + position % config_.block_size;
  }

  // ---- reading -----------------------------------------------------------------------------------

  void extract(routing_replay::request_key id, const routing_replay::extract_options& o)
  {
    trace("extract", id.to_string(), o.start_position, o.end_position, o.prompt_length, o.include_dense_layers);
    prepare_filing_call();
    remember(id);
    std::optional<typename RR::result_type> got;
    const std::size_t before = lib_->steps_in_flight();
    const auto snap          = snapshot(may_skip_snapshot(predict_read(id, o)));
    const outcome out        = invoke("extract", [&] { got.emplace(lib_->extract(id, o)); });
    if (account(before, 0, out)) { return; }
    const auto expect = predict_read(id, o);
    if (!settle(out, expect, snap, true, "extract")) { return; }
    const auto expected = expected_rows(id, o);
    const auto& r       = live_.at(id.to_string());
    const std::int64_t prompt = o.prompt_length >= 0 ? o.prompt_length : r.prompt_length;
    const std::int64_t layers = o.include_dense_layers ? config_.num_model_layers : layers_;
    if (got->num_rows() != expected.rows || got->first_position() != o.start_position ||
        got->num_layers() != layers || got->top_k() != config_.top_k || got->prompt_length() != prompt) {
      violation("extract(" + id.to_string() + "): shape or metadata differs from the model");
    }
    const std::int64_t split = prompt < 0 ? 0 : std::clamp<std::int64_t>(prompt - o.start_position, 0, expected.rows);
    if (got->prompt_rows().extent(0) != split || got->generation_rows().extent(0) != expected.rows - split) {
      violation("extract(" + id.to_string() + "): prompt/generation split differs");
    }
    compare_rows(id, o.start_position, layers, expected.ids, {got->flat().begin(), got->flat().end()});
    std::int64_t missing = 0;
    for (std::int64_t t = 0; t < expected.rows; ++t) {
      const auto first = expected.ids.begin() + t * layers * config_.top_k;
      missing += std::all_of(first, first + layers * config_.top_k, [](index v) { return v == traits::sentinel; }) ? 1 : 0;
    }
    if (!diverged_ && got->count_missing_rows() != missing) { violation("count_missing_rows differs"); }
  }

  /// @brief extract_into with a buffer `size_delta` elements larger (or smaller) than needed.
  void extract_into(routing_replay::request_key id, const routing_replay::extract_options& o,
                    std::int64_t size_delta)
  {
    trace("extract_into", id.to_string(), o.start_position, o.end_position, o.prompt_length, o.include_dense_layers,
          size_delta);
    prepare_filing_call();
    remember(id);
    const index canary = static_cast<index>(config_.num_experts + 1);
    const std::int64_t need = needed_elems(id, o);
    std::vector<index> buffer(static_cast<std::size_t>(std::max<std::int64_t>(need + size_delta, 0)), canary);
    std::int64_t written     = -1;
    const std::size_t before = lib_->steps_in_flight();
    const auto snap          = snapshot();
    const outcome out        = invoke("extract_into", [&] { written = lib_->extract_into(id, buffer, o); });
    if (account(before, 0, out)) { return; }
    auto expect = predict_read(id, o);
    if (expect.empty() && static_cast<std::int64_t>(buffer.size()) < need) {
      expect.insert(routing_replay::errc::invalid_argument);
    }
    const bool untouched = std::all_of(buffer.begin(), buffer.end(), [&](index v) { return v == canary; });
    if (!settle(out, expect, snap, true, "extract_into")) {
      if (!untouched) { violation("a refused extract_into wrote into the caller's buffer"); }
      return;
    }
    const auto expected = expected_rows(id, o);
    if (written != expected.rows) { violation("extract_into returned a different row count"); }
    const auto n = static_cast<std::size_t>(need);
    if (!std::all_of(buffer.begin() + static_cast<std::ptrdiff_t>(n), buffer.end(), [&](index v) { return v == canary; })) {
      violation("extract_into wrote past the rows it returned");
    }
    compare_rows(id, o.start_position, o.include_dense_layers ? config_.num_model_layers : layers_, expected.ids,
                 std::vector<index>(buffer.begin(), buffer.begin() + static_cast<std::ptrdiff_t>(n)));
  }

  void recorded_rows(routing_replay::request_key id)
  {
    trace("recorded_rows", id.to_string());
    prepare_filing_call();
    remember(id);
    std::set<routing_replay::errc> expect;
    if (live_.count(id.to_string()) == 0) { expect.insert(routing_replay::errc::unknown_request); }
    std::int64_t got         = -1;
    const std::size_t before = lib_->steps_in_flight();
    const auto snap          = snapshot(may_skip_snapshot(expect));
    const outcome out        = invoke("recorded_rows", [&] { got = lib_->recorded_rows(id); });
    if (account(before, 0, out)) { return; }
    if (!settle(out, expect, snap, true, "recorded_rows")) { return; }
    const std::int64_t want = model_rows(id);
    if (!diverged_ && got != want) {
      violation("recorded_rows(" + id.to_string() + ") = " + std::to_string(got) + ", the model has " +
                std::to_string(want));
    }
  }

  void drain()
  {
    trace("drain");
    const std::size_t before = lib_->steps_in_flight();
    const outcome out        = invoke("drain", [&] { lib_->drain(); });
    const bool consumed      = account(before, 0, out);
    if (out.threw && !consumed && !out.faulted) { violation("drain threw " + describe(out) + " for no step it filed"); }
    if (!out.threw && lib_->steps_in_flight() != 0) { violation("drain left steps in flight"); }
  }

  void layer_slot(std::int32_t model_layer)
  {
    trace("layer_slot", model_layer);
    std::int32_t got = -1;
    std::set<routing_replay::errc> expect;
    if (!known_layer(model_layer)) { expect.insert(routing_replay::errc::unknown_layer); }
    if (!run_checked("layer_slot", expect, false, [&] { got = lib_->layer_slot(model_layer); })) { return; }
    const auto at = std::find(config_.moe_layers.begin(), config_.moe_layers.end(), model_layer);
    if (got != static_cast<std::int32_t>(at - config_.moe_layers.begin())) { violation("layer_slot differs"); }
  }

  void reset_device_buffer()
  {
    trace("reset_device_buffer");
    std::set<routing_replay::errc> expect;
    if (open_) { expect.insert(routing_replay::errc::invalid_state); }
    run_checked("reset_device_buffer", expect, false, [&] { lib_->reset_device_buffer(stream_.ref()); });
  }

  // ---- block transfers (block-slot storage) ------------------------------------------------------

  void export_blocks(std::span<const std::int64_t> blocks, std::int64_t size_delta)
  {
    trace("export_blocks", blocks.size(), size_delta);
    if constexpr (slot_storage) {
      const auto need = static_cast<std::int64_t>(blocks.size()) * config_.block_size * row_elems_;
      std::vector<index> out(static_cast<std::size_t>(std::max<std::int64_t>(need + size_delta, 0)),
                             static_cast<index>(config_.num_experts + 1));
      auto expect = predict_transfer(blocks, static_cast<std::int64_t>(out.size()) < need);
      if (!transfer("export_blocks", expect, [&] { lib_->export_blocks(blocks, out); })) { return; }
      const auto want = model_.export_blocks(blocks);
      if (!diverged_ && !std::equal(want.begin(), want.end(), out.begin())) {
        violation("export_blocks differs from the model");
      }
      last_export_.assign(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(need));
    }
  }

  /// @brief Imports the rows of the last export (or synthetic rows, some missing) into `blocks`.
  void import_blocks(std::span<const std::int64_t> blocks, std::int64_t size_delta, std::uint32_t salt)
  {
    trace("import_blocks", blocks.size(), size_delta);
    if constexpr (slot_storage) {
      const auto need = static_cast<std::int64_t>(blocks.size()) * config_.block_size * row_elems_;
      std::vector<index> rows(static_cast<std::size_t>(std::max<std::int64_t>(need + size_delta, 0)));
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const auto row = static_cast<std::int64_t>(i) / row_elems_;
        rows[i] = i < last_export_.size() && salt % 2 == 0
                    ? last_export_[i]
                    : (row % 5 == 3 ? traits::sentinel
                                    : static_cast<index>(routed_expert(
                                        row_meta{static_cast<std::int64_t>(salt), row, 0}, 0,
                                        static_cast<std::int32_t>(i % static_cast<std::size_t>(row_elems_)),
                                        config_.num_experts)));
      }
      auto expect = predict_transfer(blocks, static_cast<std::int64_t>(rows.size()) < need);
      if (!transfer("import_blocks", expect, [&] { lib_->import_blocks(blocks, rows); })) { return; }
      const std::vector<std::int64_t> b(blocks.begin(), blocks.end());
      const std::vector<index> r(rows.begin(), rows.begin() + static_cast<std::ptrdiff_t>(need));
      apply([b, r](model_type& m) { m.import_blocks(b, r); });
    }
  }

  void copy_blocks(std::span<const std::int64_t> source, std::span<const std::int64_t> destination)
  {
    trace("copy_blocks", source.size(), destination.size());
    if constexpr (slot_storage) {
      std::set<routing_replay::errc> expect;
      bool both = false;
      for (const auto d : destination) { both |= std::find(source.begin(), source.end(), d) != source.end(); }
      if (source.size() != destination.size() || both) {
        expect.insert(routing_replay::errc::invalid_argument);
      } else {
        expect = predict_transfer(source, false);
        for (const auto c : predict_transfer(destination, false)) { expect.insert(c); }
      }
      if (!transfer("copy_blocks", expect, [&] { lib_->copy_blocks(source, destination); })) { return; }
      const std::vector<std::int64_t> s(source.begin(), source.end());
      const std::vector<std::int64_t> d(destination.begin(), destination.end());
      apply([s, d](model_type& m) { m.import_blocks(d, m.export_blocks(s)); });
    }
  }

  // ---- the object itself -------------------------------------------------------------------------

  /// @brief Moves the object out and back (move construction, then move assignment over the
  /// moved-from object): nothing observable may change, steps in flight and the open step included.
  void move_round_trip()
  {
    trace("move_round_trip");
    const auto before = counters();
    {
      fault_injector::call_scope call{"move"};
      RR moved{std::move(*lib_)};
      *lib_ = std::move(moved);
    }
    if (counters() != before) { violation("moving the object changed its counters"); }
  }

  /// @brief Assigns a new object over this one: its steps in flight are dropped, everything starts
  /// afresh. Constructing the new one may fail (fault sweeps): then nothing changes.
  void replace()
  {
    trace("replace");
    synchronize_engine();  // the engine's own forwards write into the object's buffers
    const auto before = counters();
    const outcome out = invoke("replace", [&] { *lib_ = make_library(); });
    if (out.threw) {
      if (!out.faulted) { violation("constructing a replacement threw " + describe(out)); }
      if (counters() != before) { violation("a failed replacement changed the object"); }
      return;
    }
    live_.clear();
    flights_.clear();
    pending_segments_.clear();
    parked_.clear();
    filed_through_ = 0;
    open_.reset();
    serial_ = 0;
    log_.clear();
    discarded_.clear();
    model_    = new_model();
    diverged_ = false;
  }

  /// @brief Files everything, then compares every request and the whole pool with the model.
  void check_everything()
  {
    while (lib_->steps_in_flight() > 0) { drain(); }  // each drain files at least one step
    const auto snap = full_snapshot();
    check_counters();
    if (diverged_) { return; }
    for (const auto& [name, rows] : snap.rows) {
      const auto& r = live_.at(name);
      const auto want = model_.extract(model_key(r), 0, model_.recorded_rows(model_key(r)));
      compare_rows(r.id.key(), 0, layers_, want, rows);
    }
    for (const auto& [name, recorded] : snap.recorded) {
      if (recorded != model_.recorded_rows(model_key(live_.at(name)))) {
        violation("recorded_rows(" + name + ") differs from the model");
      }
    }
    if constexpr (slot_storage) {
      if (!open_) {
        std::vector<std::int64_t> all(static_cast<std::size_t>(config_.num_blocks));
        for (std::size_t b = 0; b < all.size(); ++b) { all[b] = static_cast<std::int64_t>(b); }
        const auto want = model_.export_blocks(all);
        const auto diff = std::mismatch(want.begin(), want.end(), snap.pool.begin()).first - want.begin();
        if (static_cast<std::size_t>(diff) < want.size()) {
          violation("the block pool differs from the model at slot " + std::to_string(diff / row_elems_) +
                    ", element " + std::to_string(diff % row_elems_) + ": got " +
                    std::to_string(+snap.pool[static_cast<std::size_t>(diff)]) + ", the model has " +
                    std::to_string(+want[static_cast<std::size_t>(diff)]));
        }
      }
    }
  }

 private:
  static constexpr std::int64_t cell_sentinel = -1;  // the cell holds the sentinel
  static constexpr std::int64_t cell_invalid  = -2;  // the cell holds a value outside [0, E)

  struct group_mirror {
    std::uint64_t serial  = 0;
    std::int32_t count    = 0;
    std::int32_t accepted = -1;
    bool doomed           = false;  ///< its step had a device-detected problem
    bool filed_in_model   = false;
  };
  struct request_mirror {
    explicit request_mirror(routing_replay::request_key key) : id(key) {}
    routing_replay::request_id id;
    std::uint64_t instance    = 0;
    std::int64_t prompt_length = -1;
    std::deque<group_mirror> groups;
    std::size_t capacity_bytes = 0;  ///< per-request storage: bytes of the segments reserved
    std::uint64_t last_claim   = 0;  ///< per-request storage claiming when planned: the last step that claimed
    std::uint64_t scheduled_in = 0;  ///< serial of the last step that scheduled it
    std::int64_t cursor        = 0;
  };
  struct planned_entry {
    bool skipped           = false;
    std::int32_t num_tokens = 0;
    std::uint64_t instance = 0;
    std::int64_t first_position = 0;
    std::int32_t num_draft = 0;
    std::vector<std::int64_t> slots;
  };
  struct open_step {
    std::uint64_t serial  = 0;
    std::int64_t num_rows = 0;
    std::vector<planned_entry> entries;
    std::vector<std::int64_t> fresh;
    std::vector<std::int64_t> cells;  ///< [N_max, L, K]: id, cell_sentinel or cell_invalid
    bool invalid_id    = false;       ///< capture or record saw an id outside [0, E)
    bool out_of_bounds = false;       ///< a record outside the buffer
    std::vector<std::string> zombies; ///< model keys of requests aborted during the step
  };
  struct flight {
    std::uint64_t serial;
    std::optional<routing_replay::errc> verdict;  ///< the code it must be reported with, if any
  };
  struct growth {
    bool exact = false;
  };
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
  struct expected_read {
    std::int64_t rows = 0;
    std::vector<index> ids;
  };
  struct log_entry {
    std::uint64_t step;  ///< 0: not tied to a step
    std::function<void(model_type&)> change;
  };

  // -- calls ------------------------------------------------------------------------------------

  [[nodiscard]] std::int64_t source_width() const noexcept
  {
    return config_.top_k + config_.num_fused_shared_experts + max_extra_columns;
  }
  [[nodiscard]] std::int64_t physical_entries() const noexcept { return config_.num_experts + 8; }

  RR make_library()
  {
    if constexpr (RR::copy_type::uses_side_stream) {
      if (engine_copy_stream_) { return RR{config_, copy_stream_.ref()}; }
    }
    return RR{config_};
  }

  // Waits for the engine's streams (a failed engine task was reported by the call it belonged to).
  void synchronize_engine() noexcept
  {
    for (auto* s : {&stream_, &copy_stream_}) {
      try {
        engine::synchronize(s->ref());
      } catch (...) {
      }
    }
  }

  // num_model_layers 0 means one past the largest MoE layer (replay_config).
  static routing_replay::replay_config with_model_layers(routing_replay::replay_config c)
  {
    if (c.num_model_layers == 0 && !c.moe_layers.empty()) {
      c.num_model_layers = *std::max_element(c.moe_layers.begin(), c.moe_layers.end()) + 1;
    }
    return c;
  }

  model_type new_model() const
  {
    return model_type{slot_storage, config_.overwrite_recomputed_rows, config_.block_size, config_.num_blocks,
                      row_elems_};
  }

  static std::string model_key(const request_mirror& r) { return "#" + std::to_string(r.instance); }

  [[nodiscard]] std::string describe(const outcome& out) const
  {
    if (!out.threw) { return "nothing"; }
    if (out.code) { return "error code " + std::to_string(static_cast<int>(*out.code)) + " (" + out.message + ")"; }
    return out.message;
  }

  [[noreturn]] void violation(const std::string& what) const
  {
    std::ostringstream s;
    s << "contract violation after " << calls_ << " calls (step serial " << serial_ << "): " << what;
    throw contract_violation{s.str()};
  }

  template <class... Args>
  void trace(const char* op, const Args&... args) const
  {
    if (!trace_) { return; }
    std::ostringstream line;
    line << "[" << calls_ << "] " << op << "(";
    [[maybe_unused]] const char* sep = "";
    ((line << sep << args, sep = ", "), ...);
    line << ")";
    std::fprintf(stderr, "%s\n", line.str().c_str());
  }

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

  [[nodiscard]] std::size_t expected_host_bytes() const
  {
    if constexpr (slot_storage) {
      return static_cast<std::size_t>(slots() * row_elems_) * sizeof(index);
    } else {
      std::size_t bytes = 0;
      for (const auto& [name, r] : live_) { bytes += r.capacity_bytes; }
      for (const auto& p : pending_segments_) { bytes += p.first; }
      return bytes;
    }
  }

  // -- the model --------------------------------------------------------------------------------

  void apply(std::function<void(model_type&)> change, std::uint64_t step = 0)
  {
    change(model_);
    if (keep_log_) { log_.push_back({step, std::move(change)}); }
  }

  // A step the model filed when it ended was discarded later (its copy failed): the model is
  // rebuilt without it. Where rows are claimed when a step begins, steps planned meanwhile diverge
  // by design (they may have deferred to its claims), so content is no longer compared.
  void discard_after_fault(std::uint64_t serial)
  {
    drop_groups(serial);
    if (!keep_log_) { violation("a step was discarded after an injected fault, but no log was kept"); }
    if (claims_when_planned && serial != serial_) { diverged_ = true; }
    discarded_.insert(serial);
    model_ = new_model();
    for (const auto& e : log_) {
      if (e.step == 0 || discarded_.count(e.step) == 0) { e.change(model_); }
    }
  }

  void file_in_model(open_step& step)
  {
    // the plan as the model files it: requests gone since are skipped (their rows are dropped)
    auto entries = std::make_shared<std::vector<planned_entry>>(step.entries);
    std::vector<std::string> keys;
    for (auto& e : *entries) {
      keys.push_back(e.skipped || !alive(e.instance, step) ? std::string{} : "#" + std::to_string(e.instance));
    }
    auto cells          = std::make_shared<std::vector<std::int64_t>>(std::move(step.cells));
    const auto serial   = step.serial;
    const auto row_elems = row_elems_;
    apply(
      [entries, keys, cells, serial, row_elems](model_type& m) {
        routing_replay::step_plan plan;
        for (std::size_t i = 0; i < entries->size(); ++i) {
          const auto& e = (*entries)[i];
          if (keys[i].empty()) {
            plan.skip(e.num_tokens);
          } else {
            plan.schedule({keys[i], e.first_position, e.num_tokens, e.num_draft, e.slots});
          }
        }
        m.file_step(plan, serial, [&](std::int64_t row) {
          std::vector<index> r;
          for (std::int64_t i = 0; i < row_elems; ++i) { r.push_back(static_cast<index>((*cells)[static_cast<std::size_t>(row * row_elems + i)])); }
          return r;
        });
      },
      serial);
    for (auto& [name, r] : live_) {
      for (auto& g : r.groups) {
        if (g.serial != serial) { continue; }
        g.filed_in_model = true;
        if (g.accepted >= 0) { apply_accept(r, g); }  // accepted before its rows arrived
      }
    }
  }

  void apply_accept(request_mirror& r, group_mirror& g)
  {
    const auto key      = model_key(r);
    const auto accepted = g.accepted;
    apply([key, accepted](model_type& m) { m.accept_draft(key, accepted); }, g.serial);
    const auto serial = g.serial;
    std::erase_if(r.groups, [serial](const group_mirror& x) { return x.serial == serial; });
  }

  [[nodiscard]] bool alive(std::uint64_t instance, const open_step& step) const
  {
    for (const auto& [name, r] : live_) {
      if (r.instance == instance) { return true; }
    }
    return std::find(step.zombies.begin(), step.zombies.end(), "#" + std::to_string(instance)) != step.zombies.end();
  }

  void doom(std::uint64_t serial)
  {
    for (auto& [name, r] : live_) {
      for (auto& g : r.groups) { g.doomed |= g.serial == serial; }
    }
  }

  void drop_groups(std::uint64_t serial)
  {
    for (auto& [name, r] : live_) {
      std::erase_if(r.groups, [serial](const group_mirror& g) { return g.serial == serial; });
    }
  }

  static group_mirror* oldest_pending(request_mirror& r)
  {
    for (auto& g : r.groups) {
      if (g.accepted < 0) { return &g; }
    }
    return nullptr;
  }
  static const group_mirror* oldest_pending(const request_mirror& r)
  {
    for (const auto& g : r.groups) {
      if (g.accepted < 0) { return &g; }
    }
    return nullptr;
  }

  // A step left the ring (filed or discarded): segments of closed requests it was the last to claim
  // in are free again.
  void retired(std::uint64_t serial)
  {
    filed_through_ = serial;
    std::erase_if(pending_segments_, [serial](const auto& p) { return p.second <= serial; });
  }

  [[nodiscard]] bool scheduled_in_open_step(const request_mirror& r) const
  {
    return open_ && r.scheduled_in == open_->serial;
  }

  // A request leaves: the model forgets it now, or, if block-slot storage already claimed rows
  // for it in the open step, once that step is filed (the rows still land at their slots).
  void forget(typename std::map<std::string, request_mirror>::iterator it)
  {
    const auto key = model_key(it->second);
    if (!slot_storage && it->second.capacity_bytes > 0 && parked_.size() < max_parked) {
      parked_.emplace_back(it->second.capacity_bytes, it->second.last_claim);  // kept for a new request
    } else if (!slot_storage && claims_when_planned && it->second.last_claim > filed_through_) {
      pending_segments_.emplace_back(it->second.capacity_bytes, it->second.last_claim);
    }
    if (slot_storage && scheduled_in_open_step(it->second)) {
      open_->zombies.push_back(key);
    } else {
      apply([key](model_type& m) { m.remove(key); });
    }
    live_.erase(it);
  }

  void remember(routing_replay::request_key id)
  {
    const auto name = id.to_string();
    if (known_names_.insert(name).second) { known_.emplace_back(id); }
  }

  // -- predictions ------------------------------------------------------------------------------

  [[nodiscard]] bool known_layer(std::int32_t model_layer) const
  {
    return std::find(config_.moe_layers.begin(), config_.moe_layers.end(), model_layer) != config_.moe_layers.end();
  }

  void check_cached(std::span<const std::int64_t> cached, std::set<routing_replay::errc>& expect) const
  {
    if (static_cast<std::int64_t>(cached.size()) > config_.max_model_len) {
      expect.insert(routing_replay::errc::position_out_of_range);
    }
    if (slot_storage) {
      for (const auto s : cached) {
        if (s < 0 || s >= slots()) { expect.insert(routing_replay::errc::slot_out_of_range); }
      }
    }
  }

  // Per-request storage (design.md 3.5): a request with no rows yet takes over the smallest parked
  // range that holds them and no kernel writes any more; otherwise it grows by a segment, after
  // giving parked ranges back to the arena (oldest first) while the arena would cross the limit.
  void grow_storage(std::size_t& capacity, std::int64_t rows, bool exact)
  {
    const std::size_t bytes = segment_bytes(capacity, rows, exact);
    if (bytes == 0) { return; }
    if (capacity == 0) {
      const auto row_bytes   = static_cast<std::size_t>(row_elems_) * sizeof(index);
      const std::size_t need = static_cast<std::size_t>(std::min(rows, config_.max_model_len)) * row_bytes;
      auto best              = parked_.end();
      for (auto p = parked_.begin(); p != parked_.end(); ++p) {
        if (p->second <= filed_through_ && p->first >= need && (best == parked_.end() || p->first < best->first)) {
          best = p;
        }
      }
      if (best != parked_.end()) {
        capacity = best->first;
        *best    = parked_.back();  // the store keeps no order among the rest but eviction's
        parked_.pop_back();
        return;
      }
    }
    const auto parked_bytes = [&] {
      std::size_t sum = 0;
      for (const auto& p : parked_) { sum += p.first; }
      return sum;
    };
    while (!parked_.empty() && expected_host_bytes() + parked_bytes() + bytes > config_.host_memory_limit) {
      if (parked_.front().second > filed_through_) { pending_segments_.push_back(parked_.front()); }
      parked_.erase(parked_.begin());
    }
    capacity += bytes;
  }

  // Per-request storage grows a request by one segment of its arena (design.md 3.5): a page
  // multiple of at least 16 rows times a power of two, at least doubling the request's capacity (or,
  // `exact`, the smallest that holds `rows`), never above the segment that holds max_model_len rows.
  [[nodiscard]] std::size_t segment_bytes(std::size_t capacity, std::int64_t rows, bool exact) const
  {
    const auto row_bytes   = static_cast<std::size_t>(row_elems_) * sizeof(index);
    const auto page        = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    const std::size_t base = (16 * row_bytes + page - 1) / page * page;
    const auto order_for   = [base](std::size_t bytes) {
      return std::bit_width(std::bit_ceil(std::max<std::size_t>(1, (bytes + base - 1) / base))) - 1;
    };
    const std::size_t need = static_cast<std::size_t>(std::min(rows, config_.max_model_len)) * row_bytes;
    if (need <= capacity) { return 0; }
    const std::size_t increment = exact ? need - capacity : std::max(need - capacity, capacity);
    const auto max_order = order_for(static_cast<std::size_t>(config_.max_model_len) * row_bytes);
    return base << std::min(order_for(increment), max_order);
  }

  std::set<routing_replay::errc> predict_plan(const routing_replay::step_plan& plan, growth& g) const
  {
    namespace rr = routing_replay;
    if (open_) { return {rr::errc::invalid_state}; }
    std::set<rr::errc> expect;
    if (plan.num_rows() > config_.max_tokens_per_step) { expect.insert(rr::errc::too_many_tokens); }
    if (plan.padded_rows() > config_.max_tokens_per_step) { expect.insert(rr::errc::too_many_tokens); }
    std::set<std::string> seen;
    std::set<std::int64_t> used_slots;
    std::size_t grow  = 0;
    std::size_t exact = 0;
    for (const auto& e : plan.entries()) {
      const auto& s = e.request;
      if (s.num_tokens < 0) {
        expect.insert(rr::errc::invalid_plan);
        continue;
      }
      if (e.skipped) { continue; }
      const auto it = live_.find(s.id.to_string());
      if (it == live_.end()) {
        expect.insert(rr::errc::unknown_request);
        continue;
      }
      if (!seen.insert(s.id.to_string()).second) {
        expect.insert(rr::errc::duplicate_request);
        continue;
      }
      bool ok = true;
      if (s.first_position < 0 || s.first_position > config_.max_model_len - s.num_tokens) {
        expect.insert(rr::errc::position_out_of_range);
        ok = false;
      }
      if (s.num_draft_tokens < 0 || s.num_draft_tokens > s.num_tokens ||
          s.num_draft_tokens > routing_replay::max_draft_tokens) {
        expect.insert(rr::errc::invalid_plan);
        ok = false;
      }
      if (slot_storage) {
        if (s.slots.size() != static_cast<std::size_t>(s.num_tokens)) {
          expect.insert(rr::errc::slot_out_of_range);
          ok = false;
        }
        for (const auto slot : s.slots) {
          if (slot < 0 || slot >= slots() || !used_slots.insert(slot).second) {
            expect.insert(rr::errc::slot_out_of_range);
            ok = false;
          }
        }
      }
      if (ok && !slot_storage) {
        const std::size_t have  = it->second.capacity_bytes;
        const std::int64_t rows = s.first_position + s.num_tokens;
        grow += segment_bytes(have, rows, false);
        exact += segment_bytes(have, rows, true);
      }
    }
    if (slot_storage) {
      for (const auto b : plan.fresh_blocks()) {
        if (b < 0 || b >= config_.num_blocks) { expect.insert(rr::errc::slot_out_of_range); }
      }
    }
    if (!slot_storage) {
      const std::size_t in_use = expected_host_bytes();
      g.exact = in_use + grow > config_.host_memory_limit;
      if (g.exact && in_use + exact > config_.host_memory_limit) {
        expect.insert(rr::errc::host_memory_exhausted);
      }
    }
    return expect;
  }

  std::set<routing_replay::errc> predict_read(routing_replay::request_key id,
                                              const routing_replay::extract_options& o) const
  {
    namespace rr = routing_replay;
    const auto it = live_.find(id.to_string());
    if (it == live_.end()) { return {rr::errc::unknown_request}; }
    std::set<rr::errc> expect;
    if (oldest_pending(it->second) != nullptr) { expect.insert(rr::errc::draft_error); }
    const std::int64_t recorded = model_.recorded_rows(model_key(it->second));
    const std::int64_t end      = o.end_position < 0 ? recorded : o.end_position;
    if (o.start_position < 0 || o.start_position > end || end > recorded) {
      if (!diverged_) { expect.insert(rr::errc::position_out_of_range); }
    }
    return expect;
  }

  // What extract_into needs, as the prediction sees it before the call (0 if the read is refused).
  [[nodiscard]] std::int64_t needed_elems(routing_replay::request_key id,
                                          const routing_replay::extract_options& o) const
  {
    const auto it = live_.find(id.to_string());
    if (it == live_.end()) { return 0; }
    const std::int64_t recorded = model_.recorded_rows(model_key(it->second));
    const std::int64_t end      = o.end_position < 0 ? recorded : o.end_position;
    if (o.start_position < 0 || o.start_position > end || end > recorded) { return 0; }
    return (end - o.start_position) * (o.include_dense_layers ? config_.num_model_layers : layers_) * config_.top_k;
  }

  [[nodiscard]] expected_read expected_rows(routing_replay::request_key id,
                                            const routing_replay::extract_options& o) const
  {
    const auto& r              = live_.at(id.to_string());
    const std::int64_t recorded = model_.recorded_rows(model_key(r));
    const std::int64_t end      = o.end_position < 0 ? recorded : o.end_position;
    expected_read out;
    out.rows       = end - o.start_position;
    const auto ids = model_.extract(model_key(r), o.start_position, end);
    if (!o.include_dense_layers) {
      out.ids = ids;
      return out;
    }
    const auto k = static_cast<std::size_t>(config_.top_k);
    for (std::int64_t t = 0; t < out.rows; ++t) {
      for (std::int32_t m = 0; m < config_.num_model_layers; ++m) {
        const auto at = std::find(config_.moe_layers.begin(), config_.moe_layers.end(), m);
        if (at == config_.moe_layers.end()) {
          out.ids.insert(out.ids.end(), k, traits::sentinel);
        } else {
          const auto from = ids.begin() + static_cast<std::ptrdiff_t>(
                                            (t * layers_ + (at - config_.moe_layers.begin())) * config_.top_k);
          out.ids.insert(out.ids.end(), from, from + static_cast<std::ptrdiff_t>(k));
        }
      }
    }
    return out;
  }

  void compare_rows(routing_replay::request_key id, std::int64_t first, std::int64_t layers,
                    const std::vector<index>& want, const std::vector<index>& got)
  {
    if (diverged_) { return; }
    if (want.size() != got.size()) {
      violation("request " + id.to_string() + ": " + std::to_string(got.size()) + " ids, the model has " +
                std::to_string(want.size()));
    }
    const std::int64_t row = layers * config_.top_k;
    for (std::size_t i = 0; i < want.size(); ++i) {
      if (want[i] != got[i]) {
        std::ostringstream s;
        s << "request " << id.to_string() << " position " << first + static_cast<std::int64_t>(i) / row
          << " element " << static_cast<std::int64_t>(i) % row << ": got " << +got[i] << ", the model has "
          << +want[i];
        violation(s.str());
      }
    }
    rows_compared_ += row == 0 ? 0 : static_cast<std::int64_t>(want.size()) / row;
  }

  std::set<routing_replay::errc> predict_transfer(std::span<const std::int64_t> blocks, bool too_small) const
  {
    namespace rr = routing_replay;
    if (open_) { return {rr::errc::invalid_state}; }
    std::set<rr::errc> expect;
    for (const auto b : blocks) {
      if (b < 0 || b >= config_.num_blocks) { expect.insert(rr::errc::slot_out_of_range); }
    }
    if (too_small) { expect.insert(rr::errc::invalid_argument); }
    return expect;
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

  // -- writes -----------------------------------------------------------------------------------

  [[nodiscard]] std::int64_t cell_of(const write_spec& w) const noexcept
  {
    return w.bad == write_spec::defect::none || w.bad == write_spec::defect::out_of_bounds ? -1 : w.bad_cell;
  }

  [[nodiscard]] std::int64_t bad_value(const write_spec& w) const noexcept
  {
    switch (w.bad) {
      case write_spec::defect::above_range: return w.physical ? physical_entries() - 1 : config_.num_experts;
      case write_spec::defect::negative: return -2;
      case write_spec::defect::wide: return (std::int64_t{1} << 16) + config_.num_experts / 2;
      default: return 0;
    }
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

  // The id a write puts at (row, column), as its kernels compute it.
  [[nodiscard]] std::int64_t predicted(const write_spec& w, std::int64_t row, std::int32_t column,
                                       std::int64_t modulo, std::int64_t bad) const noexcept
  {
    return routed_or_bad(row_meta{static_cast<std::int64_t>(w.salt), row, 0}, w.layer, row, column, config_.top_k,
                         modulo, cell_of(w), bad);
  }

  // The cells a write leaves in the open step, and what it reports.
  void predict_cells(const write_spec& w, std::int64_t rows, std::int64_t bad)
  {
    auto& s            = *open_;
    const auto k       = config_.top_k;
    const auto e       = config_.num_experts;
    auto cell          = [&](std::int32_t slot, std::int64_t row, std::int32_t c) -> std::int64_t& {
      return s.cells[static_cast<std::size_t>((row * layers_ + slot) * k + c)];
    };
    auto narrow = [&](std::int64_t v) -> std::int64_t {  // the source type's view of an id
      switch (w.source_bits) {
        case 16: return static_cast<std::int16_t>(v);
        case 32: return static_cast<std::int32_t>(v);
        default: return v;
      }
    };
    auto record = [&](std::int32_t slot, std::int64_t row, std::int32_t c, std::int64_t id) {
      if (id >= 0 && id < e) {
        cell(slot, row, c) = id;
      } else {
        cell(slot, row, c) = cell_sentinel;
        s.invalid_id       = true;
      }
    };
    switch (w.via) {
      case write_spec::path::capture: {
        const auto slot = static_cast<std::int32_t>(
          std::find(config_.moe_layers.begin(), config_.moe_layers.end(), w.layer) - config_.moe_layers.begin());
        const std::int64_t modulo = w.physical ? physical_entries() - 1 : e;
        for (std::int64_t r = 0; r < rows; ++r) {
          for (std::int32_t c = 0; c < k; ++c) {
            std::int64_t id = narrow(predicted(w, r, c, modulo, bad));
            if (w.physical) {
              id = id >= 0 && id < physical_entries()
                     ? (id + 1 < physical_entries() ? (id * 7 + 3) % e : -1)
                     : -1;
            }
            record(slot, r, c, id);
          }
        }
        break;
      }
      case write_spec::path::layer_view: {
        const auto slot = static_cast<std::int32_t>(
          std::find(config_.moe_layers.begin(), config_.moe_layers.end(), w.layer) - config_.moe_layers.begin());
        for (std::int64_t r = 0; r < rows; ++r) {
          for (std::int32_t c = 0; c < k; ++c) {
            const auto v = static_cast<index>(predicted(w, r, c, e, bad));
            cell(slot, r, c) = v == traits::sentinel ? cell_sentinel
                                                     : (traits::is_valid(static_cast<std::int64_t>(v), e)
                                                          ? static_cast<std::int64_t>(v)
                                                          : cell_invalid);
          }
        }
        break;
      }
      case write_spec::path::device_ref: {
        if (rows > 0 && (w.layer < 0 || w.layer >= layers_)) { s.out_of_bounds = true; }
        if (w.bad == write_spec::defect::out_of_bounds) { s.out_of_bounds = true; }
        if (w.layer < 0 || w.layer >= layers_) { break; }
        for (std::int64_t r = 0; r < rows; ++r) {
          for (std::int32_t c = 0; c < k; ++c) {
            record(w.layer, r, c, predicted(w, r, c, e, bad));
          }
        }
        break;
      }
    }
  }

  // The code a closed step must be reported with, by priority (docs/errors.md), or none.
  [[nodiscard]] std::optional<routing_replay::errc> classify(const open_step& s) const
  {
    namespace rr = routing_replay;
    const auto n = static_cast<std::size_t>(s.num_rows * row_elems_);
    const auto first = s.cells.begin();
    if (s.invalid_id || std::find(first, first + static_cast<std::ptrdiff_t>(n), cell_invalid) != first + static_cast<std::ptrdiff_t>(n)) {
      return rr::errc::invalid_expert_id;
    }
    if (s.out_of_bounds) { return rr::errc::invalid_argument; }
    if (std::find(first, first + static_cast<std::ptrdiff_t>(n), cell_sentinel) != first + static_cast<std::ptrdiff_t>(n)) {
      return rr::errc::missing_routing;
    }
    return std::nullopt;
  }

  // -- state ------------------------------------------------------------------------------------

  routing_replay::replay_config config_;
  std::int32_t layers_;
  std::int64_t row_elems_;
  std::size_t source_elems_;
  typename engine::template device_vector<std::int64_t> ids64_;
  typename engine::template device_vector<std::int32_t> ids32_;
  typename engine::template device_vector<std::int16_t> ids16_;
  typename engine::template device_vector<std::int32_t> physical_map_;
  typename engine::template device_vector<row_meta> meta_;  // the rows of the write being issued
  model_type model_;
  bool keep_log_;
  bool engine_copy_stream_;
  std::vector<log_entry> log_;
  std::set<std::uint64_t> discarded_;
  bool diverged_       = false;
  bool full_snapshots_ = false;
  bool trace_          = false;
  std::map<std::string, request_mirror> live_;
  std::vector<routing_replay::request_id> known_;
  std::set<std::string> known_names_;
  std::deque<flight> flights_;
  std::uint64_t filed_through_ = 0;  ///< serial of the last step that left the ring
  std::vector<std::pair<std::size_t, std::uint64_t>> pending_segments_;  ///< closed requests' bytes, last claim
  std::vector<std::pair<std::size_t, std::uint64_t>> parked_;  ///< parked ranges: bytes, last claim
  static constexpr std::size_t max_parked = 256;               ///< as detail::request_ranges
  std::optional<open_step> open_;
  std::uint64_t serial_        = 0;
  std::uint64_t next_instance_ = 1;
  std::uint64_t calls_         = 0;
  std::int64_t rows_compared_  = 0;
  std::vector<index> last_export_;
  outcome last_;
  typename engine::stream copy_stream_;  // outlives the object, which may copy on it
  std::optional<RR> lib_;
  // last: destroyed first, so the engine's queued work finishes before the object and the buffers
  // it writes go away (the host backend drains a stream when it is destroyed)
  typename engine::stream stream_;
};

}  // namespace rr_test
