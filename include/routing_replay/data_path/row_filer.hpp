/// @file
/// Data path, part 5: the row filer. Owns the host storage, decides where each row of a step goes
/// (claims: first write wins, rows follow their position, tentative drafts), files the rows that
/// arrived, discards the steps that failed, resolves drafts. Reading rows back out is the row
/// reader's (data_path/row_reader.hpp).
#pragma once

#include <routing_replay/config.hpp>
#include <routing_replay/copy_strategy.hpp>
#include <routing_replay/data_path/request_registry.hpp>
#include <routing_replay/data_path/step_record.hpp>
#include <routing_replay/detail/emplace_aggregate.hpp>
#include <routing_replay/detail/row_claim.hpp>
#include <routing_replay/detail/step_errors.hpp>
#include <routing_replay/detail/step_status.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/index_type.hpp>
#include <routing_replay/layer_map.hpp>
#include <routing_replay/step_plan.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace routing_replay {

/// @brief What accept_draft() resolved: the draft group's step, and one past the last position it
/// committed at once (0 if none, or if that waits for the group's rows to be filed).
struct accepted_drafts {
  std::uint64_t step                = 0;  ///< serial of the step whose drafts these were
  std::int64_t committed_through    = 0;  ///< one past the last position committed now
};

/// @brief Files steps into a host store (`Store`, from a host_storage policy) for rows that
/// `Site` places: the host copies them from a staging, or a kernel already wrote them in place.
///
/// Where rows are claimed: slot-indexed stores claim a step's rows when it begins (the step
/// planner calls claim_planned()), because which generation a slot belongs to and whether a row
/// follows its position depend on the blocks as planned; so does a device scatter, whose kernel
/// needs every row's place before it runs. Filing then only moves data. Otherwise per-request rows,
/// which depend on nothing but their own request's earlier steps, are claimed when filed.
template <expert_index Index, class Store, scatter_site Site>
class row_filer {
  using traits = index_traits<Index>;

 public:
  /// @brief The host store.
  using store_type = Store;
  /// @brief Whether rows are claimed when their step begins (else when it is filed).
  static constexpr bool claims_when_planned = Store::slot_indexed || Site == scatter_site::device;

  /// @brief Creates the store for a validated configuration.
  row_filer(const replay_config& config, const layer_map& layers)
    : layers_(layers),
      num_experts_(config.num_experts),
      top_k_(config.top_k),
      row_elems_(static_cast<std::int64_t>(layers.num_layers()) * config.top_k),
      max_model_len_(config.max_model_len),
      overwrite_(config.overwrite_recomputed_rows),
      store_(config, row_elems_)
  {
  }

  /// @brief The host store.
  [[nodiscard]] Store& store() noexcept { return store_; }
  /// @brief The host store.
  [[nodiscard]] const Store& store() const noexcept { return store_; }
  /// @brief The layer map rows are laid out by.
  [[nodiscard]] const layer_map& layers() const noexcept { return layers_; }
  /// @brief Ids per row (L * K).
  [[nodiscard]] std::int64_t row_elems() const noexcept { return row_elems_; }

  /// @brief The copy pipeline's step_sink that files its steps here, over the live `requests`.
  template <class Backend>
  struct pipeline_sink {
    row_filer& filer;            ///< where steps are filed
    request_registry& requests;  ///< the live requests
    /// @brief A step's rows and status arrived in its ring slot.
    template <class Slot>
    void file(Slot& slot)
    {
      const Index* staging = Site == scatter_site::host ? Backend::data(slot.staging) : nullptr;
      filer.file(slot.step, *Backend::data(slot.status), staging, requests);
    }
    /// @brief A step's rows never arrive.
    void discard(const step_record<Index>& step) { filer.discard(step, requests); }
    /// @brief A step left the ring.
    void retired(const step_record<Index>& step) noexcept { filer.retired(step); }
  };

  /// @brief The copy pipeline's sink for steps filed here.
  template <class Backend>
  [[nodiscard]] pipeline_sink<Backend> sink(request_registry& requests) noexcept
  {
    return {*this, requests};
  }

  // --- requests -----------------------------------------------------------------------------------

  /// @brief Checks a prefix-cache hit's slots before anything changes.
  /// @throws error position_out_of_range, slot_out_of_range
  void check_cached_prefix(request_key id, std::span<const std::int64_t> cached_slots) const
  {
    if (static_cast<std::int64_t>(cached_slots.size()) > max_model_len_) {
      throw error{errc::position_out_of_range, "request " + id.to_string() + ": " +
                                                 std::to_string(cached_slots.size()) +
                                                 " cached positions exceed max_model_len " +
                                                 std::to_string(max_model_len_)};
    }
    try {
      store_.check_slot_range(cached_slots);
    } catch (const error& e) {
      throw error{e.code(), "request " + id.to_string() + ": cached " + e.what()};
    }
  }

