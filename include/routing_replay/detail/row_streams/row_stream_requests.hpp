/// @file
/// The row streams' bookkeeping on the engine's thread: per request its cursors, its tail (the one
/// incomplete block it is filling) and its full blocks still waiting for keys, kept in dense handles
/// in the order requests arrived; and the pool of block slots tails and waiting blocks take their
/// rows from. Only metadata lives here: the filing thread moves the rows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace routing_replay::detail {

/// @brief No handle, slot or cursor.
inline constexpr std::int32_t none = -1;

/// @brief Positions [a, b) as messages name them: "[a, b)".
inline std::string range_text(std::int64_t a, std::int64_t b)
{
  return "[" + std::to_string(a) + ", " + std::to_string(b) + ")";
}

/// @brief One request's stream.
struct stream_request {
  bool live              = false;  ///< the handle names a request
  bool captured          = false;  ///< a step has captured rows of it (capture_cursor is set)
  bool finished          = false;  ///< the engine finished it; it goes once no step in flight covers it
  std::int32_t in_flight = 0;      ///< prepared steps not yet processed that cover it
  std::int64_t capture_cursor   = 0;  ///< one past the last captured position
  std::int64_t scheduled_cursor = 0;  ///< one past the last position its last step was scheduled for
  std::int64_t emit_cursor      = 0;  ///< first position not yet handed out
  std::int64_t skip_until       = 0;  ///< positions below this are not kept (computed on another instance)
  std::int64_t num_keys         = 0;  ///< block keys received
  std::int32_t tail_slot        = none;  ///< pool slot of its incomplete block
  std::int64_t tail_start       = 0;     ///< first position of that block
  std::int32_t tail_length      = 0;     ///< rows in it
  std::int32_t waiting_first    = none;  ///< first full block waiting for its key (pool slot)
  std::int32_t waiting_last     = none;  ///< last one
  std::int32_t older            = none;  ///< arrival order: the request that arrived before
  std::int32_t newer            = none;  ///< ... and after
  std::uint32_t generation      = 0;     ///< bumped each time the handle is reused
};

/// @brief Live requests by handle, in arrival order, with handles reused only once the filing
/// thread can no longer see the request they named (release_quarantine()).
class stream_requests {
 public:
  /// @brief The request of handle `h`.
  [[nodiscard]] stream_request& operator[](std::int32_t h) noexcept { return requests_[static_cast<std::size_t>(h)]; }
  /// @brief The request of handle `h`.
  [[nodiscard]] const stream_request& operator[](std::int32_t h) const noexcept
  {
    return requests_[static_cast<std::size_t>(h)];
  }
  /// @brief Whether `h` names a live request.
  [[nodiscard]] bool live(std::int32_t h) const noexcept
  {
    return h >= 0 && static_cast<std::size_t>(h) < requests_.size() && requests_[static_cast<std::size_t>(h)].live;
  }
  /// @brief Live requests.
  [[nodiscard]] std::size_t size() const noexcept { return live_; }
  /// @brief The request that arrived first, or none.
  [[nodiscard]] std::int32_t oldest() const noexcept { return oldest_; }

  /// @brief A new request, the newest, whose emit cursor is `emit_start`.
  std::int32_t add(std::int64_t emit_start)
  {
    std::int32_t h = none;
    if (!free_.empty()) {
      h = free_.back();
      free_.pop_back();
    } else {
      h = static_cast<std::int32_t>(requests_.size());
      requests_.emplace_back();
    }
    stream_request& r       = (*this)[h];
    const std::uint32_t gen = r.generation + 1;
    r                       = stream_request{};
    r.generation            = gen;
    r.live                  = true;
    r.emit_cursor           = emit_start;
    r.older                 = newest_;
    if (newest_ != none) { (*this)[newest_].newer = h; }
    newest_ = h;
    if (oldest_ == none) { oldest_ = h; }
    ++live_;
    return h;
  }

  /// @brief Forgets request `h`; its handle is reused after release_quarantine().
  void remove(std::int32_t h)
  {
    stream_request& r = (*this)[h];
    if (r.older != none) { (*this)[r.older].newer = r.newer; } else { oldest_ = r.newer; }
    if (r.newer != none) { (*this)[r.newer].older = r.older; } else { newest_ = r.older; }
    r.live = false;
    --live_;
    quarantine_.push_back(h);
  }

