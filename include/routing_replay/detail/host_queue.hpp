/// @file
/// In-order worker queue and completion flag behind the host backend's streams and events.
#pragma once

#include <routing_replay/errors.hpp>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>

namespace routing_replay::detail {

/// @brief A failed task, described on the thread that ran it. Only the message crosses threads:
/// sharing the exception object would split its lifetime between the worker and the waiting
/// thread, whose reference counts the standard library keeps out of ThreadSanitizer's sight.
using task_failure = std::optional<std::string>;

/// @brief Throws error backend_error for a failure, if there is one.
inline void throw_if_failed(const task_failure& failure)
{
  if (failure) { throw error{errc::backend_error, *failure}; }
}

/// @brief A thread that runs enqueued tasks one at a time, in order: the host analogue of a
/// CUDA stream. Work really runs asynchronously to the caller, so ordering bugs show up here.
class host_queue {
 public:
  host_queue() : worker_([this] { run(); }) {}

  host_queue(const host_queue&)            = delete;
  host_queue& operator=(const host_queue&) = delete;

  ~host_queue()
  {
    {
      std::lock_guard lock{mutex_};
      stopping_ = true;
    }
    wake_.notify_all();
    worker_.join();  // drains every task enqueued before destruction, as cudaStreamDestroy does
  }

  /// @brief Appends a task; it runs after every task enqueued before it.
  void enqueue(std::function<void()> task)
  {
    {
      std::lock_guard lock{mutex_};
      tasks_.push_back(std::move(task));
      ++enqueued_;
    }
    wake_.notify_all();
  }

  /// @brief Blocks until every task enqueued so far has run.
  /// @throws error backend_error for the first task failure not yet reported
  void synchronize()
  {
    std::unique_lock lock{mutex_};
    const std::uint64_t target = enqueued_;
    idle_.wait(lock, [&] { return completed_ >= target; });
    throw_if_failed(std::exchange(failure_, std::nullopt));
  }

  /// @brief Takes the first task failure not yet reported (called from the worker by an event's
  /// completion task, so the failure is reported once, where that event is waited on).
  task_failure take_failure()
  {
    std::lock_guard lock{mutex_};
    return std::exchange(failure_, std::nullopt);
  }

 private:
  void run()
  {
    std::unique_lock lock{mutex_};
    for (;;) {
      wake_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) { return; }
      auto task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task_failure failure;
      try {
        task();
      } catch (const std::exception& e) {
        failure = std::string{"a task on a host stream failed: "} + e.what();
      } catch (...) {
        failure = std::string{"a task on a host stream failed"};
      }
      lock.lock();
      if (failure && !failure_) { failure_ = failure; }
      ++completed_;
      idle_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable idle_;
  std::deque<std::function<void()>> tasks_;
  std::uint64_t enqueued_  = 0;
  std::uint64_t completed_ = 0;
  task_failure failure_;
  bool stopping_ = false;
  std::thread worker_;  // last: starts after every other member is constructed
};

/// @brief A completion flag with CUDA event semantics: record() marks a point in a queue, and
/// waiting on it waits for the most recent record to be reached.
class completion_flag {
 public:
  /// @brief Host side of a record: the ticket that the matching queued task will complete.
  std::uint64_t arm()
  {
    std::lock_guard lock{mutex_};
    return ++recorded_;
  }
  /// @brief Queue side of a record: reached the ticket, with the queue's first failure so far.
  void complete(std::uint64_t ticket, task_failure failure)
  {
    {
      std::lock_guard lock{mutex_};
      if (ticket > completed_) { completed_ = ticket; }
      if (failure && !failure_) { failure_ = failure; }
    }
    reached_.notify_all();
  }
  /// @brief Takes the failure of work recorded before this flag, if any.
  task_failure take_failure()
  {
    std::lock_guard lock{mutex_};
    return std::exchange(failure_, std::nullopt);
  }
  /// @brief The ticket of the latest record (0: never recorded).
  std::uint64_t latest()
  {
    std::lock_guard lock{mutex_};
    return recorded_;
  }
  /// @brief Whether the ticket has been reached.
  bool reached(std::uint64_t ticket)
  {
    std::lock_guard lock{mutex_};
    return completed_ >= ticket;
  }
  /// @brief Blocks until the ticket has been reached.
  void wait(std::uint64_t ticket)
  {
    std::unique_lock lock{mutex_};
    reached_.wait(lock, [&] { return completed_ >= ticket; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable reached_;
  std::uint64_t recorded_  = 0;
  std::uint64_t completed_ = 0;
  task_failure failure_;
};

}  // namespace routing_replay::detail
