/// @file
/// One thread that runs tasks in the order they were submitted, from a ring of task slots made
/// once: the engine's thread fills a slot in place (its vectors keep their capacity from one use to
/// the next, so a steady-state submission allocates nothing) and hands it over; the thread runs it
/// and gives the slot back. Used by the row streams to keep data movement off the engine's thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace routing_replay::detail {

/// @brief An in-order worker thread over a ring of `Task` slots. One submitting thread.
///
/// An idle worker polls for its next task for `idle_spin` before it sleeps: tasks come in bursts
/// (two or three a step), and a task handed to a sleeping thread pays the wake, a system call, on
/// the submitting thread. A task nobody waits for (a decode step's row copies) may be deferred: a
/// sleeping worker is then woken only once a quarter of the slots hold tasks, or when the
/// submitting thread waits for one (drain(), wait_for(), next() on a full ring), so that one wake
/// serves several steps. `run` must not throw (failures are the task's to record).
template <class Task>
class filing_worker {
 public:
  /// @brief How long an idle worker waits for the next task before it sleeps.
  static constexpr std::chrono::microseconds idle_spin{50};

  /// @brief `depth` task slots, and the thread that runs `run(task)` for each submitted one.
  filing_worker(std::size_t depth, std::function<void(Task&)> run)
    : slots_(depth == 0 ? 1 : depth), run_(std::move(run)), thread_([this] { loop(); })
  {
  }
  filing_worker(const filing_worker&)            = delete;
  filing_worker& operator=(const filing_worker&) = delete;
  /// @brief Runs what was submitted, then stops the thread.
  ~filing_worker()
  {
    {
      std::lock_guard lock{mutex_};
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  /// @brief The slot the next submit() hands over, as the last use left it (the caller clears what
  /// it reuses). Waits while every slot holds a task not yet run.
  [[nodiscard]] Task& next()
  {
    const std::uint64_t submitted = submitted_.load(std::memory_order_relaxed);
    if (submitted - completed_.load(std::memory_order_acquire) >= slots_.size()) {
      wait_until_completed(submitted - slots_.size() + 1);
    }
    return slots_[submitted % slots_.size()];
  }

  /// @brief Hands the slot next() returned to the worker. `defer`: nothing waits for this task
  /// soon, so a sleeping worker is left asleep while fewer than a quarter of the slots hold tasks.
  void submit(bool defer = false)
  {
    const std::uint64_t submitted = submitted_.fetch_add(1, std::memory_order_seq_cst) + 1;
    if (!sleeping_.load(std::memory_order_seq_cst)) { return; }  // it runs or polls: it sees the task
    if (defer && submitted - completed_.load(std::memory_order_acquire) < defer_limit()) { return; }
    wake();
  }

  /// @brief Waits until every submitted task has run.
  void drain() { wait_until_completed(submitted_.load(std::memory_order_relaxed)); }

  /// @brief Tasks submitted so far: the next submit() hands over task number submitted() + 1.
  [[nodiscard]] std::uint64_t submitted() const noexcept { return submitted_.load(std::memory_order_relaxed); }
  /// @brief Tasks run so far (tasks 1 .. completed() have run).
  [[nodiscard]] std::uint64_t completed() const noexcept { return completed_.load(std::memory_order_acquire); }
  /// @brief Waits until task number `task` (1-based) has run.
  void wait_for(std::uint64_t task) { wait_until_completed(task); }

 private:
  [[nodiscard]] std::uint64_t defer_limit() const noexcept { return slots_.size() >= 4 ? slots_.size() / 4 : 1; }

  void wake()
  {
    { std::lock_guard lock{mutex_}; }  // the worker is between its last check and its wait, or waiting
    wake_.notify_one();
  }

  void wait_until_completed(std::uint64_t target)
  {
    if (completed_.load(std::memory_order_acquire) >= target) { return; }
    // deferred tasks may be waiting for a sleeping worker; one that is not sleeping now cannot fall
    // asleep before running them (it sleeps only with nothing submitted left to run)
    if (sleeping_.load(std::memory_order_seq_cst)) { wake(); }
    const auto until = std::chrono::steady_clock::now() + idle_spin;
    while (completed_.load(std::memory_order_acquire) < target) {
      if (std::chrono::steady_clock::now() >= until) {
        std::unique_lock lock{mutex_};
        waiting_.store(true, std::memory_order_seq_cst);
        done_.wait(lock, [&] { return completed_.load(std::memory_order_acquire) >= target; });
        waiting_.store(false, std::memory_order_relaxed);
        return;
      }
      std::this_thread::yield();
    }
  }

  void loop()
  {
    std::uint64_t next = 0;
    for (;;) {
      if (!has_task(next)) {
        const auto until = std::chrono::steady_clock::now() + idle_spin;
        while (!has_task(next) && std::chrono::steady_clock::now() < until) { std::this_thread::yield(); }
        if (!has_task(next)) {
          std::unique_lock lock{mutex_};
          sleeping_.store(true, std::memory_order_seq_cst);
          wake_.wait(lock, [&] { return stopping_ || has_task(next); });
          sleeping_.store(false, std::memory_order_relaxed);
          if (!has_task(next)) { return; }  // stopping, and everything submitted has run
        }
      }
      run_(slots_[next % slots_.size()]);
      completed_.store(++next, std::memory_order_seq_cst);
      if (waiting_.load(std::memory_order_seq_cst)) {
        { std::lock_guard lock{mutex_}; }
        done_.notify_all();
      }
    }
  }

  [[nodiscard]] bool has_task(std::uint64_t next) const noexcept
  {
    return submitted_.load(std::memory_order_seq_cst) > next;
  }

  std::vector<Task> slots_;
  std::function<void(Task&)> run_;
  std::atomic<std::uint64_t> submitted_{0};
  std::atomic<std::uint64_t> completed_{0};
  std::atomic<bool> sleeping_{false};  // the worker waits (or is about to) on wake_
  std::atomic<bool> waiting_{false};   // the submitting thread waits (or is about to) on done_
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts after every other member exists
};

}  // namespace routing_replay::detail
