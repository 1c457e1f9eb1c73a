/// @file
/// Data path, part 5, its first half: the row claimer. Owns the host storage and decides where each
/// row of a step goes (claims: first write wins, rows follow their position, tentative drafts),
/// and, where rows are claimed as their step is planned, records each claimed range as a piece of
/// the step. The row filer (data_path/row_filer.hpp) derives from it and files the rows that
/// arrived, discards the steps that failed and resolves drafts.
#pragma once

#include <routing_replay/config.hpp>
#include <routing_replay/copy_strategy.hpp>
#include <routing_replay/data_path/request_registry.hpp>
#include <routing_replay/data_path/step_record.hpp>
#include <routing_replay/detail/data_path/emplace_aggregate.hpp>
#include <routing_replay/detail/row_claim.hpp>
#include <routing_replay/detail/scatter_op.hpp>
#include <routing_replay/index_type.hpp>
#include <routing_replay/step_plan.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace routing_replay {

/// @brief Claims the rows of steps in a host store (`Store`, from a host_storage policy) for rows
/// that `Site` places: the host copies them from a staging, or a kernel writes them in place.
///
/// Where rows are claimed: slot-indexed stores claim a step's rows when it begins (the step
/// planner calls claim_planned()), because which generation a slot belongs to and whether a row
/// follows its position depend on the blocks as planned; so does a device scatter, whose kernel
/// needs every row's place before it runs. Filing then only moves data. Otherwise per-request rows,
/// which depend on nothing but their own request's earlier steps, are claimed when filed.
template <expert_index Index, class Store, scatter_site Site>
class row_claimer {
 public:
  /// @brief The host store.
  using store_type = Store;
  /// @brief Whether rows are claimed when their step begins (else when it is filed).
  static constexpr bool claims_when_planned = Store::slot_indexed || Site == scatter_site::device;

  /// @brief Creates the store for a validated configuration, for rows of `row_elems` ids.
  row_claimer(const replay_config& config, std::int64_t row_elems)
    : row_elems_(row_elems), overwrite_(config.overwrite_recomputed_rows), store_(config, row_elems_)
  {
  }

  /// @brief The host store.
  [[nodiscard]] Store& store() noexcept { return store_; }
  /// @brief The host store.
  [[nodiscard]] const Store& store() const noexcept { return store_; }
  /// @brief Ids per row (L * K).
  [[nodiscard]] std::int64_t row_elems() const noexcept { return row_elems_; }

  /// @brief Claims the rows of one scheduled request of `step` and hands each claimed range to
  /// `place(claim, first_row, rows)`: `rows` consecutive rows of the step go to consecutive rows at
  /// `claim.dst`. A row goes where the store says (first write wins unless rows of recomputed
  /// positions overwrite); a tentative draft row yields to any later write of its position; rows of
  /// drafts already rejected are skipped. `taken` (claims when planned) collects the draft rows
  /// taken over, for a discard to give back.
  template <class Place>
  void claim_run(const step_run& run, request_state& r, const step_record<Index>& step, Place&& place,
                 std::vector<taken_draft>* taken_drafts = nullptr)
  {
    if constexpr (!claims_when_planned) {
      // accepted groups kept for steps that ended before their acceptance: none is left to file
      if (!r.drafts.empty()) {
        std::erase_if(r.drafts, [&](const draft_group& g) {
          return g.filed && g.accepted >= 0 && g.accepted_through < step.serial;
        });
      }
    }
    if constexpr (!Store::slot_indexed) {
      // New positions of a request with no draft pending (every decode step and prefill chunk):
      // one claim and one placement for the run, not one per row. Anything else (a recomputed
      // position, drafts) takes the row-by-row path.
      if (Index* dst = claim_fresh_run(run, r, step.serial)) {
        place(detail::row_claim<Index>{dst, nullptr, detail::row_claim<Index>::no_claim}, run.first_row,
              std::int64_t{run.num_tokens});
        return;
      }
    }
    claim_rows(run, r, step, place, taken_drafts);
  }

