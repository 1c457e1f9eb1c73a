/// @file
/// Data path, part 5: the row filer. Files the rows of a step that arrived, discards the steps
/// that failed, resolves drafts, serves prefix-cache hits and checks block transfers. It derives
/// from the row claimer (data_path/row_claimer.hpp), which owns the host storage and decides where
/// each row goes. Reading rows back out is the row reader's (data_path/row_reader.hpp).
#pragma once

#include <routing_replay/config.hpp>
#include <routing_replay/copy_strategy.hpp>
#include <routing_replay/data_path/request_registry.hpp>
#include <routing_replay/data_path/row_claimer.hpp>
#include <routing_replay/data_path/step_record.hpp>
#include <routing_replay/detail/row_claim.hpp>
#include <routing_replay/detail/data_path/step_errors.hpp>
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
#include <vector>

namespace routing_replay {


/// @brief What accept_draft() resolved: the draft group's step, and one past the last position it
/// committed at once (0 if none, or if that waits for the group's step to be filed).
struct accepted_drafts {
  std::uint64_t step                = 0;  ///< serial of the step whose drafts these were
  std::int64_t committed_through    = 0;  ///< one past the last position committed now
};

/// @brief The default listener of row_filer::file(): nothing to tell of drafts a step commits.
struct no_commit_listener {
  /// @brief Ignores the request handle and its new T.
  void operator()(std::uint32_t, std::int64_t) const noexcept {}
};

/// @brief Files steps into a host store (`Store`, from a host_storage policy) for rows that
/// `Site` places: the host copies them from a staging, or a kernel already wrote them in place.
///
/// Where rows are claimed, and how, is the row claimer's (row_claimer, which this class derives
/// from); filing then only moves data, or, where rows are claimed when filed, claims them first.
template <expert_index Index, class Store, scatter_site Site>
class row_filer : public row_claimer<Index, Store, Site> {
  using claimer = row_claimer<Index, Store, Site>;
  using traits  = index_traits<Index>;
  using claimer::row_elems_;
  using claimer::store_;

 public:
  /// @brief Creates the store for a validated configuration.
  row_filer(const replay_config& config, const layer_map& layers)
    : claimer(config, static_cast<std::int64_t>(layers.num_layers()) * config.top_k),
      layers_(layers),
      num_experts_(config.num_experts),
      top_k_(config.top_k),
      max_model_len_(config.max_model_len)
  {
  }

  /// @brief The layer map rows are laid out by.
  [[nodiscard]] const layer_map& layers() const noexcept { return layers_; }

  /// @brief The copy pipeline's step_sink that files its steps here, over the live `requests`;
  /// `on_commit` as file() takes it.
  template <class Backend, class OnCommit>
  struct pipeline_sink {
    row_filer& filer;            ///< where steps are filed
    request_registry& requests;  ///< the live requests
    OnCommit on_commit;          ///< told of drafts a filed step commits
    /// @brief A step's rows and status arrived in its ring slot.
    template <class Slot>
    void file(Slot& slot)
    {
      const Index* staging = Site == scatter_site::host ? Backend::data(slot.staging) : nullptr;
      filer.file(slot.step, *Backend::data(slot.status), staging, requests, on_commit);
    }
    /// @brief A step's rows never arrive.
    void discard(const step_record<Index>& step) { filer.discard(step, requests); }
    /// @brief A step left the ring.
    void retired(const step_record<Index>& step) noexcept { filer.retired(step); }
  };

