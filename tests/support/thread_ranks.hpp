/// @file
/// Ranks as threads of one process on the host backend, over a thread_group (the in-process
/// stand-in for NCCL): each thread runs one rank's body; failures are collected and checked on the
/// test's thread (an assertion that fails in a rank has been reported by doctest already).
#pragma once

#include <routing_replay/parallel/thread_communicator.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace rr_test {

/// @brief Runs `body(rank, communicator)` on `ranks` threads; every rank must end without an
/// exception. A rank left waiting for a failed one fails after 120 s instead of hanging (a limit
/// far above any wait of a correct schedule under ThreadSanitizer on a loaded 2-core machine).
inline void on_thread_ranks(int ranks, const std::function<void(int, routing_replay::thread_communicator)>& body)
{
  routing_replay::thread_group group{ranks, std::chrono::seconds{120}};
  std::vector<std::string> failures(static_cast<std::size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      // each rank its own host device, as ranks on GPUs each have theirs: memory one rank frees
      // then waits for its own streams, never for a peer's stream blocked in a recv from it
      routing_replay::host_backend::set_device(r);
      try {
        body(r, group.communicator(r));
      } catch (const std::exception& e) {
        failures[static_cast<std::size_t>(r)] = e.what();
      } catch (...) {
        failures[static_cast<std::size_t>(r)] = "assertion failed";
      }
    });
  }
  for (auto& t : threads) { t.join(); }
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    CHECK(failures[static_cast<std::size_t>(r)] == "");
  }
}

}  // namespace rr_test