  /// @brief Claims the rows of `run`, the run of request `r` just added to the step being planned
  /// (claims_when_planned), recording the request's T before and after, and the step's pieces:
  /// where each range of claimed rows goes (at addresses kernels reach, for a device scatter) and
  /// where it comes from. Slot-indexed: `slots` are the run's KV slots (the plan's, checked), and
  /// the step's slots from run.slots_begin (sized, unwritten) are written here.
  void claim_planned(step_record<Index>& step, step_run& run, request_state& r,
                     std::span<const std::int64_t> slots = {})
  {
    run.recorded_before = r.recorded_rows;
    if constexpr (Store::slot_indexed) {
      if (run.num_draft == 0 && r.drafts.empty()) {  // every decode step and prefill chunk
        claim_slot_run(step, run, r, slots);
        run.recorded_after = r.recorded_rows;
        return;
      }
      const auto at = static_cast<std::size_t>(run.slots_begin);
      for (std::size_t i = 0; i < slots.size(); ++i) { step.slots[at + i] = static_cast<std::int32_t>(slots[i]); }
    }
    if (!claim_fresh_planned(step, run, r)) {
      claim_rows(
        run, r, step,
        [&](detail::row_claim<Index> c, std::int64_t row, std::int64_t rows) { add_pieces(step, run, c, row, rows); },
        &step.taken);
    }
    run.recorded_after = r.recorded_rows;
  }

  /// @brief Whether this filer claims the common run while the planner validates the step
  /// (claim_fresh_provisionally()): per-request rows claimed when their step begins.
  static constexpr bool plans_fresh_runs = claims_when_planned && !Store::slot_indexed;

  /// @brief Claims made from now on by claim_fresh_provisionally() are provisional, until the next
  /// call: room for `runs` of them.
  void start_fresh_claims(std::size_t runs)
    requires(plans_fresh_runs)
  {
    store_.start_provisional_claims(runs);
  }

  /// @brief claim_planned() of the common run (one or more new positions, no draft pending or planned, in the
  /// request's last segment: every decode step and prefill chunk of a request that does not grow)
  /// for step `serial`, provisionally: appends the run, with the request's T before and after it,
  /// and its pieces to `step`, and claims its rows in the request's store entry. False, and nothing
  /// changed, for any other run (claim_planned() takes it). undo_fresh_claim() gives it back.
  /// Always inlined, as per_request_store::claim_in_tail().
  [[gnu::always_inline]] bool claim_fresh_provisionally(step_record<Index>& step,
                                                        std::uint32_t h,
                                                        request_state& r,
                                                        const scheduled_request& s,
                                                        std::int64_t first_row,
                                                        std::uint64_t serial)
    requires(plans_fresh_runs)
  {
    // a run without tokens goes the long way too: it still reserves storage up to its position
    if (s.num_draft_tokens != 0 || s.num_tokens == 0 || !r.drafts.empty()) { return false; }
    Index* const dst = store_.claim_in_tail(h, s.first_position, s.num_tokens, serial);
    if (dst == nullptr) { return false; }
    // built where it lives (detail::emplace_aggregate), each field written once: emplace_back()
    // then assignments zeroed every field before writing it (callgrind: 9 instructions, 7 of them
    // stores, a run)
    const std::int64_t recorded_before = r.recorded_rows;
    const std::int64_t recorded_after  = std::max(recorded_before, s.first_position + s.num_tokens);
    detail::emplace_aggregate(step.runs, h, r.generation, first_row, s.first_position, s.num_tokens, std::int32_t{0},
                              std::int64_t{-1}, recorded_before, recorded_after);  // room was made
    r.recorded_rows = recorded_after;
    // one piece, on its own: the next run's rows go to another request's range, which it does not
    // continue in practice (add_piece() would look)
    const std::int64_t elems = std::int64_t{s.num_tokens} * row_elems_;
    if (elems > detail::max_piece_elems) {
      add_cut_piece(step.ops, {dst, nullptr, first_row * row_elems_, elems, false});
      return true;
    }
    detail::emplace_aggregate(step.ops, dst, static_cast<const Index*>(nullptr), first_row * row_elems_, elems, false);
    return true;
  }

  /// @brief Gives back the claim of `run` for step `serial`, the newest of
  /// claim_fresh_provisionally() not given back since start_fresh_claims(): its request `r` and
  /// its store entry are as before.
  void undo_fresh_claim(const step_run& run, request_state& r, std::uint64_t serial) noexcept
    requires(plans_fresh_runs)
  {
    r.recorded_rows = run.recorded_before;
    store_.undo_claim_in_tail(run.handle, run.first_position, serial);
  }

  /// @brief Room in `step`'s pieces for a step of `num_rows` rows (claim_planned() then never
  /// allocates): a row starts at most one piece and is cut at most once more.
  void reserve_pieces(step_record<Index>& step, std::int64_t num_rows) const
  {
    step.ops.reserve(static_cast<std::size_t>(2 * num_rows + num_rows * row_elems_ / detail::max_piece_elems + 1));
  }

