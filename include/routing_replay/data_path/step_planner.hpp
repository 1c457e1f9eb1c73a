/// @file
/// Data path, part 2: the step planner. Checks an engine's step_plan against the live requests and
/// the host storage, then turns it into the step's record: which rows belong to which request and
/// position, their KV slots, the draft tokens, and (where rows are claimed when a step begins)
/// every row's place. Pure host logic: no backend, no device. This file holds the second of the two
/// phases a step is planned in, committing a plan; the checks that come first, and the state of the
/// step being planned, are the step validator's (data_path/step_validator.hpp).
#pragma once

#include <routing_replay/config.hpp>
#include <routing_replay/data_path/request_registry.hpp>
#include <routing_replay/data_path/step_record.hpp>
#include <routing_replay/data_path/step_validator.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/step_plan.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory_resource>
#include <span>

namespace routing_replay {

/// @brief Validates plans and builds step records; knows whether a step is open and the serial of
/// the latest one.
///
/// A step is planned in two phases so that every host error surfaces before anything changes:
/// validate() checks the whole plan (it throws, and the object is as before), open() commits it
/// (reserving storage, taking fresh blocks, claiming rows where the store claims at plan time).
/// Where the filer claims the common run while the plan is validated (Filer::plans_fresh_runs),
/// validate() claims those runs as it checks them, one pass over the plan, and gives the claims back
/// if it refuses the plan; a plan it accepted is opened with open() or given up with abandon().
/// close() hands the record to the copy pipeline.
/// The first phase, and the state of the step being planned, are step_validator's, which this
/// class derives from.
template <class Index>
class step_planner : public step_validator<Index> {
  using validator = step_validator<Index>;
  using validator::exact_growth_;
  using validator::grew_;
  using validator::grows_;
  using validator::handles_;
  using validator::has_drafts_;
  using validator::open_;
  using validator::record_;
  using validator::serial_;
  using validator::tokens_;
  using validator::undo_fresh_claims;
  using validator::unplanned_;

 public:
  /// @brief A planner for a validated configuration; its records' op lists come from
  /// `ops_memory` (pinned memory with device scatter: copy_pipeline::ops_memory()).
  explicit step_planner(const replay_config& config,
                        std::pmr::memory_resource* ops_memory = std::pmr::new_delete_resource())
    : validator(config, ops_memory)
  {
  }

  /// @brief Commits the plan validate() just accepted: a new serial, storage reserved, fresh blocks
  /// taken (later plans and prefix hits see their new generation even while older rows for them
  /// are in flight), draft groups opened, and, where the store claims at plan time, every row
  /// claimed and its place recorded in the step's ops. Every allocation comes first: if one fails,
  /// storage grown for the step is given back and nothing observable has changed.
  template <class Filer>
  void open(const step_plan& plan, request_registry& requests, Filer& filer)
  {
    if constexpr (Filer::plans_fresh_runs) {
      open_planned(plan, requests, filer);
      return;
    }
    auto& store             = filer.store();
    step_record<Index>& out = record_;
    reserve_record(plan, requests, filer);
    std::size_t grown = 0;  // runs whose storage was reserved: undone if a later one fails
    try {
      // a store whose reserve() only grows rows has nothing to do in a step where none grows (most
      // decode steps): the pass over the plan is skipped
      const bool reserves = grows_ || !Filer::store_type::reserve_only_grows;
      for (const auto& entry : plan.entries()) {
        if (!reserves) { break; }
        if (entry.skipped) { continue; }
        const scheduled_request& s = entry.request;
        grew_[grown] = store.reserve(handles_[grown], s.first_position + s.num_tokens, exact_growth_);
        ++grown;
      }
    } catch (...) {
      while (grown-- > 0) {
        if (grew_[grown]) { store.undo_reserve(handles_[grown]); }
      }
      throw;
    }
    // nothing below allocates or throws
    start_record(plan, false);
    store.refresh_blocks(out.fresh_blocks);
    auto handle = handles_.begin();
    for (const auto& entry : plan.entries()) {
      if (entry.skipped) { continue; }
      const scheduled_request& s = entry.request;
      const std::uint32_t h      = *handle++;
      auto& r                    = requests[h];
      r.open_step                = serial_;
      r.reads_step               = serial_;
      std::int64_t slots_begin   = -1;
      if constexpr (Filer::store_type::slot_indexed) {
        static_assert(Filer::claims_when_planned, "slot-indexed rows are claimed when their step begins");
        // sized here (reserve_record() made room; resizing writes nothing) and written by the
        // run's claims (claim_planned())
        slots_begin = static_cast<std::int64_t>(out.slots.size());
        out.slots.resize(out.slots.size() + s.slots.size());
      }
      out.runs.push_back(
        {h, r.generation, entry.first_row, s.first_position, s.num_tokens, s.num_draft_tokens, slots_begin});
      if (s.num_draft_tokens > 0) {
        r.drafts.push_back(draft_group_of(s.first_position, s.num_tokens, s.num_draft_tokens,
                                          slots_begin >= 0 ? s.slots : std::span<const std::int64_t>{}));
      }
      // in the same pass (a request appears once in a plan: its claims depend on its own run, and
      // on earlier runs' claims of shared slots, never on later runs)
      if constexpr (Filer::claims_when_planned) { filer.claim_planned(out, out.runs.back(), r, s.slots); }
    }
    open_ = true;
  }

