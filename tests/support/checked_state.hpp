/// @file
/// checked_state: what the contract checker knows of the object under test: its mirror of every
/// live request, draft group and step in flight, the reference model it feeds as calls succeed
/// (logged, so that a step discarded late can be taken out again), the engine's own buffers and
/// streams, and the queries a call generator asks.
///
/// checked_replay is built in layers, each a class template deriving from the one below:
/// checked_state (checked_state.hpp: what the checker knows), checked_predictions
/// (checked_predictions.hpp: what the contract says a call must do), checked_oracle
/// (checked_oracle.hpp: running a call and judging its outcome), checked_reads (checked_reads.hpp:
/// the calls that read, transfer blocks or replace the object) and checked_replay
/// (checked_replay.hpp: requests and steps).
#pragma once

#include "checked_writes.hpp"
#include "fault_injection.hpp"
#include "reference_model.hpp"
#include "synthetic_router.hpp"

#include <routing_replay/routing_replay.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace rr_test {

/// @brief The bottom layer of checked_replay (see the file comment). `RR` is any RoutingReplay;
/// its backend may inject faults.
template <class RR>
class checked_state {
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
  explicit checked_state(routing_replay::replay_config config, bool keep_log = false,
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

  checked_state(const checked_state&)            = delete;
  checked_state& operator=(const checked_state&) = delete;

  /// @brief Waits for the engine's stream before anything it reads or writes goes away: the CUDA
  /// backend's frees synchronize the device, the host backend's do not (the engine's own duty).
  ~checked_state() { synchronize_engine(); }

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

 protected:
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