 private:
  // Per-request rows: claims the run's positions in one range if it is the common run (new
  // positions, no draft pending: every decode step and prefill chunk) and none of them holds a
  // claim, and returns the host address of its first row (T moves past the run); nullptr, and
  // nothing changed, otherwise.
  Index* claim_fresh_run(const step_run& run, request_state& r, std::uint64_t serial) noexcept
    requires(!Store::slot_indexed)
  {
    if (run.num_draft != 0 || run.num_tokens <= 0 || !r.drafts.empty()) { return nullptr; }
    Index* const dst = store_.claim_fresh(run.handle, run.first_position, run.num_tokens, serial);
    if (dst != nullptr) { r.recorded_rows = std::max(r.recorded_rows, run.first_position + run.num_tokens); }
    return dst;
  }

  // claim_planned() of the common run, in one place (no placement callback): claim_fresh_run(), then the
  // run's pieces, the step's rows from its first on. False, and nothing changed, for any other run.
  bool claim_fresh_planned(step_record<Index>& step, const step_run& run, request_state& r) noexcept
  {
    if constexpr (Store::slot_indexed) {
      return false;
    } else {
      Index* const dst = claim_fresh_run(run, r, step.serial);
      if (dst == nullptr) { return false; }
      std::int64_t src = run.first_row * row_elems_;
      store_.device_pieces(run.handle, dst, std::int64_t{run.num_tokens} * row_elems_,
                           [&](Index* piece, std::int64_t elems) {
                             add_piece(step.ops, {piece, nullptr, src, elems, false});
                             src += elems;
                           });
      return true;
    }
  }

  // claim_planned() of a slot-indexed run without drafts (none planned, none pending) at `slots`:
  // claim_rows() without the draft bookkeeping, the step's slots written in the same pass, and the
  // rows that go to consecutive slots placed as one range (the store gathers them as it claims: a
  // prefill chunk's slots run through whole KV blocks), where claim_rows() places every row on its
  // own. Rows a claim copies or replaces are placed on their own, as there.
  void claim_slot_run(step_record<Index>& step, const step_run& run, request_state& r,
                      std::span<const std::int64_t> slots)
    requires(Store::slot_indexed)
  {
    store_.claim_run(run.handle, run.first_position, slots, step.slots.data() + run.slots_begin, step.serial, overwrite_,
                     [&](std::size_t i, const detail::row_claim<Index>& c, std::int64_t rows) {
                       add_pieces(step, run, c, run.first_row + static_cast<std::int64_t>(i), rows);
                     });
    if (run.num_tokens > 0) { r.recorded_rows = std::max(r.recorded_rows, run.first_position + run.num_tokens); }
  }

  // claim_planned()'s placement of `rows` rows of the step from `row` on, claimed as `c`, for a run
  // of claim_rows(): a re-claimed row is recorded for a discard to give back.
  void add_pieces(step_record<Index>& step, const step_run& run, detail::row_claim<Index> c, std::int64_t row,
                  std::int64_t rows)
  {
    const bool replaces = c.replaced != detail::row_claim<Index>::no_claim;  // single rows only
    if (replaces) {
      const std::int64_t i    = row - run.first_row;
      const std::int64_t slot = run.slots_begin >= 0 ? step.slots[static_cast<std::size_t>(run.slots_begin + i)] : -1;
      step.replaced.push_back({run.handle, run.first_position + i, slot, c.replaced});  // reserved
    }
    std::int64_t src = row * row_elems_;
    store_.device_pieces(run.handle, c.dst, rows * row_elems_, [&](Index* dst, std::int64_t elems) {
      add_piece(step.ops, {dst, c.copy_from, src, elems, replaces});
      src += elems;
      if (c.copy_from != nullptr) { c.copy_from += elems; }
    });
  }