  /// @brief open() where validate() put every run in the record and claimed the common ones
  /// (Filer::plans_fresh_runs): the others (growth, a recomputed position, drafts) are claimed here,
  /// the long way. A request's claims depend on its own run alone, so growing one request or
  /// claiming it row by row leaves the pieces planned for the others where they were.
  template <class Filer>
  void open_planned(const step_plan& plan, request_registry& requests, Filer& filer)
  {
    auto& store = filer.store();
    auto& runs  = record_.runs;
    // every allocation first: if one fails, storage grown for the step is given back, and the
    // claims validate() made
    std::size_t grown = 0;
    try {
      record_.fresh_blocks.reserve(plan.fresh_blocks().size());
      if (!unplanned_.empty()) {
        record_.replaced.reserve(tokens_);
        record_.taken.reserve(tokens_);
        grew_.resize(std::max(grew_.size(), unplanned_.size()));
        for (const std::uint32_t i : unplanned_) {
          if (runs[i].num_draft > 0) { requests[runs[i].handle].drafts.reserve(requests[runs[i].handle].drafts.size() + 1); }
        }
      }
      for (; grows_ && grown < unplanned_.size(); ++grown) {
        const step_run& run = runs[unplanned_[grown]];
        grew_[grown]        = store.reserve(run.handle, run.first_position + run.num_tokens, exact_growth_);
      }
    } catch (...) {
      while (grown-- > 0) {
        if (grew_[grown]) { store.undo_reserve(runs[unplanned_[grown]].handle); }
      }
      undo_fresh_claims(requests, filer);
      throw;
    }
    // nothing below allocates or throws
    start_record(plan, true);
    store.refresh_blocks(record_.fresh_blocks);
    for (const std::uint32_t i : unplanned_) {  // in batch order
      step_run& run = runs[i];
      auto& r       = requests[run.handle];
      r.open_step   = serial_;
      r.reads_step  = serial_;
      if (run.num_draft > 0) { r.drafts.push_back(draft_group_of(run.first_position, run.num_tokens, run.num_draft)); }
      filer.claim_planned(record_, run, r);
    }
    open_ = true;
  }

  /// @brief Closes the open step and returns its record, for the copy pipeline to take (it hands
  /// back a used record in exchange, so records are recycled).
  /// @throws error invalid_state if no step is open
  [[nodiscard]] step_record<Index>& close()
  {
    if (!open_) { throw error{errc::invalid_state, "end_step without an open step; call begin_step first"}; }
    open_ = false;
    return record_;
  }

 private:
  // The record of the step being opened: a new serial, the plan's rows and fresh blocks (room was
  // made), every list emptied but the runs and pieces validate() planned (`planned`).
  void start_record(const step_plan& plan, bool planned) noexcept
  {
    step_record<Index>& out = record_;
    out.serial              = ++serial_;
    out.num_rows            = plan.num_rows();
    out.padded_rows         = plan.padded_rows();
    if (!planned) {
      out.runs.clear();
      out.ops.clear();
    }
    out.slots.clear();
    out.replaced.clear();
    out.taken.clear();
    out.fresh_blocks.assign(plan.fresh_blocks().begin(), plan.fresh_blocks().end());
  }

  // Room for everything open() appends, so that past its storage growth it allocates nothing.
  template <class Filer>
  void reserve_record(const step_plan& plan, request_registry& requests, Filer& filer)
  {
    const std::size_t tokens = tokens_;  // validate() counted them
    record_.runs.reserve(handles_.size());
    record_.fresh_blocks.reserve(plan.fresh_blocks().size());
    if constexpr (Filer::store_type::slot_indexed) {
      record_.slots.reserve(tokens);
    }
    if constexpr (Filer::claims_when_planned) {
      filer.reserve_pieces(record_, plan.num_rows());
      record_.replaced.reserve(tokens);
      record_.taken.reserve(tokens);
    }
    grew_.resize(std::max(grew_.size(), handles_.size()));
    if (!has_drafts_) { return; }
    std::size_t i = 0;
    for (const auto& entry : plan.entries()) {
      if (entry.skipped) { continue; }
      auto& drafts = requests[handles_[i++]].drafts;
      if (entry.request.num_draft_tokens > 0) { drafts.reserve(drafts.size() + 1); }
    }
  }

  // The draft group of a run of the step being opened: its trailing `num_draft` of `num_tokens`
  // tokens from `first_position`, with the last `num_draft` of `slots` (block-slot storage).
  [[nodiscard]] draft_group draft_group_of(std::int64_t first_position,
                                           std::int32_t num_tokens,
                                           std::int32_t num_draft,
                                           std::span<const std::int64_t> slots = {}) const
  {
    draft_group g;
    g.step_serial    = serial_;
    g.first_position = first_position + (num_tokens - num_draft);
    g.count          = num_draft;
    if (!slots.empty()) { std::copy(slots.end() - num_draft, slots.end(), g.slots.begin()); }
    return g;
  }
};

}  // namespace routing_replay
