/// @file
/// Data path, part 2, its first half: the step validator. Checks an engine's step_plan against the
/// live requests and the host storage before anything changes (and, where the filer claims the
/// common run while the plan is checked, claims it), and keeps the state of the step being planned:
/// the record, the serials, whether a step is open. The step planner (data_path/step_planner.hpp)
/// derives from it and commits an accepted plan.
#pragma once

#include <routing_replay/config.hpp>
#include <routing_replay/data_path/request_registry.hpp>
#include <routing_replay/data_path/step_record.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/step_plan.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory_resource>
#include <string>
#include <vector>

namespace routing_replay {

/// @brief Validates plans: the first of the two phases a step is planned in (step_planner, which
/// derives from this class, has the second); knows whether a step is open and the serial of the
/// latest one.
///
/// validate() checks the whole plan: it throws, and the object is as before, or it accepts the plan,
/// which step_planner::open() then commits or abandon() gives up. Where the filer claims the common
/// run while the plan is validated (Filer::plans_fresh_runs), validate() claims those runs as it
/// checks them, one pass over the plan, and gives the claims back if it refuses the plan.
template <class Index>
class step_validator {
 public:
  /// @brief A validator for a validated configuration; its records' op lists come from
  /// `ops_memory` (pinned memory with device scatter: copy_pipeline::ops_memory()).
  step_validator(const replay_config& config, std::pmr::memory_resource* ops_memory)
    : max_rows_(config.max_tokens_per_step), max_model_len_(config.max_model_len), record_(ops_memory)
  {
  }

  /// @brief Room for `pieces` ops in the record, so that no step reallocates the op list (pinned
  /// memory is slow to allocate, and freeing it waits for the device).
  void reserve_ops(std::size_t pieces) { record_.ops.reserve(pieces); }

  /// @brief Whether a step is open (between open() and close()).
  [[nodiscard]] bool is_open() const noexcept { return open_; }
  /// @brief Serial of the latest step opened (0 before the first).
  [[nodiscard]] std::uint64_t latest_serial() const noexcept { return serial_; }
  /// @brief Serial of the latest step that has ended (the open step ends at close()).
  [[nodiscard]] std::uint64_t ended_serial() const noexcept { return open_ ? serial_ - 1 : serial_; }
  /// @brief The open step's record, or nullptr when no step is open.
  [[nodiscard]] const step_record<Index>* open_step() const noexcept { return open_ ? &record_ : nullptr; }
  /// @brief Positions of request `h` up to `committed_through` were committed while a step is open
  /// (drafts of an earlier step accepted or filed, a prefix bound): readers count them at once,
  /// though the open step's own rows wait for it to be filed (its runs keep the T readers see,
  /// step_run::recorded_before).
  void count_committed_rows(std::uint32_t h, std::int64_t committed_through) noexcept
  {
    if (!open_) { return; }
    for (auto& run : record_.runs) {
      if (run.handle == h) { run.recorded_before = std::max(run.recorded_before, committed_through); }
    }
  }
  /// @brief Whether the open step schedules request state `r`.
  [[nodiscard]] bool schedules(const request_state& r) const noexcept { return open_ && r.open_step == serial_; }