  /// @brief Handles forgotten so far become reusable: call when everything handed to the filing
  /// thread about them has been submitted.
  void release_quarantine()
  {
    free_.insert(free_.end(), quarantine_.begin(), quarantine_.end());
    quarantine_.clear();
  }

 private:
  std::vector<stream_request> requests_;
  std::vector<std::int32_t> free_;
  std::vector<std::int32_t> quarantine_;
  std::int32_t oldest_ = none;
  std::int32_t newest_ = none;
  std::size_t live_    = 0;
};

/// @brief Block slots for tails and for full blocks waiting for their keys: a fixed pool, each slot
/// remembering its block's first position and the next waiting block of its request.
///
/// A slot whose block a filing task still has to read (stored from the slot) is free as far as
/// counting goes, but is handed out again only once that task ran: take() waits for it if no other
/// slot is free, so the pool is exhausted exactly when every slot holds a block.
class block_slot_pool {
 public:
  /// @brief `slots` slots.
  explicit block_slot_pool(std::int32_t slots) : start_(static_cast<std::size_t>(slots)), next_(static_cast<std::size_t>(slots))
  {
    free_.reserve(static_cast<std::size_t>(slots));
    retiring_.reserve(static_cast<std::size_t>(slots));
    reset();
  }

  /// @brief Slots.
  [[nodiscard]] std::int32_t size() const noexcept { return static_cast<std::int32_t>(start_.size()); }
  /// @brief Slots holding no block (some may wait for a filing task before they are handed out).
  [[nodiscard]] std::int32_t free() const noexcept { return static_cast<std::int32_t>(free_.size() + retiring_.size() - retired_); }

  /// @brief A slot holding no block, or none when the pool is exhausted. `wait_for(task)` must
  /// return once filing task `task` ran; `completed` is the last task that ran.
  template <class WaitFor>
  [[nodiscard]] std::int32_t take(std::uint64_t completed, WaitFor&& wait_for)
  {
    reclaim(completed);
    if (free_.empty()) {
      if (retired_ == retiring_.size()) { return none; }
      const auto [slot, task] = retiring_[retired_];
      wait_for(task);
      reclaim(task);
    }
    const std::int32_t s = free_.back();
    free_.pop_back();
    next_[static_cast<std::size_t>(s)] = none;
    return s;
  }
  /// @brief Gives slot `s` back, to be handed out again at once.
  void give(std::int32_t s) { free_.push_back(s); }
  /// @brief Gives slot `s` back once filing task `task` (which reads it) ran.
  void give_after(std::int32_t s, std::uint64_t task) { retiring_.push_back({s, task}); }
  /// @brief Every slot free (those a filing task still reads, once it ran).
  void reset()
  {
    free_.clear();
    std::vector<bool> held(start_.size(), false);
    for (std::size_t i = retired_; i < retiring_.size(); ++i) { held[static_cast<std::size_t>(retiring_[i].slot)] = true; }
    for (std::int32_t s = size() - 1; s >= 0; --s) {
      if (!held[static_cast<std::size_t>(s)]) { free_.push_back(s); }
    }
  }
  /// @brief First position of the block in slot `s`.
  [[nodiscard]] std::int64_t& start(std::int32_t s) noexcept { return start_[static_cast<std::size_t>(s)]; }
  /// @brief The slot of the next waiting block after the one in `s`, or none.
  [[nodiscard]] std::int32_t& next(std::int32_t s) noexcept { return next_[static_cast<std::size_t>(s)]; }

 private:
  struct retiring_slot {
    std::int32_t slot;
    std::uint64_t task;
  };

  // Slots whose filing task ran become free (tasks run in order: the queue is sorted by task).
  void reclaim(std::uint64_t completed)
  {
    while (retired_ < retiring_.size() && retiring_[retired_].task <= completed) { free_.push_back(retiring_[retired_++].slot); }
    if (retired_ == retiring_.size() || retired_ > retiring_.capacity() / 2) {  // keeps within its capacity
      retiring_.erase(retiring_.begin(), retiring_.begin() + static_cast<std::ptrdiff_t>(retired_));
      retired_ = 0;
    }
  }

  std::vector<std::int64_t> start_;
  std::vector<std::int32_t> next_;
  std::vector<std::int32_t> free_;  // a stack
  std::vector<retiring_slot> retiring_;  // [retired_, end): given back, read by a filing task not yet run
  std::size_t retired_ = 0;
};

}  // namespace routing_replay::detail
