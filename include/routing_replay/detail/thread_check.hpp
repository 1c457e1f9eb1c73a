/// @file
/// Detects a call into a RoutingReplay from a second thread while another thread is inside it, in
/// debug builds (or with ROUTING_REPLAY_CHECK_THREADS=1): the object is driven by one thread, as
/// engines drive it, and a second one would corrupt it silently. Compiled out otherwise.
#pragma once

#include <routing_replay/errors.hpp>

#include <atomic>
#include <functional>
#include <sstream>
#include <string>
#include <thread>

#if !defined(ROUTING_REPLAY_CHECK_THREADS)
#if defined(NDEBUG)
#define ROUTING_REPLAY_CHECK_THREADS 0
#else
#define ROUTING_REPLAY_CHECK_THREADS 1
#endif
#endif

namespace routing_replay::detail {

#if ROUTING_REPLAY_CHECK_THREADS
/// @brief Which thread is inside the object, and how deep (a call may make nested calls).
class thread_check {
 public:
  thread_check() = default;
  /// @brief A moved-to object starts with nobody inside (moving is not a call into it).
  thread_check(thread_check&&) noexcept {}
  /// @brief As the move constructor.
  thread_check& operator=(thread_check&&) noexcept { return *this; }

  /// @brief Holds the object for the calling thread until it goes.
  class guard {
   public:
    /// @brief Holds `check` (entered).
    explicit guard(thread_check& check) noexcept : check_(check) {}
    guard(const guard&)            = delete;
    guard& operator=(const guard&) = delete;
    ~guard()
    {
      if (--check_.depth_ == 0) { check_.owner_.store(std::thread::id{}, std::memory_order_release); }
    }

   private:
    thread_check& check_;
  };

  /// @brief Marks the calling thread inside until the returned guard goes.
  /// @throws error invalid_state if another thread is inside
  [[nodiscard]] guard enter(const char* what)
  {
    const std::thread::id me = std::this_thread::get_id();
    std::thread::id nobody{};
    if (!owner_.compare_exchange_strong(nobody, me, std::memory_order_acquire) && nobody != me) {
      std::ostringstream message;
      message << what << " called from thread " << me << " while thread " << nobody
              << " is inside this RoutingReplay; one thread must drive it (serialize the calls)";
      throw error{errc::invalid_state, message.str()};
    }
    ++depth_;
    return guard{*this};
  }

 private:
  std::atomic<std::thread::id> owner_{};
  int depth_ = 0;  // only the owner touches it
};
#else
/// @brief Release builds: no check, no cost.
class thread_check {
 public:
  /// @brief Nothing to mark.
  [[nodiscard]] static constexpr int enter(const char*) noexcept { return 0; }
};
#endif

}  // namespace routing_replay::detail
