/// @file
/// The scheduler side of an engine whose forward runs in worker processes (vLLM's scheduler and
/// workers, possibly on other nodes): it plans steps and keeps the host storage, and files the
/// step packets that workers send (parallel/packet_worker.hpp), through the same planner and filer
/// as RoutingReplay, so extractions return the same rows. Plain C++20; no device, no backend.
#pragma once

#include <routing_replay/copy_strategy.hpp>
#include <routing_replay/data_path/host_side.hpp>
#include <routing_replay/data_path/step_record.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/host_storage.hpp>
#include <routing_replay/index_type.hpp>
#include <routing_replay/parallel/step_packet.hpp>
#include <routing_replay/step_plan.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace routing_replay {

/// @brief Host storage, requests and plans of a scheduler process; rows arrive as step packets.
///
/// Each step: begin_step(plan) when the scheduler schedules it (as RoutingReplay::begin_step: all
/// host errors surface here, block-slot claims are made here), end_step() once it is handed to the
/// workers; the step then waits in flight until file(packet) receives its rows. Packets are filed
/// in step order; a worker and its scheduler count steps alike from 1, which is how a packet finds
/// its step. File a step's packet before acting on the step's outcome (finishing or extracting its
/// requests); accept_draft() may come before. The request calls come from host_side.
template <expert_index Index = std::int16_t, host_storage Storage = per_request_storage>
class scheduler_replay
  : public host_side<scheduler_replay<Index, Storage>, Index, typename Storage::template store<Index>, scatter_site::host> {
  using base = host_side<scheduler_replay, Index, typename Storage::template store<Index>, scatter_site::host>;
  friend base;  // calls file_through()

 public:
  using storage_type = Storage;  ///< the host-storage policy

  /// @brief Validates the configuration and creates the host storage (block-slot: the pool).
  /// @throws error invalid_config, index_type_too_narrow, host_memory_exhausted
  explicit scheduler_replay(replay_config config)
    : base(std::move(config)),
      staging_(static_cast<std::size_t>(this->config_.max_tokens_per_step * this->row_size()))
  {
  }

  /// @brief Steps handed to workers whose packets have not been filed yet.
  [[nodiscard]] std::size_t steps_in_flight() const noexcept { return in_flight_.size(); }
  /// @brief Serial of the step the next packet must carry (0: none is waiting).
  [[nodiscard]] std::uint64_t waiting_for() const noexcept { return in_flight_.empty() ? 0 : in_flight_.front().serial; }

  /// @brief Opens a step: validates the plan and reserves host storage (RoutingReplay::begin_step).
  /// @throws error as RoutingReplay::begin_step()
  void begin_step(const step_plan& plan)
  {
    this->planner_.validate(plan, this->requests_, this->filer_);
    this->planner_.open(plan, this->requests_, this->filer_);
  }

  /// @brief Closes the step: it waits for its packet. Returns its serial.
  /// @throws error invalid_state if no step is open
  std::uint64_t end_step()
  {
    step_record<Index>& closed = this->planner_.close();
    step_record<Index> next;
    if (!spare_.empty()) {
      next = std::move(spare_.back());
      spare_.pop_back();
    }
    std::swap(next, closed);  // the planner keeps a used record's capacity
    in_flight_.push_back(std::move(next));
    return in_flight_.back().serial;
  }

  /// @brief Files a worker's packet of the oldest step in flight. Every check runs first: a bad
  /// packet changes nothing (the step keeps waiting for a good one).
  /// @throws error invalid_packet: truncated, corrupted (checksum), another format version, another
  /// shape or index type, not the step waited for, or runs that differ from the plan (an unknown
  /// request); as RoutingReplay::end_step() for a problem the worker's device reported (the step is
  /// discarded); backend_error if the worker lost the step (discarded)
  void file(std::span<const std::byte> packet)
  {
    const auto p = step_packet_view::parse(packet);
    check(p);
    step_record<Index> step = std::move(in_flight_.front());
    in_flight_.pop_front();
    struct recycle {  // the record goes back to the spares however filing ends
      std::vector<step_record<Index>>& spares;
      step_record<Index>& step;
      ~recycle() { spares.push_back(std::move(step)); }
    } guard{spare_, step};
    this->filer_.retired(step);
    if (p.lost()) {
      this->filer_.discard(step, this->requests_);
      throw error{errc::backend_error, "step " + std::to_string(step.serial) +
                                         ": the worker lost the step's rows (its copy failed); the step was discarded"};
    }
    const std::int64_t row_elems = this->row_size();
    for (std::size_t i = 0; i < step.runs.size(); ++i) {
      const auto& run = step.runs[i];
      std::memcpy(staging_.data() + run.first_row * row_elems, p.runs()[i].rows,
                  static_cast<std::size_t>(run.num_tokens * row_elems) * sizeof(Index));
    }
    this->filer_.file(step, p.status(), staging_.data(), this->requests_, this->accepted_drafts_committed());
  }

 private:
  // Reads wait for steps in flight: here nothing can be waited for, the packet must be filed first.
  void file_through(std::uint64_t last) const
  {
    if (!in_flight_.empty() && in_flight_.front().serial <= last) {
      throw error{errc::invalid_state, "step " + std::to_string(in_flight_.front().serial) +
                                         " is still waiting for its packet; file it before reading its rows"};
    }
  }

  [[noreturn]] static void bad(const std::string& what) { throw error{errc::invalid_packet, "step packet: " + what}; }

  // The packet against the configuration and the step waited for; throws, changing nothing.
  void check(const step_packet_view& p) const
  {
    if (p.num_layers() != this->num_layers() || p.top_k() != this->top_k() || !p.template holds<Index>()) {
      bad("shape mismatch: " + std::to_string(p.num_layers()) + " layers x " + std::to_string(p.top_k()) + " ids of " +
          std::to_string(p.index_bytes()) + " byte(s), the scheduler stores " + std::to_string(this->num_layers()) +
          " x " + std::to_string(this->top_k()) + " of " + std::to_string(sizeof(Index)));
    }
    if (in_flight_.empty() || p.serial() != in_flight_.front().serial) {
      bad("of step " + std::to_string(p.serial()) + ", but " +
          (in_flight_.empty() ? std::string{"no step is waiting for its rows"}
                              : "step " + std::to_string(in_flight_.front().serial) + " is waited for first"));
    }
    const step_record<Index>& step = in_flight_.front();
    if (p.num_rows() != step.num_rows || p.runs().size() != step.runs.size()) {
      bad("step " + std::to_string(step.serial) + " has " + std::to_string(p.num_rows()) + " rows in " +
          std::to_string(p.runs().size()) + " runs, the plan " + std::to_string(step.num_rows) + " in " +
          std::to_string(step.runs.size()));
    }
    for (std::size_t i = 0; i < step.runs.size(); ++i) { check_run(step, step.runs[i], p.runs()[i], i); }
  }

  void check_run(const step_record<Index>& step, const step_run& run, const packet_run& got, std::size_t i) const
  {
    const std::string where = "step " + std::to_string(step.serial) + ", run " + std::to_string(i) + ": ";
    const auto& r           = this->requests_[run.handle];
    // a request released or aborted since the plan drops its rows; otherwise the ids must agree
    if (r.generation == run.generation && r.id && !(r.id->key() == got.id)) {
      bad(where + "unknown request " + got.id.to_string() + " (the plan has request " + r.id->to_string() + " there)");
    }
    if (got.first_row != run.first_row || got.first_position != run.first_position ||
        got.num_tokens != run.num_tokens || got.num_draft_tokens != run.num_draft) {
      bad(where + "rows [" + std::to_string(got.first_row) + ", +" + std::to_string(got.num_tokens) + ") at position " +
          std::to_string(got.first_position) + " with " + std::to_string(got.num_draft_tokens) +
          " drafts differ from the plan's [" + std::to_string(run.first_row) + ", +" + std::to_string(run.num_tokens) +
          ") at " + std::to_string(run.first_position) + " with " + std::to_string(run.num_draft));
    }
    if (run.slots_begin < 0) { return; }
    bool same = got.num_slots() == static_cast<std::size_t>(run.num_tokens);
    for (std::size_t j = 0; same && j < got.num_slots(); ++j) {
      same = got.slot(j) == step.slots[static_cast<std::size_t>(run.slots_begin) + j];
    }
    if (!same) { bad(where + "its KV slots differ from the plan's"); }
  }

  std::vector<Index> staging_;                // the step's rows at their rows of the step
  std::deque<step_record<Index>> in_flight_;  // steps waiting for their packets, oldest first
  std::vector<step_record<Index>> spare_;     // filed records, reused (their capacity)
};

}  // namespace routing_replay
