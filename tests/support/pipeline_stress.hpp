/// @file
/// Ordering checks of the copy pipeline on any backend:
/// - a stress run built to expose ordering bugs: large steps with tiny forwards, copies slowed
///   down on purpose, an engine that never waits for a step before planning the next (many steps
///   in flight), extraction in the middle of the pipeline; every row checked bit-exact;
/// - a gate that holds the copy stream shut: end_step() must still return, and the compute stream
///   must still finish its work, for as many steps as the ring holds (no host synchronization on
///   the compute stream, no compute-stream wait for a copy).
#pragma once

#include "synthetic_router.hpp"

#include <routing_replay/routing_replay.hpp>

#include <cuda/atomic>

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <random>
#include <thread>
#include <type_traits>
#include <vector>

namespace rr_test {

/// @brief A "kernel" that spins for about `microseconds`: on the copy stream it makes copies slow
/// relative to the forward.
struct spin_for {
  std::int64_t microseconds;

  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t) const noexcept
  {
#if defined(__CUDA_ARCH__)
    for (std::int64_t i = 0; i < microseconds; ++i) { __nanosleep(1000); }
#else
    std::this_thread::sleep_for(std::chrono::microseconds(microseconds));
#endif
  }
};

/// @brief A "kernel" that waits until the host opens the gate (a flag in pinned host memory).
struct wait_for_gate {
  int* flag;

  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t) const noexcept
  {
    cuda::atomic_ref<int, cuda::thread_scope_system> open{*flag};
    while (open.load(cuda::std::memory_order_acquire) == 0) {
#if defined(__CUDA_ARCH__)
      __nanosleep(1000);
#else
      std::this_thread::yield();
#endif
    }
  }
};

/// @brief The synthetic ids of the stress run: a pure function of (request, position), so a row
/// that belongs to another step (a write-after-read overwrite) cannot pass.
struct write_stress_ids {
  const row_meta* meta;
  std::int64_t* out;  // [rows, K]
  std::int32_t top_k;
  std::int32_t layer;
  std::int64_t num_experts;

  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t i) const noexcept
  {
    const row_meta& m = meta[i / top_k];
    out[i]            = routed_expert(m, layer, static_cast<std::int32_t>(i % top_k), num_experts);
  }
};

/// @brief Drives one RoutingReplay through many steps without ever waiting for a step's copy.
template <class RR>
class pipeline_driver {
 public:
  using backend = typename RR::backend_type;
  using index   = typename RR::index_type;
  static constexpr std::int32_t num_layers = 3;
  static constexpr std::int32_t top_k      = 4;
  static constexpr std::int64_t experts    = 100;
  static constexpr std::int64_t block_size = 16;
  static constexpr int meta_ring           = 8;  ///< host-written buffers: steps ahead of the GPU

  pipeline_driver(std::int32_t num_requests, std::int64_t max_len, std::int32_t max_rows)
    : num_requests_(num_requests),
      max_len_(max_len),
      max_rows_(max_rows),
      lib_(make_lib(config(num_requests, max_len, max_rows))),
      ids_(static_cast<std::size_t>(max_rows) * top_k),
      next_position_(static_cast<std::size_t>(num_requests), 0),
      slots_(static_cast<std::size_t>(num_requests))
  {
    for (int i = 0; i < meta_ring; ++i) {
      meta_host_.emplace_back(static_cast<std::size_t>(max_rows));
      meta_dev_.emplace_back(static_cast<std::size_t>(max_rows));
      meta_used_.emplace_back();
    }
    for (std::int32_t r = 0; r < num_requests; ++r) { lib_.add_request(r, {}); }
  }

  pipeline_driver(const pipeline_driver&)            = delete;
  pipeline_driver& operator=(const pipeline_driver&) = delete;
  ~pipeline_driver()
  {
    try {
      backend::synchronize(compute());  // forwards still read the meta and id buffers
    } catch (...) {
    }
  }

  RR& library() noexcept { return lib_; }
  typename backend::stream_ref compute() noexcept { return compute_.ref(); }
  typename backend::stream_ref copies() noexcept { return copy_stream_.ref(); }

