// begin_step of block-slot storage with a device scatter, prefill (each step 4 new requests of
// 2048 tokens in fresh KV blocks of 16, released once the step is filed), on the host backend (no
// GPU needed): `begin_us` and `end_us` medians over the last three quarters of the steps, one JSON
// line. Arguments: steps (400), requests a step (4), tokens a request (2048), keep (0; 1 keeps every
// request to the end, as the C++ engine loop's prefill scenario does), ahead (-1:
// replay_config::host_memory_ahead). Steps 20 to 39 go
// through do_begin() alone, for `valgrind --tool=callgrind --toggle-collect='do_begin*'`.
// Build: g++ -std=c++20 -O3 -DNDEBUG -pthread -I include -I benchmarks -I <cccl> prefill_probe.cpp
#include "bench_common.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

using namespace rr_bench;
using replay_type = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major, rr::device_scatter<2>,
                                      rr::block_slot_storage>;

[[gnu::noinline]] void do_begin(replay_type& replay, const rr::step_plan& plan, rr::host_stream_ref s)
{
  replay.begin_step(plan, s);
}
[[gnu::noinline]] void do_other_begin(replay_type& replay, const rr::step_plan& plan, rr::host_stream_ref s)
{
  replay.begin_step(plan, s);
}

int main(int argc, char** argv)
{
  const int steps     = argc > 1 ? std::atoi(argv[1]) : 400;
  const int per_step  = argc > 2 ? std::atoi(argv[2]) : 4;
  const int tokens    = argc > 3 ? std::atoi(argv[3]) : 2048;
  const int keep      = argc > 4 ? std::atoi(argv[4]) : 0;
  const long ahead    = argc > 5 ? std::atol(argv[5]) : -1;
  const int rows      = per_step * tokens;
  constexpr int block = 16;
  const int blocks_per_request = (tokens + block - 1) / block;
  // two steps' requests in the pool: a step's blocks were the step before last's (fresh again)
  rr::replay_config config = bench_config(rows, 2 * per_step);
  config.host_memory_ahead = ahead;
  replay_type replay{config};
  rr::host_stream stream;
  rr::step_plan plan;
  std::vector<std::int64_t> slots(static_cast<std::size_t>(rows));
  std::vector<std::int64_t> fresh;
  std::vector<double> begin_us, end_us;
  const std::int64_t region = bench_model_len / block;  // blocks of one request's region in the pool
  for (int i = 0; i < steps; ++i) {
    plan.clear();
    fresh.clear();
    std::vector<rr::request_handle> handles;
    for (int q = 0; q < per_step; ++q) {
      const std::int64_t id    = std::int64_t{i} * per_step + q;
      const std::int64_t first = ((i % 2) * per_step + q) * region;  // its first block
      handles.push_back(replay.add_request(id, {.prompt_length = tokens}));
      for (int b = 0; b < blocks_per_request; ++b) { fresh.push_back(first + b); }
      for (int t = 0; t < tokens; ++t) { slots[static_cast<std::size_t>(q * tokens + t)] = first * block + t; }
      plan.schedule({.id = handles.back(), .first_position = 0, .num_tokens = tokens, .num_draft_tokens = 0,
                     .slots = std::span<const std::int64_t>{slots}.subspan(static_cast<std::size_t>(q * tokens),
                                                                         static_cast<std::size_t>(tokens))});
    }
    plan.add_fresh_blocks(fresh);
    const auto t0 = std::chrono::steady_clock::now();
    if (i >= 20 && i < 40) {
      do_begin(replay, plan, stream.ref());
    } else {
      do_other_begin(replay, plan, stream.ref());
    }
    const auto t1 = std::chrono::steady_clock::now();
    rr::host_backend::bulk_async(std::int64_t{bench_layers} * rows * bench_topk,
                                 record_all_layers<replay_type::ref_type>{replay.ref(rows), rows}, stream.ref());
    stream.synchronize();
    const auto t2 = std::chrono::steady_clock::now();
    replay.end_step(stream.ref());
    const auto t3 = std::chrono::steady_clock::now();
    replay.drain();
    if (keep == 0) {
      for (const auto h : handles) { replay.release(h); }
    }
    if (i >= steps / 4) {
      begin_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      end_us.push_back(std::chrono::duration<double, std::micro>(t3 - t2).count());
    }
  }
  std::sort(begin_us.begin(), begin_us.end());
  std::sort(end_us.begin(), end_us.end());
  std::printf("{\"probe\": \"block_slot_prefill_begin\", \"requests\": %d, \"tokens\": %d, \"keep\": %d, \"ahead\": %ld, \"begin_us\": %.2f, \"end_us\": %.2f}\n",
              per_step, tokens, keep, ahead, begin_us[begin_us.size() / 2], end_us[end_us.size() / 2]);
}
