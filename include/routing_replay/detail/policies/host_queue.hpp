/// @file
/// In-order worker queue and completion flag behind the host backend's streams and events.
#pragma once

#include <routing_replay/errors.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

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

class host_queue;

/// @brief The host "device" the calling thread works on (host_backend::set_device(); 0 unless
/// set): the host analogue of CUDA's current device. Ranks that run as threads of one process each
/// take their own, so that one rank freeing memory waits for its own queues only, as cudaFree
/// waits for its own device: waiting for every queue would wait for a peer rank's queue blocked in
/// a collective that needs this rank.
inline int& current_host_device() noexcept
{
  thread_local int device = 0;
  return device;
}

/// @brief Every live host_queue: freeing "device" memory waits for those of the calling thread's
/// device (wait_for_device_queues()), as cudaFree and cudaFreeHost synchronize the device.
class queue_registry {
 public:
  /// @brief The process's registry.
  static queue_registry& get()
  {
    static queue_registry registry;
    return registry;
  }
  /// @brief Adds a queue.
  void add(host_queue* q)
  {
    std::lock_guard lock{mutex_};
    queues_.push_back(q);
  }
  /// @brief Removes a queue.
  void remove(host_queue* q) noexcept
  {
    std::lock_guard lock{mutex_};
    std::erase(queues_, q);
  }
  /// @brief Calls `f(queue)` for every live queue, none of which goes meanwhile.
  template <class F>
  void for_each(F&& f)
  {
    std::lock_guard lock{mutex_};
    for (host_queue* q : queues_) { f(*q); }
  }

 private:
  std::mutex mutex_;
  std::vector<host_queue*> queues_;
};

/// @brief A thread that runs enqueued tasks one at a time, in order: the host analogue of a
/// CUDA stream. Work really runs asynchronously to the caller, so ordering bugs show up here.
class host_queue {
 public:
  /// @brief A queue of the calling thread's device (current_host_device()).
  host_queue() : device_(current_host_device()), worker_([this] { run(); }) { queue_registry::get().add(this); }

  host_queue(const host_queue&)            = delete;
  host_queue& operator=(const host_queue&) = delete;

  ~host_queue()
  {
    queue_registry::get().remove(this);
    {
      std::lock_guard lock{mutex_};
      stopping_ = true;
    }
    wake_.notify_all();
    worker_.join();  // drains every task enqueued before destruction, as cudaStreamDestroy does
  }

  /// @brief Holds an idle queue for the thread that builds it: while it is alive, tasks that thread
  /// enqueues run at once on that thread, where the worker would have run them next, and other
  /// threads' enqueues wait for it to end. On a queue with work pending or running it holds
  /// nothing (active() is false) and enqueues behave as always.
  ///
  /// Why: a task that reads the caller's memory must otherwise either copy it first (the caller may
  /// reuse it as soon as the call returns) or make the caller wait; on an idle queue running it
  /// here does neither, and spares waking the worker (a system call on the caller's thread).
  class inline_section {
   public:
    /// @brief Holds `queue` if it is idle and no other section holds it.
    explicit inline_section(host_queue& queue) : queue_(&queue), active_(queue.try_hold()) {}
    inline_section(const inline_section&)            = delete;
    inline_section& operator=(const inline_section&) = delete;
    /// @brief Lets the worker and other threads have the queue again.
    ~inline_section()
    {
      if (active_) { queue_->release(); }
    }
    /// @brief Whether this thread's tasks on the queue run at once, on this thread.
    [[nodiscard]] bool active() const noexcept { return active_; }

   private:
    host_queue* queue_;
    bool active_;
  };

  /// @brief Appends a task; it runs after every task enqueued before it (at once, on the calling
  /// thread, inside that thread's inline_section).
  void enqueue(std::function<void()> task)
  {
    bool sleeping = false;
    {
      std::unique_lock lock{mutex_};
      if (holder_ != std::thread::id{}) {
        if (holder_ == std::this_thread::get_id()) {
          lock.unlock();
          run_here(task);
          return;
        }
        released_.wait(lock, [&] { return holder_ == std::thread::id{}; });
      }
      tasks_.push_back(std::move(task));
      enqueued_.fetch_add(1, std::memory_order_release);
      sleeping = sleeping_;
    }
    // A worker still in its idle spin sees the task without a wake: waking a sleeping thread is a
    // system call that cost the caller about 8 us on a 2-core VM, more than most tasks.
    if (sleeping) { wake_.notify_all(); }
  }

  /// @brief Blocks until every task enqueued so far has run.
  /// @throws error backend_error for the first task failure not yet reported
  void synchronize()
  {
    std::unique_lock lock{mutex_};
    const std::uint64_t target = enqueued_.load(std::memory_order_relaxed);
    idle_.wait(lock, [&] { return completed_ >= target; });
    throw_if_failed(std::exchange(failure_, std::nullopt));
  }

  /// @brief The host device the queue belongs to.
  [[nodiscard]] int device() const noexcept { return device_; }