  /// @brief The copy pipeline's sink for steps filed here.
  template <class Backend, class OnCommit>
  [[nodiscard]] pipeline_sink<Backend, OnCommit> sink(request_registry& requests, OnCommit on_commit) noexcept
  {
    return {*this, requests, on_commit};
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
  /// Their rows may still be on their way from any step planned so far, up to `latest_step`;
  /// `open_step` is the step open now (0: none), whose claims hold no row yet.
  void bind_cached_prefix(std::uint32_t h,
                          std::span<const std::int64_t> cached_slots,
                          request_registry& requests,
                          std::uint64_t latest_step,
                          std::uint64_t open_step)
  {
    const auto n = static_cast<std::int64_t>(cached_slots.size());
    store_.bind_cached(h, cached_slots, open_step);
    auto& r           = requests[h];
    r.recorded_rows   = std::max(r.recorded_rows, n);
    r.committed_floor = std::max(r.committed_floor, n);
    if (Store::slot_indexed && n > 0) { r.reads_step = latest_step; }
  }

  /// @brief Forgets a request: frees its rows (slot-indexed rows stay for prefix hits) and
  /// retires its handle.
  void close(std::uint32_t h, request_registry& requests)
  {
    store_.close(h);
    requests.remove(h);
  }

  // --- filing ------------------------------------------------------------------------------------

  /// @brief A step's rows and verdict have arrived; the verdict decides whether it is stored at
  /// all. `staging` holds its rows token-major ([N, L, K]) where the host places them; where a
  /// kernel did, the rows are already in place (or replaced by the sentinel if the verdict is bad).
  ///
  /// Where rows are claimed when a step begins, drafts of this step accepted before it was filed
  /// commit now: `on_commit(handle, committed_through)` is called for each such request (a step
  /// still open counts them for its readers), after its T was raised.
  /// @throws error invalid_expert_id, invalid_argument, missing_routing: the device reported a
  /// problem; the step was discarded as a whole
  template <class OnCommit = no_commit_listener>
  void file(const step_record<Index>& step,
            const detail::step_status& status,
            const Index* staging,
            request_registry& requests,
            OnCommit&& on_commit = {})
  {
    if (!status.clean()) {
      discard(step, requests);
      throw error{detail::device_problem_code(status),
                  detail::describe_device_problem(status, step, requests, layers_, num_experts_, top_k_)};
    }
    if constexpr (claimer::claims_when_planned) {
      // a walk over the step's runs only where a draft group of this step or an earlier one was
      // accepted before its step was filed (none in a step without speculative decoding)
      if (step.serial <= accepted_before_filed_) { commit_accepted_drafts(step, requests, on_commit); }
    }
    if constexpr (Site == scatter_site::host) {
      const auto row_bytes = static_cast<std::size_t>(row_elems_) * sizeof(Index);
      auto place           = [&](detail::row_claim<Index> c, std::int64_t row, std::int64_t rows) {
        std::memcpy(c.dst, c.copy_from != nullptr ? c.copy_from : staging + row * row_elems_,
                    static_cast<std::size_t>(rows) * row_bytes);
      };
      if constexpr (claimer::claims_when_planned) {
        for (const auto& op : step.ops) {
          std::memcpy(op.dst, op.copy_from != nullptr ? op.copy_from : staging + op.src,
                      static_cast<std::size_t>(op.elems) * sizeof(Index));
        }
      } else {
        for (const auto& run : step.runs) {
          auto& r = requests[run.handle];
          if (r.generation == run.generation) { this->claim_run(run, r, step, place); }  // else: gone
        }
      }
    }
  }

  /// @brief A step whose rows will never be filed. Its draft groups go; rows claimed when it began
  /// are unclaimed and the rows counted are undone, so a recompute of those positions records them
  /// again. Where the host places rows, the claimed rows get the sentinel: a later step may already
  /// be planned to copy one elsewhere (a position following it), and must copy the sentinel. Rows
  /// the step would have replaced (a row already there it re-claimed) stay, claimed as before, and
  /// tentative draft rows it took over go back to their draft groups
  /// (docs/design/error_model.md, 5.3).
  void discard(const step_record<Index>& step, request_registry& requests)
  {
    for (const auto& run : step.runs) {
      auto& r = requests[run.handle];
      if (run.num_draft == 0 || r.generation != run.generation) { continue; }
      std::erase_if(r.drafts, [&](const draft_group& g) { return g.step_serial == step.serial; });
    }
    if constexpr (claimer::claims_when_planned) {
      if constexpr (Site == scatter_site::host) {
        for (const auto& op : step.ops) {
          if (!op.replaces) { std::fill_n(op.dst, op.elems, traits::sentinel); }
        }
      }
      for (const auto& run : step.runs) {
        auto& r = requests[run.handle];
        if (r.generation == run.generation && r.recorded_rows == run.recorded_after) {
          // positions committed meanwhile outside this step (an earlier step's drafts accepted
          // and filed, a prefix bound) stay
          r.recorded_rows = std::max(run.recorded_before, r.committed_floor);
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
  void retired(const step_record<Index>& step)
  {
    store_.set_filed_through(step.serial);
    retired_through_ = step.serial;
  }

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
    if constexpr (!claimer::claims_when_planned) { group->accepted_through = ended_through; }
    if (!group->filed) {  // resolved when its rows are filed (claim_run)
      if constexpr (claimer::claims_when_planned) { note_accepted_before_filed(group->step_serial); }
      return {group->step_serial, 0};
    }
    for (std::int32_t d = 0; d < group->count; ++d) {
      if (d < group->accepted) { continue; }
      const std::int64_t position = group->first_position + d;
      if (((group->owned >> d) & 1u) != 0) {
        store_.erase(h, position, group->slots[static_cast<std::size_t>(d)]);
        group->owned &= ~(1u << d);
      } else if constexpr (claimer::claims_when_planned) {
        // a later step, not filed yet, took the row over: readers no longer see the rejected row
        store_.forget_replaced_row(h, position, group->step_serial);
      }
    }
    // Rows claimed when a step begins: the group's rows are claimed, but its step may still be open
    // or in flight. What it accepted commits when that step is filed (file()); a discarded step
    // commits nothing, as none of its other rows (CORE-BUG-19).
    if constexpr (claimer::claims_when_planned) {
      if (group->step_serial > retired_through_) {
        note_accepted_before_filed(group->step_serial);
        return {group->step_serial, 0};
      }
    }
    const accepted_drafts done{group->step_serial, group->accepted > 0 ? group->first_position + group->accepted : 0};
    r.recorded_rows   = std::max(r.recorded_rows, done.committed_through);
    r.committed_floor = std::max(r.committed_floor, done.committed_through);
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
  // Drafts of `step` accepted before it was filed (claims when planned) commit now: T rises to
  // them, the group is resolved, and `on_commit` hears of it.
  template <class OnCommit>
  static void commit_accepted_drafts(const step_record<Index>& step, request_registry& requests, OnCommit& on_commit)
  {
    for (const auto& run : step.runs) {
      if (run.num_draft == 0) { continue; }
      auto& r = requests[run.handle];
      if (r.generation != run.generation) { continue; }
      const auto group = std::find_if(r.drafts.begin(), r.drafts.end(), [&](const draft_group& g) {
        return g.step_serial == step.serial && g.accepted >= 0;
      });
      if (group == r.drafts.end()) { continue; }
      const std::int64_t committed = group->accepted > 0 ? group->first_position + group->accepted : 0;
      r.drafts.erase(group);
      if (committed == 0) { continue; }
      r.recorded_rows   = std::max(r.recorded_rows, committed);
      r.committed_floor = std::max(r.committed_floor, committed);
      on_commit(run.handle, committed);
    }
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
        if (g.step_serial != t.group_step) { continue; }
        // pending; or accepted while its step was unfiled: committed if accepted, once that files
        return g.accepted < 0 || t.position < g.first_position + g.accepted;
      }
      return t.position < r.recorded_rows;
    }
    return true;
  }

  void note_accepted_before_filed(std::uint64_t step_serial) noexcept
  {
    accepted_before_filed_ = std::max(accepted_before_filed_, step_serial);
  }

  layer_map layers_;
  std::uint64_t retired_through_ = 0;  // the latest step that left the copy pipeline (filed or discarded)
  // Claims when planned: the latest step a draft group of which was accepted before the step was
  // filed. Every step with such a group has a serial at or below it, so file() walks no other.
  std::uint64_t accepted_before_filed_ = 0;
  std::int64_t num_experts_;
  std::int32_t top_k_;
  std::int64_t max_model_len_;
};

}  // namespace routing_replay