  /// @brief Checks `plan` against the live requests and `filer`'s store. Changes nothing observable
  /// if it throws; if it returns, open() or abandon() must follow (Filer::plans_fresh_runs: the
  /// common runs are claimed already, for the step open() will open).
  /// @throws error invalid_state, too_many_tokens, unknown_request, duplicate_request,
  /// position_out_of_range, slot_out_of_range, invalid_plan, host_memory_exhausted
  template <class Filer>
  void validate(const step_plan& plan, request_registry& requests, Filer& filer)
  {
    if (open_) {
      throw error{errc::invalid_state,
                  "begin_step: step " + std::to_string(serial_) + " is still open; call end_step first"};
    }
    if (plan.num_rows() > max_rows_) {
      throw error{errc::too_many_tokens, "step plan has " + std::to_string(plan.num_rows()) +
                                           " tokens, more than max_tokens_per_step " + std::to_string(max_rows_)};
    }
    if (plan.padded_rows() > max_rows_) {  // the end of the step resets them: they must lie in D
      throw error{errc::too_many_tokens, "step plan declares " + std::to_string(plan.padded_rows()) +
                                           " padded rows, more than max_tokens_per_step " + std::to_string(max_rows_)};
    }
    auto& store = filer.store();
    ++attempt_;
    store.begin_validation();
    // Filer::plans_fresh_runs: every run goes into the record in this pass, and the common ones
    // with their pieces, claimed; the record is free (no step is open) and nothing reads it before
    // open()
    if constexpr (Filer::plans_fresh_runs) {
      record_.runs.clear();
      record_.ops.clear();
      unplanned_.clear();
      claimed_.clear();
      record_.runs.reserve(plan.entries().size());
      claimed_.reserve(plan.entries().size());
      // a plan with a negative token count (refused below) may sum to fewer than 0 rows
      filer.reserve_pieces(record_, std::max(plan.num_rows(), std::int64_t{0}));
      filer.start_fresh_claims(plan.entries().size());
    }
    try {
      check_runs(plan, requests, filer);
    } catch (...) {
      if constexpr (Filer::plans_fresh_runs) { undo_fresh_claims(requests, filer); }
      throw;
    }
  }

  /// @brief Gives up the plan validate() just accepted, which will not open (something between the
  /// two failed): the runs validate() claimed go back. Nothing else had changed.
  template <class Filer>
  void abandon(request_registry& requests, Filer& filer) noexcept
  {
    if constexpr (Filer::plans_fresh_runs) { undo_fresh_claims(requests, filer); }
  }

 private:
  // validate()'s checks of the plan's runs (the common ones claimed, Filer::plans_fresh_runs) and
  // of the storage they need; throws at the first refusal, leaving the claims to validate().
  template <class Filer>
  void check_runs(const step_plan& plan, request_registry& requests, Filer& filer)
  {
    auto& store = filer.store();
    // the loop keeps what it reads and accumulates in locals: the compiler cannot keep members in
    // registers across the stores into request states and the record (they might alias)
    std::size_t growth           = 0;
    std::size_t tokens           = 0;
    bool has_drafts              = false;
    const std::uint64_t attempt  = attempt_;
    const std::uint64_t previous = serial_;
    const std::uint64_t serial   = previous + 1;  // the step open() will open
    const std::int64_t max_len   = max_model_len_;
    // every run's handle, written by index where open() needs them (the planned runs carry theirs)
    if constexpr (!Filer::plans_fresh_runs) { handles_.resize(plan.entries().size()); }
    std::uint32_t* next_handle = handles_.data();
    const auto* const end      = plan.entries().data() + plan.entries().size();
    for (const auto& entry : plan.entries()) {
      const scheduled_request& s = entry.request;
      if (end - &entry > prefetch_distance) { prefetch((&entry)[prefetch_distance].request, requests, store); }
      if (s.num_tokens < 0) { throw_negative_tokens(s); }
      if (entry.skipped) { continue; }
      const std::uint32_t h = requests.find(s.id);
      auto& r               = requests[h];
      // messages name the request by its id, also when the plan names it by handle
      if (r.planned_attempt == attempt) { throw_duplicate(*r.id); }
      r.planned_attempt = attempt;
      if (!request_fits(s, max_len)) { throw_request_outside(s, *r.id); }
      if constexpr (Filer::store_type::slot_indexed) {
        try {
          store.check_slots(s.slots, s.num_tokens);
        } catch (const error& e) {
          throw error{e.code(), "request " + r.id->to_string() + ": " + e.what()};
        }
      }
      tokens += static_cast<std::size_t>(s.num_tokens);
      has_drafts = has_drafts || s.num_draft_tokens > 0;
      if constexpr (Filer::plans_fresh_runs) {
        // a run claimed here lies in storage it already has: it does not grow; its request is
        // marked scheduled here too. An undo puts back its step serials: those of a request the
        // previous step scheduled (every decoding request) are that step's, others are kept.
        const std::uint64_t open_step  = r.open_step;
        const std::uint64_t reads_step = r.reads_step;
        if (filer.claim_fresh_provisionally(record_, h, r, s, entry.first_row, serial)) {
          if (((open_step ^ previous) | (reads_step ^ previous)) != 0) {  // one test for both
            claimed_.push_back({static_cast<std::uint32_t>(record_.runs.size() - 1), open_step, reads_step});  // room was made
          }
          r.open_step  = serial;
          r.reads_step = serial;
          continue;
        }
        unplanned_.push_back(static_cast<std::uint32_t>(record_.runs.size()));  // claimed when the step opens
        record_.runs.push_back({h, r.generation, entry.first_row, s.first_position, s.num_tokens, s.num_draft_tokens, -1});
      } else {
        *next_handle++ = h;
      }
      growth += store.growth_bytes(h, s.first_position + s.num_tokens, false);
    }
    tokens_     = tokens;
    has_drafts_ = has_drafts;
    if constexpr (!Filer::plans_fresh_runs) { handles_.resize(static_cast<std::size_t>(next_handle - handles_.data())); }
    grows_ = growth > 0;  // a run that needs to grow exactly also needs to grow by doubling
    store.check_blocks(plan.fresh_blocks(), "fresh");
    // doubling every request that grows would cross the limit: grow each exactly, if that fits
    exact_growth_ = store.bytes_in_use() + growth > store.limit();
    if (!exact_growth_) { return; }
    std::size_t exact_growth = 0;  // rarely needed: a second pass
    if constexpr (Filer::plans_fresh_runs) {
      for (const std::uint32_t i : unplanned_) {  // the runs claimed already do not grow
        const step_run& run = record_.runs[i];
        exact_growth += store.growth_bytes(run.handle, run.first_position + run.num_tokens, true);
      }
    } else {
      std::size_t i = 0;
      for (const auto& entry : plan.entries()) {
        if (entry.skipped) { continue; }
        exact_growth += store.growth_bytes(handles_[i++], entry.request.first_position + entry.request.num_tokens, true);
      }
    }
    if (store.bytes_in_use() + exact_growth > store.limit()) {
      throw error{errc::host_memory_exhausted,
                  "step needs " + std::to_string(exact_growth) + " more bytes of host storage; " +
                    std::to_string(store.bytes_in_use()) + " bytes are in use of host_memory_limit " +
                    std::to_string(store.limit()) + " (release finished requests, or raise the limit)"};
    }
  }