  /// @brief Blocks until every task enqueued so far has run, leaving any failure to be reported
  /// where it is waited for. Returns at once on the queue's own worker (a task cannot wait for
  /// itself).
  void wait_idle() noexcept
  {
    if (std::this_thread::get_id() == worker_.get_id()) { return; }
    std::unique_lock lock{mutex_};
    const std::uint64_t target = enqueued_.load(std::memory_order_relaxed);
    idle_.wait(lock, [&] { return completed_ >= target; });
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
    current_host_device() = device_;  // the tasks address the queue's device, as a stream's kernels do
    std::unique_lock lock{mutex_};
    for (;;) {
      if (tasks_.empty() && !stopping_) {
        const std::uint64_t seen = enqueued_.load(std::memory_order_relaxed);
        lock.unlock();
        spin_while_idle(seen);
        lock.lock();
        sleeping_ = true;
        wake_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
        sleeping_ = false;
      }
      if (tasks_.empty()) { return; }
      auto task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task_failure failure = run_task(task);
      lock.lock();
      keep_first(std::move(failure));
      ++completed_;
      idle_.notify_all();
    }
  }

  // Runs a task, describing how it failed (on the thread that ran it).
  static task_failure run_task(const std::function<void()>& task)
  {
    try {
      task();
    } catch (const std::exception& e) {
      return std::string{"a task on a host stream failed: "} + e.what();
    } catch (...) {
      return std::string{"a task on a host stream failed"};
    }
    return std::nullopt;
  }

  // A task of the thread holding the queue (inline_section): it runs now, its failure reported as
  // the worker's would be (no task is pending or running, so none comes between).
  void run_here(const std::function<void()>& task)
  {
    task_failure failure = run_task(task);
    if (!failure) { return; }
    std::lock_guard lock{mutex_};
    keep_first(std::move(failure));
  }

  // Keeps a task's failure unless an earlier one is still unreported (the mutex held).
  void keep_first(task_failure failure)
  {
    if (failure && !failure_) { failure_ = std::move(failure); }
  }

  bool try_hold()
  {
    std::lock_guard lock{mutex_};
    if (!tasks_.empty() || completed_ != enqueued_.load(std::memory_order_relaxed) || stopping_ ||
        holder_ != std::thread::id{}) {
      return false;
    }
    holder_ = std::this_thread::get_id();
    return true;
  }

  void release()
  {
    {
      std::lock_guard lock{mutex_};
      holder_ = std::thread::id{};
    }
    released_.notify_all();
  }

  // Why a worker spins before it sleeps: an engine enqueues in bursts (a forward's captures, one
  // per layer, tens of microseconds apart), and a task posted to a sleeping worker pays the wake
  // on the caller's thread. The spin yields at every turn, so a core it shares with runnable
  // threads goes to them, and it ends after idle_spin, so an idle queue costs nothing.
  void spin_while_idle(std::uint64_t seen) const noexcept
  {
    const auto until = std::chrono::steady_clock::now() + idle_spin;
    while (enqueued_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < until) {
      std::this_thread::yield();
    }
  }

  /// How long an idle worker waits for the next task before it sleeps.
  static constexpr std::chrono::microseconds idle_spin{50};

  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable idle_;
  std::condition_variable released_;  // an inline_section ended
  std::deque<std::function<void()>> tasks_;
  std::atomic<std::uint64_t> enqueued_{0};  // written under the mutex; the idle spin reads it without
  std::uint64_t completed_ = 0;
  task_failure failure_;
  bool stopping_ = false;
  bool sleeping_ = false;  // the worker waits on wake_: enqueue() must notify
  std::thread::id holder_;  // the thread whose inline_section holds the queue (none: default id)
  int device_;              // the host device of the thread that made the queue
  std::thread worker_;  // last: starts after every other member is constructed
};

/// @brief Waits for every host queue of the calling thread's device to run what was enqueued on it
/// so far: the host analogue of the device synchronization that cudaFree performs.
inline void wait_for_device_queues() noexcept
{
  const int device = current_host_device();
  queue_registry::get().for_each([device](host_queue& q) {
    if (q.device() == device) { q.wait_idle(); }
  });
}

/// @brief The allocator of the host backend's "device" and pinned memory: deallocation first waits
/// for every host queue of the calling thread's device, as cudaFree and cudaFreeHost synchronize the device, so memory that queued
/// work may still touch (an engine's capture into D, a step's copy) is never freed under it.
template <class T>
struct stream_ordered_allocator : std::allocator<T> {
  using value_type = T;  ///< the element type
  /// @brief The same allocator for another type.
  template <class U>
  struct rebind {
    using other = stream_ordered_allocator<U>;  ///< the rebound allocator
  };
  stream_ordered_allocator() = default;
  /// @brief Rebinding copy.
  template <class U>
  stream_ordered_allocator(const stream_ordered_allocator<U>&) noexcept  // NOLINT: implicit, as allocators are
  {
  }
  /// @brief Waits for every host queue, then frees.
  void deallocate(T* p, std::size_t n)
  {
    wait_for_device_queues();
    std::allocator<T>::deallocate(p, n);
  }
  /// @brief Every instance frees what any other allocated.
  friend bool operator==(const stream_ordered_allocator&, const stream_ordered_allocator&) noexcept { return true; }
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