  /// @brief Serves positions [0, cached_slots.size()) of request `h` from cached slots (checked).
  /// Their rows may still be on their way from any step planned so far, up to `latest_step`.
  void bind_cached_prefix(std::uint32_t h,
                          std::span<const std::int64_t> cached_slots,
                          request_registry& requests,
                          std::uint64_t latest_step)
  {
    const auto n = static_cast<std::int64_t>(cached_slots.size());
    store_.bind_cached(h, cached_slots);
    auto& r         = requests[h];
    r.recorded_rows = std::max(r.recorded_rows, n);
    if (Store::slot_indexed && n > 0) { r.reads_step = latest_step; }
  }

  /// @brief Forgets a request: frees its rows (slot-indexed rows stay for prefix hits) and
  /// retires its handle.
  void close(std::uint32_t h, request_registry& requests)
  {
    store_.close(h);
    requests.remove(h);
  }

  // --- claims ------------------------------------------------------------------------------------

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

  // --- filing ------------------------------------------------------------------------------------

  /// @brief A step's rows and verdict have arrived; the verdict decides whether it is stored at
  /// all. `staging` holds its rows token-major ([N, L, K]) where the host places them; where a
  /// kernel did, the rows are already in place (or replaced by the sentinel if the verdict is bad).
  /// @throws error invalid_expert_id, invalid_argument, missing_routing: the device reported a
  /// problem; the step was discarded as a whole
  void file(const step_record<Index>& step,
            const detail::step_status& status,
            const Index* staging,
            request_registry& requests)
  {
    if (!status.clean()) {
      discard(step, requests);
      throw error{detail::device_problem_code(status),
                  detail::describe_device_problem(status, step, requests, layers_, num_experts_, top_k_)};
    }
    if constexpr (Site == scatter_site::host) {
      const auto row_bytes = static_cast<std::size_t>(row_elems_) * sizeof(Index);
      auto place           = [&](detail::row_claim<Index> c, std::int64_t row, std::int64_t rows) {
        std::memcpy(c.dst, c.copy_from != nullptr ? c.copy_from : staging + row * row_elems_,
                    static_cast<std::size_t>(rows) * row_bytes);
      };
      if constexpr (claims_when_planned) {
        for (const auto& op : step.ops) {
          std::memcpy(op.dst, op.copy_from != nullptr ? op.copy_from : staging + op.src,
                      static_cast<std::size_t>(op.elems) * sizeof(Index));
        }
      } else {
        for (const auto& run : step.runs) {
          auto& r = requests[run.handle];
          if (r.generation == run.generation) { claim_run(run, r, step, place); }  // else: gone
        }
      }
    }
  }

  /// @brief A step whose rows will never be filed. Its draft groups go; rows claimed when it began
  /// are unclaimed and the rows counted are undone, so a recompute of those positions records them
  /// again. Where the host places rows, the claimed rows get the sentinel: a later step may already
  /// be planned to copy one elsewhere (a position following it), and must copy the sentinel. Rows
  /// the step would have replaced (a row already there it re-claimed) stay, claimed as before, and
  /// tentative draft rows it took over go back to their draft groups (design.md 5.3).
  void discard(const step_record<Index>& step, request_registry& requests)
  {
    for (const auto& run : step.runs) {
      auto& r = requests[run.handle];
      if (run.num_draft == 0 || r.generation != run.generation) { continue; }
      std::erase_if(r.drafts, [&](const draft_group& g) { return g.step_serial == step.serial; });
    }
    if constexpr (claims_when_planned) {
      if constexpr (Site == scatter_site::host) {
        for (const auto& op : step.ops) {
          if (!op.replaces) { std::fill_n(op.dst, op.elems, traits::sentinel); }
        }
      }
      for (const auto& run : step.runs) {
        auto& r = requests[run.handle];
        if (r.generation == run.generation && r.recorded_rows == run.recorded_after) {
          r.recorded_rows = run.recorded_before;
        }
      }
      give_back_drafts(step, requests);
      for (const auto& c : step.replaced) {
        if (keeps_row(step, c, requests)) { store_.restore_claim(c.handle, c.position, c.slot, step.serial, c.prior); }
      }
      for (const auto& run : step.runs) {
        for (std::int32_t i = 0; i < run.num_tokens; ++i) {
          const std::int64_t slot = run.slots_begin >= 0 ? step.slots[static_cast<std::size_t>(run.slots_begin + i)] : -1;
          store_.unclaim(run.handle, run.first_position + i, slot, step.serial);
        }
      }
    }
  }

  /// @brief A step left the copy pipeline, oldest first: rows claimed when it began are readable
  /// from now on (a discarded step's read as missing).
  void retired(const step_record<Index>& step) { store_.set_filed_through(step.serial); }

  // --- drafts ------------------------------------------------------------------------------------

