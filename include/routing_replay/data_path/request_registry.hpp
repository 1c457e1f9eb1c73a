/// @file
/// Data path, part 1: the request registry. Requests that asked for their routing are added here
/// and get a dense handle; every other part addresses a request by that handle. Requests that did
/// not opt in are never added and cost nothing.
#pragma once

#include <routing_replay/detail/prefetch.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/step_plan.hpp>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace routing_replay {

/// @brief The most draft tokens one request may carry in one step.
inline constexpr std::int32_t max_draft_tokens = 32;

/// @brief The trailing draft tokens of one scheduled request in one step, until accept_draft().
///
/// Tentative rows are filed like any other, but yield to any later write of their position and are
/// erased if rejected. `accepted` may arrive before the rows are filed (deferred copies).
struct draft_group {
  std::uint64_t step_serial    = 0;      ///< the step whose drafts these are
  std::int64_t first_position  = 0;      ///< position of the first draft
  std::int32_t count           = 0;      ///< drafts in the group
  std::int32_t accepted        = -1;     ///< -1 until accept_draft()
  bool filed                   = false;  ///< rows already scattered into storage
  std::uint32_t owned          = 0;      ///< bit d: draft d's row was written by this group
  /// Rows claimed when filed: the latest step that had ended when the group was accepted. Those
  /// steps, filed later, still take its rows over, as they would have had they been filed when they
  /// ended; so an accepted group stays until a step that ended after its acceptance is filed.
  std::uint64_t accepted_through = 0;
  std::array<std::int64_t, max_draft_tokens> slots{};  ///< slot of each draft (block-slot storage)

  /// @brief Whether this group wrote the row of `position` (and still owns it).
  [[nodiscard]] bool owns(std::int64_t position) const noexcept
  {
    const std::int64_t d = position - first_position;
    return d >= 0 && d < count && ((owned >> d) & 1u) != 0;
  }
};

/// @brief Everything the library knows about one live request.
///
/// Aligned to a cache line, with what every step reads or writes for each scheduled request first
/// (liveness, the duplicate check, T, the step serials, whether drafts are pending: the vector's
/// first two pointers), so that a step touches one line per request; entries of 80 bytes packed
/// end to end straddled two lines for most requests.
struct alignas(64) request_state {
  const request_id* id = nullptr;  ///< the live id (the registry's own copy); null when retired
  std::uint32_t generation = 0;    ///< bumped on release/abort: in-flight rows of old uses skip
  std::int64_t recorded_rows = 0;  ///< T: one past the highest committed position
  std::uint64_t planned_attempt = 0;  ///< validation pass that last saw it in a plan
  /// @brief Serial of the last step that scheduled it: the open step schedules it when a step is
  /// open and this is that step's serial (serials only grow, so it is never reset).
  std::uint64_t open_step = 0;
  /// @brief The latest step whose rows this request may read: its own steps and, with block-slot
  /// storage, every step planned when it bound cached slots. Extraction files up to it, no further.
  std::uint64_t reads_step = 0;
  std::vector<draft_group> drafts;    ///< FIFO of draft groups not yet fully resolved
  std::int64_t prompt_length = -1;  ///< from add_request(), -1 if unknown
  /// @brief Rows claimed when a step begins: one past the highest position committed by no step
  /// still unfiled (drafts accepted of a filed step, a prefix bound). A discarded step gives T back
  /// as it was before the step, but never below this.
  std::int64_t committed_floor = 0;
};