  // claim_run() row by row: any run but the common one (recomputed positions, drafts, slots).
  template <class Place>
  void claim_rows(const step_run& run, request_state& r, const step_record<Index>& step, Place&& place,
                  std::vector<taken_draft>* taken_drafts)
  {
    draft_group* group = nullptr;
    if (run.num_draft > 0) {
      for (auto& g : r.drafts) {
        if (g.step_serial == step.serial) { group = &g; }
      }
    }
    const std::int32_t committed = run.num_tokens - run.num_draft;
    for (std::int32_t i = 0; i < run.num_tokens; ++i) {
      const std::int64_t position = run.first_position + i;
      const auto at               = static_cast<std::size_t>(run.slots_begin + i);
      const std::int64_t slot     = run.slots_begin >= 0 ? step.slots[at] : -1;
      // slot-indexed rows are claimed as their step is planned: their blocks are as planned
      const std::uint32_t planned = slot >= 0 ? store_.generation_of(slot) : 0u;
      const std::int32_t d        = i - committed;
      const bool draft            = d >= 0 && group != nullptr;
      if (draft && group->accepted >= 0 && d >= group->accepted) { continue; }  // already rejected
      const bool tentative = draft && group->accepted < 0;
      // a draft row stays open to a take-over by every step that ended before its group's acceptance
      const bool takeable = draft && (group->accepted < 0 || group->accepted_through > step.serial);
      const bool taken    = take_over_draft(r, run.handle, position, step.serial, taken_drafts);  // always: ownership must move
      const auto c        = store_.claim(run.handle, position, slot, planned, step.serial, taken || overwrite_);
      if (c.dst != nullptr) {
        place(c, run.first_row + i, std::int64_t{1});
        // a tentative row owns its slot only if it is its own (not an earlier row that followed)
        if (takeable && c.copy_from == nullptr) { group->owned |= 1u << d; }
      }
      if (!tentative) { r.recorded_rows = std::max(r.recorded_rows, position + 1); }
    }
    if (group != nullptr) {
      group->filed = true;
      // accepted before its rows arrived: nothing left to resolve, unless steps that ended before
      // the acceptance are still to be filed (rows claimed when filed)
      if (group->accepted >= 0 && group->accepted_through <= step.serial) {
        r.drafts.erase(r.drafts.begin() + (group - r.drafts.data()));
      }
    }
  }

  // Appends a piece to a step's pieces: it extends the last one if it continues it (a run of rows
  // to consecutive places), and no piece grows past max_piece_elems. Inline: every run of a step
  // adds one (room was reserved); a piece to cut takes add_cut_piece().
  static void add_piece(typename step_record<Index>::op_list& ops, const detail::scatter_op<Index>& op)
  {
    if (!ops.empty() && continues(ops.back(), op)) {
      ops.back().elems += op.elems;
      return;
    }
    if (op.elems > detail::max_piece_elems) {
      add_cut_piece(ops, op);
      return;
    }
    ops.push_back(op);
  }

  // Whether `op` continues `last`: the next ids of the same kind of piece, and the two fit in one.
  static bool continues(const detail::scatter_op<Index>& last, const detail::scatter_op<Index>& op) noexcept
  {
    return last.dst + last.elems == op.dst && last.elems + op.elems <= detail::max_piece_elems &&
           last.replaces == op.replaces &&
           (op.copy_from == nullptr ? last.copy_from == nullptr && last.src + last.elems == op.src
                                    : last.copy_from != nullptr && last.copy_from + last.elems == op.copy_from);
  }

  // add_piece() of a piece larger than max_piece_elems: cut into pieces of at most that.
  [[gnu::noinline]] static void add_cut_piece(typename step_record<Index>::op_list& ops, detail::scatter_op<Index> op)
  {
    while (op.elems > detail::max_piece_elems) {
      ops.push_back({op.dst, op.copy_from, op.src, detail::max_piece_elems, op.replaces});
      op.dst += detail::max_piece_elems;
      op.src += detail::max_piece_elems;
      if (op.copy_from != nullptr) { op.copy_from += detail::max_piece_elems; }
      op.elems -= detail::max_piece_elems;
    }
    ops.push_back(op);
  }

  // A tentative draft row yields to any later write of its position, by step `serial` (recorded in
  // `taken`, whose room was reserved, when given); so does an accepted one to a step that ended
  // before the acceptance (rows claimed when filed).
  static bool take_over_draft(request_state& r, std::uint32_t h, std::int64_t position, std::uint64_t serial,
                              std::vector<taken_draft>* taken_drafts) noexcept
  {
    bool taken = false;
    for (auto& g : r.drafts) {
      if (g.filed && (g.accepted < 0 || serial <= g.accepted_through) && g.owns(position)) {
        g.owned &= ~(1u << (position - g.first_position));
        taken = true;
        if (taken_drafts != nullptr) { taken_drafts->push_back({h, g.step_serial, position}); }
      }
    }
    return taken;
  }

 protected:
  // the row filer, which derives from this class, files through the store too
  std::int64_t row_elems_;  ///< ids per row (L * K)
  bool overwrite_;          ///< replay_config::overwrite_recomputed_rows
  Store store_;             ///< the host store
};

}  // namespace routing_replay