  /// @brief One step: `tokens[r]` new tokens for request r (0: not scheduled). Enqueues the
  /// forward and ends the step; waits for nothing but the host buffer it is about to reuse.
  void step(const std::vector<std::int32_t>& tokens, std::int64_t copy_delay_us)
  {
    const int m = static_cast<int>(serial_++ % meta_ring);
    if (serial_ > meta_ring) { backend::synchronize(meta_used_[static_cast<std::size_t>(m)]); }
    routing_replay::step_plan plan;
    std::int64_t rows = 0;
    auto& meta        = meta_host_[static_cast<std::size_t>(m)];
    for (std::int32_t r = 0; r < num_requests_; ++r) {
      const std::int32_t n = tokens[static_cast<std::size_t>(r)];
      if (n == 0) { continue; }
      const std::int64_t first = next_position_[static_cast<std::size_t>(r)];
      auto& slots              = slots_[static_cast<std::size_t>(r)];  // the plan refers to them
      slots.clear();
      for (std::int64_t p = first; p < first + n; ++p) {
        meta[static_cast<std::size_t>(rows++)] = row_meta{r, p, 0};
        slots.push_back(r * max_len_ + p);
      }
      plan.schedule({r, first, n, 0, slots});
      next_position_[static_cast<std::size_t>(r)] += n;
    }
    if constexpr (std::is_same_v<typename RR::storage_type, routing_replay::block_slot_storage>) {
      if (serial_ == 1) {
        std::vector<std::int64_t> all(static_cast<std::size_t>(num_requests_ * max_len_ / block_size));
        for (std::size_t b = 0; b < all.size(); ++b) { all[b] = static_cast<std::int64_t>(b); }
        plan.add_fresh_blocks(all);
      }
    }
    auto s = compute();
    lib_.begin_step(plan, s);
    auto& dev = meta_dev_[static_cast<std::size_t>(m)];
    backend::copy_async(backend::data(dev), backend::data(meta), static_cast<std::size_t>(rows) * sizeof(row_meta), s);
    for (std::int32_t layer = 0; layer < num_layers; ++layer) {
      backend::bulk_async(rows * top_k, write_stress_ids{backend::data(dev), backend::data(ids_), top_k, layer, experts}, s);
      lib_.capture(layer, static_cast<const std::int64_t*>(backend::data(ids_)), rows, s, {});
    }
    backend::record(meta_used_[static_cast<std::size_t>(m)], s);
    if (copy_delay_us > 0 && RR::copy_type::uses_side_stream) {
      backend::bulk_async(1, spin_for{copy_delay_us}, copies());  // the copy of this step is slow
    }
    lib_.end_step(s);
  }

  /// @brief Extracts request `r` and checks every row it has so far.
  void check_request(std::int32_t r)
  {
    const auto got        = lib_.extract(r);
    const std::int64_t n  = next_position_[static_cast<std::size_t>(r)];
    REQUIRE(got.num_rows() == n);
    const auto flat = got.flat();
    for (std::int64_t p = 0; p < n; ++p) {
      for (std::int32_t l = 0; l < num_layers; ++l) {
        for (std::int32_t k = 0; k < top_k; ++k) {
          const auto expected = static_cast<index>(routed_expert(row_meta{r, p, 0}, l, k, experts));
          const auto value    = flat[static_cast<std::size_t>((p * num_layers + l) * top_k + k)];
          if (value != expected) {
            FAIL("request " << r << " position " << p << " layer " << l << " column " << k << ": got "
                            << +value << ", expected " << +expected);
          }
        }
      }
    }
    rows_checked_ += n;
  }

  [[nodiscard]] std::int64_t rows_checked() const noexcept { return rows_checked_; }
  [[nodiscard]] std::int64_t position(std::int32_t r) const { return next_position_[static_cast<std::size_t>(r)]; }

 private:
  static routing_replay::replay_config config(std::int32_t num_requests, std::int64_t max_len, std::int32_t max_rows)
  {
    routing_replay::replay_config c;
    c.num_experts         = experts;
    c.top_k               = top_k;
    c.max_tokens_per_step = max_rows;
    c.max_model_len       = max_len;
    c.moe_layers          = {0, 1, 2};
    c.block_size          = static_cast<std::int32_t>(block_size);
    c.num_blocks          = num_requests * max_len / block_size;
    return c;
  }