 protected:
  /// @brief Gives back what validate() claimed (Filer::plans_fresh_runs), newest first: the runs
  /// of the record but those left to open().
  template <class Filer>
  void undo_fresh_claims(request_registry& requests, Filer& filer) noexcept
  {
    const std::uint64_t serial     = serial_ + 1;
    const std::uint32_t* unplanned = unplanned_.data() + unplanned_.size();
    for (auto i = static_cast<std::uint32_t>(record_.runs.size()); i-- > 0;) {
      if (unplanned != unplanned_.data() && unplanned[-1] == i) {
        --unplanned;
        continue;
      }
      const step_run& run = record_.runs[i];
      auto& r             = requests[run.handle];
      if (!claimed_.empty() && claimed_.back().run == i) {
        r.open_step  = claimed_.back().open_step;
        r.reads_step = claimed_.back().reads_step;
        claimed_.pop_back();
      } else {  // scheduled by the previous step: validate() kept nothing
        r.open_step  = serial_;
        r.reads_step = serial_;
      }
      filer.undo_fresh_claim(run, r, serial);
    }
    record_.runs.clear();  // a second undo finds nothing
    unplanned_.clear();
  }

 private:
  // Whether the positions and drafts of `s` (num_tokens >= 0) are valid for a model of
  // `max_model_len` positions: the common case, inline;
  // throw_request_outside() says what is wrong otherwise.
  [[nodiscard]] static bool request_fits(const scheduled_request& s, std::int64_t max_model_len) noexcept
  {
    // num_tokens >= 0 here: the subtraction cannot overflow, where first_position + num_tokens can
    return s.first_position >= 0 && s.first_position <= max_model_len - s.num_tokens &&
           (s.num_draft_tokens == 0 ||  // most runs: one test for the three below
            (s.num_draft_tokens > 0 && s.num_draft_tokens <= s.num_tokens && s.num_draft_tokens <= max_draft_tokens));
  }

