/// @file
/// An in-process stand-in for NCCL: ranks that run as threads of one process on the host backend
/// (tests, CI, CPU-expert engines) exchange rows through shared memory, with NCCL's ordering.
#pragma once

#include <routing_replay/errors.hpp>
#include <routing_replay/host_backend.hpp>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace routing_replay {

class thread_communicator;

/// @brief The shared state of `size` ranks that run as threads: an all-gather rendezvous and one
/// mailbox per ordered pair of ranks. Must outlive every communicator it hands out and every
/// operation they enqueued.
///
/// Operations run on the ranks' host streams (worker threads), so a collective blocks a stream, not
/// the thread that enqueued it, as on a GPU. A rank that waits longer than `timeout` for the others
/// fails its operation (backend_error, reported through the stream), so a mismatched schedule
/// fails a test instead of hanging it.
class thread_group {
 public:
  /// @brief A group of `size` ranks.
  explicit thread_group(int size, std::chrono::milliseconds timeout = std::chrono::seconds{60})
    : size_(size), timeout_(timeout), posted_(static_cast<std::size_t>(size))
  {
  }
  thread_group(const thread_group&)            = delete;
  thread_group& operator=(const thread_group&) = delete;

  /// @brief The communicator of `rank` (in [0, size)).
  [[nodiscard]] thread_communicator communicator(int rank) noexcept;
  /// @brief Ranks in the group.
  [[nodiscard]] int size() const noexcept { return size_; }

 private:
  friend class thread_communicator;

  // Two rendezvous per all-gather: every rank has posted its buffer; every rank has copied (so no
  // rank returns, and reuses its send buffer or posts again, while another still reads it).
  void all_gather(int rank, const void* send, void* recv, std::size_t bytes)
  {
    std::unique_lock lock{mutex_};
    posted_[static_cast<std::size_t>(rank)] = {send, bytes};
    rendezvous(lock, arrived_, gather_round_, rank, "all_gather");
    bool sizes_match = true;
    for (const auto& [data, size] : posted_) { sizes_match = sizes_match && size == bytes; }
    lock.unlock();
    if (sizes_match) {
      for (std::size_t r = 0; r < posted_.size(); ++r) {
        std::memcpy(static_cast<std::byte*>(recv) + r * bytes, posted_[r].first, bytes);
      }
    }
    lock.lock();
    rendezvous(lock, copied_, copy_round_, rank, "all_gather");
    if (!sizes_match) {
      throw error{errc::backend_error, "thread_communicator: rank " + std::to_string(rank) +
                                         " joined an all_gather whose ranks posted different sizes"};
    }
  }

  void send(int from, int to, const void* data, std::size_t bytes)
  {
    const auto* p = static_cast<const std::byte*>(data);
    std::lock_guard lock{mutex_};
    mail_[{from, to}].emplace_back(p, p + bytes);
    ++sent_[{from, to}];
    changed_.notify_all();
  }

  void recv(int to, int from, void* data, std::size_t bytes)
  {
    std::unique_lock lock{mutex_};
    auto& box = mail_[{from, to}];
    wait(lock, [&] { return !box.empty(); }, to,
         "recv of message " + std::to_string(received_[{from, to}] + 1) + " from rank " + std::to_string(from) +
           " (it has sent " + std::to_string(sent_[{from, to}]) + " to this rank)");
    ++received_[{from, to}];
    std::vector<std::byte> message = std::move(box.front());
    box.pop_front();
    lock.unlock();
    if (message.size() != bytes) {
      throw error{errc::backend_error, "thread_communicator: rank " + std::to_string(to) + " expected " +
                                         std::to_string(bytes) + " bytes from rank " + std::to_string(from) +
                                         ", got " + std::to_string(message.size())};
    }
    std::memcpy(data, message.data(), bytes);
  }

  void rendezvous(std::unique_lock<std::mutex>& lock, int& count, std::uint64_t& round, int rank, const char* what)
  {
    const std::uint64_t mine = round;
    if (++count == size_) {
      count = 0;
      ++round;
      changed_.notify_all();
      return;
    }
    wait(lock, [&] { return round != mine; }, rank, what);
  }

  template <class Ready>
  void wait(std::unique_lock<std::mutex>& lock, Ready ready, int rank, const std::string& what)
  {
    if (!changed_.wait_for(lock, timeout_, ready)) {
      throw error{errc::backend_error, "thread_communicator: rank " + std::to_string(rank) + " waited " +
                                         std::to_string(timeout_.count()) + " ms in " + what +
                                         " for the other ranks (mismatched schedules?)"};
    }
  }

  int size_;
  std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::pair<const void*, std::size_t>> posted_;  // this round's all-gather buffers
  int arrived_ = 0, copied_ = 0;
  std::uint64_t gather_round_ = 0, copy_round_ = 0;
  std::map<std::pair<int, int>, std::deque<std::vector<std::byte>>> mail_;  // (from, to) -> messages
  std::map<std::pair<int, int>, std::uint64_t> sent_, received_;  // (from, to) -> messages so far, for errors
};

/// @brief One rank's handle on a thread_group: a `communicator` over host streams. Trivially
/// copyable; the group must outlive it.
class thread_communicator {
 public:
  /// @brief This rank.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// @brief Ranks in the group.
  [[nodiscard]] int size() const noexcept { return group_->size(); }

  /// @brief Enqueues on `stream`: every rank's `bytes` from `send` land at `recv + r * bytes`.
  void all_gather_async(const void* send, void* recv, std::size_t bytes, host_stream_ref stream)
  {
    stream.queue().enqueue([g = group_, r = rank_, send, recv, bytes] { g->all_gather(r, send, recv, bytes); });
  }
  /// @brief Enqueues on `stream`: one message of `bytes` from `data` to `peer` (copied when it runs).
  void send_async(const void* data, std::size_t bytes, int peer, host_stream_ref stream)
  {
    stream.queue().enqueue([g = group_, r = rank_, data, bytes, peer] { g->send(r, peer, data, bytes); });
  }
  /// @brief Enqueues on `stream`: waits for the next message from `peer` and copies it to `data`.
  void recv_async(void* data, std::size_t bytes, int peer, host_stream_ref stream)
  {
    stream.queue().enqueue([g = group_, r = rank_, data, bytes, peer] { g->recv(r, peer, data, bytes); });
  }

 private:
  friend class thread_group;
  thread_communicator(thread_group* group, int rank) noexcept : group_(group), rank_(rank) {}
  thread_group* group_;
  int rank_;
};

inline thread_communicator thread_group::communicator(int rank) noexcept { return thread_communicator{this, rank}; }

}  // namespace routing_replay
