/// @file
/// Deadlines inside a program. A hang cannot be recovered from, and a test that hangs stalls CI (or
/// a machine's time limit) instead of failing it:
/// - within_deadline runs a piece of a test under a watchdog: past the deadline it names what hung
///   and aborts the process;
/// - progress() is where a program (one rank of a multi-process run) says what it is doing or
///   waiting for (an operation, a step, a layer), and progress_watchdog fires when that has not
///   changed for too long, or the whole run took too long: it prints who waited for what, since
///   when, runs a last action (such as ncclCommAbort) and ends the process with exit code 3.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace rr_test {

/// @brief Runs `f` (exceptions pass through); aborts the process if it has not returned after `limit`.
template <class F>
void within_deadline(std::chrono::seconds limit, const std::string& what, F&& f)
{
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::thread dog{[&] {
    std::unique_lock lock{m};
    if (!cv.wait_for(lock, limit, [&] { return done; })) {
      std::fprintf(stderr, "deadline of %llds exceeded, hung: %s\n", static_cast<long long>(limit.count()),
                   what.c_str());
      std::abort();
    }
  }};
  struct finish {
    std::mutex& m;
    std::condition_variable& cv;
    bool& done;
    std::thread& dog;
    ~finish()
    {
      {
        std::lock_guard lock{m};
        done = true;
      }
      cv.notify_all();
      dog.join();
    }
  } guard{m, cv, done, dog};
  f();
}

/// @brief What this process is doing now: an operation (a string literal), the step and layer it
/// is at (-1: none), and a context set more rarely (the test case, seed, scheme). Updating it is a
/// few atomic stores, so it can be called per layer; with no watchdog it is never read.
class progress_board {
 public:
  /// @brief Now doing (or waiting in) `op` at `step` and `layer`.
  void at(const char* op, std::int64_t step = -1, std::int32_t layer = -1) noexcept
  {
    op_.store(op, std::memory_order_relaxed);
    step_.store(step, std::memory_order_relaxed);
    layer_.store(layer, std::memory_order_relaxed);
    since_.store(now_ms(), std::memory_order_release);
  }
  /// @brief The context of what follows (kept until the next call).
  void context(std::string what)
  {
    std::lock_guard lock{m_};
    context_ = std::move(what);
  }
  /// @brief "context: op, step S, layer L" as last set.
  [[nodiscard]] std::string describe() const
  {
    std::string out;
    {
      std::lock_guard lock{m_};
      out = context_.empty() ? std::string{} : context_ + ": ";
    }
    const char* op = op_.load(std::memory_order_relaxed);
    out += op != nullptr ? op : "(nothing reported yet)";
    if (const auto st = step_.load(std::memory_order_relaxed); st >= 0) { out += ", step " + std::to_string(st); }
    if (const auto l = layer_.load(std::memory_order_relaxed); l >= 0) { out += ", layer " + std::to_string(l); }
    return out;
  }
  /// @brief Milliseconds since the last at() (or since the board was made).
  [[nodiscard]] std::int64_t idle_ms() const noexcept { return now_ms() - since_.load(std::memory_order_acquire); }

 private:
  static std::int64_t now_ms() noexcept
  {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
  }
  std::atomic<const char*> op_{nullptr};
  std::atomic<std::int64_t> step_{-1};
  std::atomic<std::int32_t> layer_{-1};
  std::atomic<std::int64_t> since_{now_ms()};
  mutable std::mutex m_;
  std::string context_;
};

/// @brief This process's progress board.
inline progress_board& progress()
{
  static progress_board board;
  return board;
}

/// @brief A watchdog thread over progress(): fires when nothing was reported for `stall` seconds,
/// or `total` seconds after it started (0: no such limit). Firing prints "`who`: DEADLINE ...
/// waited in: <progress().describe()>" on stderr, runs `last_action` (e.g. ncclCommAbort, so the
/// peers' collectives fail instead of waiting for this rank), and ends the process with exit code
/// 3 (std::_Exit: no destructor may wait on the GPU work that hangs). Destroying it stops it.
class progress_watchdog {
 public:
  progress_watchdog(std::string who, std::chrono::seconds stall, std::chrono::seconds total,
                    std::function<void()> last_action = {})
    : who_(std::move(who)), stall_(stall), total_(total), last_action_(std::move(last_action)),
      thread_([this] { watch(); })
  {
  }
  progress_watchdog(const progress_watchdog&)            = delete;
  progress_watchdog& operator=(const progress_watchdog&) = delete;
  ~progress_watchdog()
  {
    {
      std::lock_guard lock{m_};
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  void watch()
  {
    const auto start = std::chrono::steady_clock::now();
    std::unique_lock lock{m_};
    while (!cv_.wait_for(lock, std::chrono::milliseconds{500}, [&] { return stop_; })) {
      const auto idle    = progress().idle_ms();
      const auto elapsed = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now() - start);
      const bool stalled = stall_.count() > 0 && idle > stall_.count() * 1000;
      const bool late    = total_.count() > 0 && elapsed > total_;
      if (!stalled && !late) { continue; }
      std::fprintf(stderr, "%s: DEADLINE %s after %llds; waited %.1f s in: %s\n", who_.c_str(),
                   stalled ? "no progress" : "run time limit exceeded", static_cast<long long>(elapsed.count()),
                   static_cast<double>(idle) / 1000, progress().describe().c_str());
      std::fflush(stderr);
      std::fflush(stdout);
      if (last_action_) {  // in a thread of its own: it may hang as well (10 s at most)
        auto done = std::make_shared<std::atomic<bool>>(false);
        std::thread{[action = last_action_, done] {
          action();
          done->store(true);
        }}.detach();
        for (int i = 0; i < 100 && !done->load(); ++i) { std::this_thread::sleep_for(std::chrono::milliseconds{100}); }
      }
      std::_Exit(3);
    }
  }

  std::string who_;
  std::chrono::seconds stall_;
  std::chrono::seconds total_;
  std::function<void()> last_action_;
  std::mutex m_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the rest is built
};

}  // namespace rr_test