  // The error of a request that request_fits() refused: positions first, then drafts.
  [[noreturn, gnu::cold, gnu::noinline]] void throw_request_outside(const scheduled_request& s, const request_id& id) const
  {
    if (s.first_position < 0 || s.first_position > max_model_len_ - s.num_tokens) {
      const std::int64_t end = s.first_position > std::numeric_limits<std::int64_t>::max() - s.num_tokens
                                 ? std::numeric_limits<std::int64_t>::max()
                                 : s.first_position + s.num_tokens;
      throw error{errc::position_out_of_range,
                  "request " + id.to_string() + ": positions [" + std::to_string(s.first_position) + ", " +
                    std::to_string(end) + ") are outside [0, max_model_len = " + std::to_string(max_model_len_) +
                    ")"};
    }
    throw error{errc::invalid_plan, "request " + id.to_string() + ": " + std::to_string(s.num_draft_tokens) +
                                      " draft tokens among " + std::to_string(s.num_tokens) + " (at most " +
                                      std::to_string(max_draft_tokens) + ")"};
  }

  // validate()'s other refusals, out of line (with the message building) so that its per-run loop
  // stays small.
  [[noreturn, gnu::cold, gnu::noinline]] static void throw_negative_tokens(const scheduled_request& s)
  {
    throw error{errc::invalid_plan, "step plan: negative token count " + std::to_string(s.num_tokens)};
  }

  [[noreturn, gnu::cold, gnu::noinline]] static void throw_duplicate(const request_id& id)
  {
    throw error{errc::duplicate_request, "step plan schedules request " + id.to_string() + " twice"};
  }

  // How many runs ahead validate() asks for what it will touch: enough to cover a miss to memory
  // at the few hundred cycles a run takes to check.
  static constexpr std::ptrdiff_t prefetch_distance = 8;

  // Asks the processor for the lines checking and planning `s` will touch first: its request's
  // state and its entry in the store (or, slot-indexed, its first slot's). Only for a request named
  // by its handle: finding an id's would cost the hashing a prefetch is meant to hide. Every
  // function on the way to __builtin_prefetch is always_inline: GCC 12 otherwise found them free
  // of side effects (ipa-pure-const) and deleted their calls before inlining them, leaving no
  // prefetch in the binary.
  template <class Store>
  [[gnu::always_inline]] static void prefetch(const scheduled_request& s, const request_registry& requests, const Store& store) noexcept
  {
    const std::uint32_t h = s.id.is_handle() ? s.id.handle().index : ~std::uint32_t{0};
    requests.prefetch(h);
    store.prefetch(h, s.slots);
  }

 protected:
  // the step being planned, which step_planner commits
  std::int64_t max_rows_;       ///< max_tokens_per_step
  std::int64_t max_model_len_;  ///< max_model_len
  std::uint64_t serial_  = 0;  ///< serial of the latest step opened
  std::uint64_t attempt_ = 0;  ///< validation passes, to spot a request scheduled twice in a plan
  bool exact_growth_     = false;  ///< the validated plan's runs grow exactly: doubling would cross the limit
  bool grows_            = false;  ///< some run of the validated plan needs more storage
  bool has_drafts_       = false;  ///< some run of the validated plan has draft tokens
  std::size_t tokens_    = 0;      ///< tokens of the validated plan's runs
  bool open_             = false;  ///< a step is open
  std::vector<std::uint32_t> handles_;  ///< the plan's runs' handles, found once by validate()
  std::vector<char> grew_;              ///< per run of the plan being opened: its storage grew
  std::vector<std::uint32_t> unplanned_;  ///< Filer::plans_fresh_runs: runs validate() left to open()
  /// @brief Filer::plans_fresh_runs: a run validate() claimed for a request the previous step did
  /// not schedule, and its step serials before.
  struct claimed_run {
    std::uint32_t run;         ///< index in record_.runs
    std::uint64_t open_step;   ///< the request's open_step before
    std::uint64_t reads_step;  ///< the request's reads_step before
  };
  std::vector<claimed_run> claimed_;  ///< in batch order, for undo_fresh_claims()
  step_record<Index> record_;           ///< the open step's record
};

}  // namespace routing_replay