  /// @brief Resolves the oldest pending draft group of request `h` (`id`): the first
  /// `num_accepted` drafts are committed, the rest are erased (their positions will be recomputed).
  /// @throws error draft_error
  accepted_drafts accept_draft(request_key id, std::uint32_t h, std::int32_t num_accepted, request_registry& requests,
                            std::uint64_t ended_through)
  {
    auto& r    = requests[h];
    auto group = std::find_if(r.drafts.begin(), r.drafts.end(), [](const draft_group& g) { return g.accepted < 0; });
    if (group == r.drafts.end()) {
      throw error{errc::draft_error, "request " + id.to_string() + " has no pending draft tokens"};
    }
    if (num_accepted < 0 || num_accepted > group->count) {
      throw error{errc::draft_error, "request " + id.to_string() + ": accepted " + std::to_string(num_accepted) +
                                       " of " + std::to_string(group->count) + " draft tokens"};
    }
    group->accepted = num_accepted;
    // Rows claimed when filed: steps that have ended by now file as if when they ended, before this
    // acceptance, so they may still take the group's rows over (claim_run, take_over_draft).
    if constexpr (!claims_when_planned) { group->accepted_through = ended_through; }
    if (!group->filed) { return {group->step_serial, 0}; }  // resolved when its rows are filed (claim_run)
    for (std::int32_t d = 0; d < group->count; ++d) {
      if (d >= group->accepted && ((group->owned >> d) & 1u) != 0) {
        store_.erase(h, group->first_position + d, group->slots[static_cast<std::size_t>(d)]);
        group->owned &= ~(1u << d);
      }
    }
    const accepted_drafts done{group->step_serial, group->accepted > 0 ? group->first_position + group->accepted : 0};
    r.recorded_rows = std::max(r.recorded_rows, done.committed_through);
    if (group->accepted_through <= group->step_serial) { r.drafts.erase(group); }  // else kept for the steps after its own
    return done;
  }

  // --- block transfers (slot-indexed stores) -----------------------------------------------------

  /// @brief Checks a block transfer: no step open (`step_open`), blocks in the pool, and room for
  /// their ids (`elems`); `what` names the call.
  /// @throws error invalid_state, slot_out_of_range, invalid_argument
  void check_block_transfer(const char* what, std::span<const std::int64_t> blocks, std::size_t elems, bool step_open) const
    requires(Store::slot_indexed)
  {
    if (step_open) {
      throw error{errc::invalid_state, std::string{what} + " while a step is open; end the step first"};
    }
    store_.check_blocks(blocks, (std::string{what} + ":").c_str());
    const auto need = blocks.size() * static_cast<std::size_t>(store_.block_elems());
    if (elems < need) {
      throw error{errc::invalid_argument, std::string{what} + ": " + std::to_string(blocks.size()) +
                                            " blocks need " + std::to_string(need) + " ids, the buffer has " +
                                            std::to_string(elems)};
    }
  }

  /// @brief Checks a copy_blocks() pair of lists.
  /// @throws error invalid_argument, and as check_block_transfer()
  void check_block_copy(std::span<const std::int64_t> source, std::span<const std::int64_t> destination) const
    requires(Store::slot_indexed)
  {
    if (source.size() != destination.size()) {
      throw error{errc::invalid_argument, "copy_blocks: " + std::to_string(source.size()) + " sources for " +
                                            std::to_string(destination.size()) + " destinations"};
    }
    for (const std::int64_t d : destination) {
      if (std::find(source.begin(), source.end(), d) != source.end()) {
        throw error{errc::invalid_argument,
                    "copy_blocks: block " + std::to_string(d) + " is both a source and a destination"};
      }
    }
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

  // A discarded step gives the tentative draft rows it took over back to their draft groups, where
  // these are still pending.
  static void give_back_drafts(const step_record<Index>& step, request_registry& requests) noexcept
  {
    for (const auto& t : step.taken) {
      for (auto& g : requests[t.handle].drafts) {
        if (g.step_serial == t.group_step && g.accepted < 0) { g.owned |= 1u << (t.position - g.first_position); }
      }
    }
  }

  // Whether the row a discarded step re-claimed at `c` stays: yes, unless it is a tentative draft row
  // the step took over whose group was resolved meanwhile: then only if its position is committed;
  // or the request is gone: then where rows outlive requests (slot-indexed).
  static bool keeps_row(const step_record<Index>& step, const replaced_claim& c, request_registry& requests) noexcept
  {
    const auto& r = requests[c.handle];
    // The request went (released or aborted) before the discard. Slot-indexed rows outlive their
    // request, so the row stays as its others do (and no draft group will resolve it); per-request
    // rows went with it, and the handle may name a new request by now.
    const auto run =
      std::find_if(step.runs.begin(), step.runs.end(), [&](const step_run& x) { return x.handle == c.handle; });
    if (run != step.runs.end() && run->generation != r.generation) { return Store::slot_indexed; }
    for (const auto& t : step.taken) {
      if (t.handle != c.handle || t.position != c.position) { continue; }
      for (const auto& g : r.drafts) {
        if (g.step_serial == t.group_step && g.accepted < 0) { return true; }
      }
      return t.position < r.recorded_rows;
    }
    return true;
  }

  layer_map layers_;
  std::int64_t num_experts_;
  std::int32_t top_k_;
  std::int64_t row_elems_;
  std::int64_t max_model_len_;
  bool overwrite_;
  Store store_;
};

}  // namespace routing_replay
