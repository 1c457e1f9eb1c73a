/// @file
/// within_deadline: runs a piece of a test under a watchdog. A hang cannot be recovered from, and a
/// test that hangs stalls CI instead of failing it: past the deadline the watchdog names what hung
/// and aborts the process.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
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

}  // namespace rr_test
