// begin_step of block-slot storage with a device scatter, decode (B requests of 1024 prompt
// positions, one new position each a step, each request in its own KV region), on the host
// backend: `begin_us` median over the last three quarters of the steps, one JSON line. Arguments:
// steps (600), batch (1024), cold (0; 1 sweeps 32 MB between steps, as an engine's forward would).
// Build: g++ -std=c++20 -O3 -DNDEBUG -pthread -I include -I benchmarks -I <cccl> decode_probe.cpp
#include "bench_common.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

using namespace rr_bench;
using replay_type = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major, rr::device_scatter<2>,
                                      rr::block_slot_storage>;

int main(int argc, char** argv)
{
  const int steps = argc > 1 ? std::atoi(argv[1]) : 600;
  const int batch = argc > 2 ? std::atoi(argv[2]) : 1024;
  const int cold  = argc > 3 ? std::atoi(argv[3]) : 0;
  constexpr std::int64_t block  = 16;
  const std::int64_t region     = bench_model_len;  // slots of one request's KV region
  replay_type replay{bench_config(8192, batch)};
  rr::host_stream stream;
  std::vector<rr::request_handle> handles;
  std::vector<std::int64_t> slots(static_cast<std::size_t>(batch));
  std::vector<char> sweep(cold != 0 ? (32u << 20) : 0);
  rr::step_plan plan;
  // the prompts, 1024 positions each, 8 requests a step (not timed)
  for (int r = 0; r < batch; ++r) { handles.push_back(replay.add_request(r)); }
  std::vector<std::int64_t> prompt(1024);
  for (int r = 0; r < batch; ++r) {
    plan.clear();
    for (int t = 0; t < 1024; ++t) { prompt[static_cast<std::size_t>(t)] = r * region + t; }
    plan.schedule({.id = handles[static_cast<std::size_t>(r)], .first_position = 0, .num_tokens = 1024, .num_draft_tokens = 0,
                   .slots = prompt});
    replay.begin_step(plan, stream.ref());
    rr::host_backend::bulk_async(std::int64_t{bench_layers} * 1024 * bench_topk,
                                 record_all_layers<replay_type::ref_type>{replay.ref(1024), 1024}, stream.ref());
    replay.end_step(stream.ref());
  }
  replay.drain();
  std::vector<double> begin_us;
  std::int64_t position = 1024;
  for (int i = 0; i < steps; ++i) {
    plan.clear();
    if (position + 1 > bench_model_len) { position = 1024; }  // wraps: positions are recomputed
    for (int r = 0; r < batch; ++r) {
      slots[static_cast<std::size_t>(r)] = r * region + position;
      plan.schedule({.id = handles[static_cast<std::size_t>(r)], .first_position = position, .num_tokens = 1,
                     .num_draft_tokens = 0, .slots = std::span<const std::int64_t>{slots}.subspan(static_cast<std::size_t>(r), 1)});
    }
    if (cold != 0) { std::memset(sweep.data(), i, sweep.size()); }
    const auto t0 = std::chrono::steady_clock::now();
    replay.begin_step(plan, stream.ref());
    const auto t1 = std::chrono::steady_clock::now();
    ++position;
    rr::host_backend::bulk_async(std::int64_t{bench_layers} * batch * bench_topk,
                                 record_all_layers<replay_type::ref_type>{replay.ref(batch), batch}, stream.ref());
    replay.end_step(stream.ref());
    stream.synchronize();
    if (i >= steps / 4) { begin_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count()); }
  }
  replay.drain();
  std::sort(begin_us.begin(), begin_us.end());
  std::printf("{\"probe\": \"block_slot_decode_begin\", \"batch\": %d, \"cold\": %d, \"begin_us\": %.2f}\n", batch, cold,
              begin_us[begin_us.size() / 2]);
}