/// @brief Live requests: id → dense handle → request_state. Handles are reused; a handle's
/// generation moves on when its request goes, so rows still in flight for an earlier use of the
/// handle are recognised and dropped, and a request_handle kept by an engine past its request's end
/// is refused instead of naming the handle's next request.
class request_registry {
 public:
  /// @brief Registers a new id; throws duplicate_request if it is live, invalid_argument for a
  /// handle. Strong: if an allocation fails, nothing changed.
  std::uint32_t add(request_key key)
  {
    if (key.is_handle()) {
      throw error{errc::invalid_argument, "a request is added by its id, not by a handle (" + key.to_string() + ")"};
    }
    if (ids_.find(key) != ids_.end()) {
      throw error{errc::duplicate_request, "request " + key.to_string() + " was already added"};
    }
    free_.reserve(states_.size() + 1);  // so that remove() never allocates
    const auto entry = ids_.emplace(request_id{key}, std::uint32_t{0}).first;
    std::uint32_t h  = 0;
    if (free_.empty()) {
      try {
        states_.emplace_back();
      } catch (...) {
        ids_.erase(entry);
        throw;
      }
      h = static_cast<std::uint32_t>(states_.size() - 1);
    } else {
      h = free_.back();
      free_.pop_back();
    }
    entry->second = h;
    states_[h].id = &entry->first;
    return h;
  }

  /// @brief The handle of a live id, or of a live request_handle (an array access, no hashing);
  /// throws unknown_request otherwise.
  ///
  /// Inline for a live handle, every scheduled request of an engine that keeps its handles (the
  /// step planner calls this once per run); ids and refusals take the out-of-line path.
  [[nodiscard]] std::uint32_t find(const request_key& key) const
  {
    if (key.is_handle() && live(key.handle())) { return key.handle().index; }
    return find_slow(key);
  }

  /// @brief Asks the processor for the state of handle index `h` ahead of its use (a step plan's
  /// planner, a few runs before it gets to them); any value is safe (detail::prefetch_for_write).
  [[gnu::always_inline]] void prefetch(std::uint32_t h) const noexcept { detail::prefetch_for_write(states_.data(), h); }

  /// @brief Whether an id (or handle) is live.
  [[nodiscard]] bool contains(request_key key) const
  {
    return key.is_handle() ? live(key.handle()) : ids_.find(key) != ids_.end();
  }

  /// @brief The request_handle of a live handle index.
  [[nodiscard]] request_handle handle_of(std::uint32_t h) const noexcept { return {h, states_[h].generation}; }

  /// @brief Retires a handle: its state resets and its generation moves on. Never allocates.
  void remove(std::uint32_t h) noexcept
  {
    auto& s = states_[h];
    ids_.erase(ids_.find(s.id->key()));  // heterogeneous erase(key) is C++23
    const std::uint32_t next_generation = s.generation + 1;
    auto drafts                         = std::move(s.drafts);
    drafts.clear();  // keep the capacity for the next use of the handle
    s               = request_state{};
    s.generation    = next_generation;
    s.drafts        = std::move(drafts);
    free_.push_back(h);
  }

  /// @brief State of a handle.
  [[nodiscard]] request_state& operator[](std::uint32_t h) noexcept { return states_[h]; }
  /// @brief State of a handle.
  [[nodiscard]] const request_state& operator[](std::uint32_t h) const noexcept { return states_[h]; }
  /// @brief Live requests.
  [[nodiscard]] std::size_t size() const noexcept { return ids_.size(); }

 private:
  // find() of an id (hashed), or of a handle that is not live (refused).
  [[gnu::noinline]] std::uint32_t find_slow(const request_key& key) const
  {
    if (key.is_handle()) {
      throw error{errc::unknown_request, "request " + key.to_string() +
                                           " is unknown (its request was released or aborted, or it was never "
                                           "returned by add_request)"};
    }
    const auto it = ids_.find(key);
    if (it == ids_.end()) {
      throw error{errc::unknown_request,
                  "request " + key.to_string() + " is unknown (never added, or already released)"};
    }
    return it->second;
  }

  // Whether `h` names a live request in the use of its index it was given for.
  [[nodiscard]] bool live(request_handle h) const noexcept
  {
    return h.index < states_.size() && states_[h.index].id != nullptr && states_[h.index].generation == h.generation;
  }

  std::unordered_map<request_id, std::uint32_t, request_hash, request_equal> ids_;
  std::vector<request_state> states_;
  std::vector<std::uint32_t> free_;
};

}  // namespace routing_replay