  RR make_lib(routing_replay::replay_config c)
  {
    if constexpr (RR::copy_type::uses_side_stream) {
      return RR{std::move(c), copy_stream_.ref()};  // the engine's own copy stream
    } else {
      return RR{std::move(c)};
    }
  }

  std::int32_t num_requests_;
  std::int64_t max_len_;
  std::int32_t max_rows_;
  typename backend::stream compute_;
  typename backend::stream copy_stream_;
  RR lib_;
  std::vector<typename backend::template pinned_vector<row_meta>> meta_host_;
  std::vector<typename backend::template device_vector<row_meta>> meta_dev_;
  std::vector<typename backend::event> meta_used_;
  typename backend::template device_vector<std::int64_t> ids_;
  std::vector<std::int64_t> next_position_;
  std::vector<std::vector<std::int64_t>> slots_;  // per request, for the plan being built
  std::uint64_t serial_       = 0;
  std::int64_t rows_checked_  = 0;
};

/// @brief The stress run: a large prefill of every request at once, then many tiny decode steps
/// with slow copies, extracting a random request every few steps while steps are in flight.
template <class RR>
void check_pipeline_stress(std::int64_t copy_delay_us, std::int32_t decode_steps)
{
  constexpr std::int32_t requests = 24;
  constexpr std::int64_t prompt   = 40;
  pipeline_driver<RR> d{requests, prompt + decode_steps + 8, static_cast<std::int32_t>(requests * prompt)};
  std::mt19937_64 rng{7};
  d.step(std::vector<std::int32_t>(requests, static_cast<std::int32_t>(prompt)), copy_delay_us);
  for (std::int32_t s = 0; s < decode_steps; ++s) {
    std::vector<std::int32_t> tokens(requests, 0);
    for (auto& t : tokens) { t = std::uniform_int_distribution<int>{0, 3}(rng) == 0 ? 0 : 1; }
    d.step(tokens, copy_delay_us);
    if (s % 5 == 4) {  // mid-pipeline: steps of this request may still be in flight
      d.check_request(std::uniform_int_distribution<std::int32_t>{0, requests - 1}(rng));
    }
  }
  for (std::int32_t r = 0; r < requests; ++r) { d.check_request(r); }
  CHECK(d.rows_checked() > requests * prompt);
}

/// @brief With the copy stream held shut, `ring_depth` steps still end without blocking and the
/// compute stream still finishes their forwards; once the gate opens, every row arrives intact.
template <class RR>
void check_compute_never_waits_for_copies()
{
  using backend = typename RR::backend_type;
  static_assert(RR::copy_type::uses_side_stream, "the gate holds the side stream");
  pipeline_driver<RR> d{4, 64, 64};
  typename backend::template pinned_vector<int> gate(1, 0);
  std::atomic<bool> finished{false};
  std::atomic<bool> timed_out{false};
  std::mutex m;
  std::condition_variable cv;
  auto open_gate = [&] { cuda::atomic_ref<int, cuda::thread_scope_system>{*backend::data(gate)}.store(1); };
  // a deadlock would hang the suite: after 30 s the watchdog opens the gate and reports it
  std::thread watchdog{[&] {
    std::unique_lock lock{m};
    if (!cv.wait_for(lock, std::chrono::seconds(30), [&] { return finished.load(); })) {
      timed_out = true;
      open_gate();
    }
  }};
  backend::bulk_async(1, wait_for_gate{backend::data(gate)}, d.copies());
  for (int s = 0; s < RR::copy_type::ring_depth; ++s) { d.step({3, 1, 0, 2}, 0); }
  backend::synchronize(d.compute());  // every forward done although no copy could start
  const bool compute_finished_while_shut = !timed_out.load();
  CHECK(d.library().steps_in_flight() == static_cast<std::size_t>(RR::copy_type::ring_depth));
  open_gate();
  {
    std::lock_guard lock{m};
    finished = true;
  }
  cv.notify_all();
  watchdog.join();
  CHECK_MESSAGE(compute_finished_while_shut, "end_step or the compute stream waited for a copy");
  for (std::int32_t r = 0; r < 4; ++r) {
    if (d.position(r) > 0) { d.check_request(r); }
  }
}

}  // namespace rr_test
