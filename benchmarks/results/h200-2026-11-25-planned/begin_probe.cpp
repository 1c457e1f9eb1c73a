// begin_step of per-request storage with a device scatter, decode, on the host backend (no GPU
// needed): `begin_us` and `end_us` medians over the last three quarters of the steps, one JSON line.
// Arguments: steps (1500), batch (1024), cold (0; 1 sweeps 32 MB between steps), stagger (0; 1
// puts request r (3 r mod 1024) positions ahead, so that a few requests grow in almost every step,
// as in an engine whose requests started at different times). Steps 70 to 119 go through
// do_begin() alone, for `valgrind --tool=callgrind --toggle-collect='do_begin*'` with 121 steps:
// past the lockstep requests' last growth.
// Build: g++ -std=c++20 -O3 -DNDEBUG -pthread -I include -I benchmarks -I <cccl> begin_probe.cpp
#include "bench_common.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

using namespace rr_bench;
using replay_type = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major, rr::device_scatter<2>,
                                      rr::per_request_storage>;

[[gnu::noinline]] void do_begin(replay_type& replay, const rr::step_plan& plan, rr::host_stream_ref s)
{
  replay.begin_step(plan, s);
}
[[gnu::noinline]] void do_other_begin(replay_type& replay, const rr::step_plan& plan, rr::host_stream_ref s)
{
  replay.begin_step(plan, s);
}
[[gnu::noinline]] void do_end(replay_type& replay, rr::host_stream_ref s) { replay.end_step(s); }

int main(int argc, char** argv)
{
  const int steps   = argc > 1 ? std::atoi(argv[1]) : 1500;
  const int batch   = argc > 2 ? std::atoi(argv[2]) : 1024;
  const int cold    = argc > 3 ? std::atoi(argv[3]) : 0;
  const int stagger = argc > 4 ? std::atoi(argv[4]) : 0;
  replay_type replay{bench_config(8192, batch)};  // N_max of an engine: one step of rows kept ahead (6.3 MB)
  rr::host_stream stream;
  std::vector<rr::request_handle> handles;
  for (int r = 0; r < batch; ++r) { handles.push_back(replay.add_request(r)); }
  std::vector<char> sweep(cold != 0 ? (32u << 20) : 0);
  rr::step_plan plan;
  std::vector<double> begin_us, end_us;
  std::int64_t position = 0;
  for (int i = 0; i < steps; ++i) {
    plan.clear();
    if (position + 1 + 1024 > bench_model_len) { position = 0; }  // wraps: positions are recomputed
    for (int r = 0; r < batch; ++r) { plan.schedule(handles[r], position + (stagger != 0 ? (r * 3) % 1024 : 0), 1); }
    if (cold != 0) { std::memset(sweep.data(), i, sweep.size()); }
    const auto t0 = std::chrono::steady_clock::now();
    if (i >= 70 && i < 120) {
      do_begin(replay, plan, stream.ref());
    } else {
      do_other_begin(replay, plan, stream.ref());
    }
    const auto t1 = std::chrono::steady_clock::now();
    ++position;
    rr::host_backend::bulk_async(std::int64_t{bench_layers} * batch * bench_topk,
                                 record_all_layers<replay_type::ref_type>{replay.ref(batch), batch}, stream.ref());
    stream.synchronize();
    const auto t2 = std::chrono::steady_clock::now();
    do_end(replay, stream.ref());
    const auto t3 = std::chrono::steady_clock::now();
    stream.synchronize();
    if (i >= steps / 4) {
      begin_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      end_us.push_back(std::chrono::duration<double, std::micro>(t3 - t2).count());
    }
  }
  replay.drain();
  std::sort(begin_us.begin(), begin_us.end());
  std::sort(end_us.begin(), end_us.end());
  std::printf("{\"probe\": \"begin_step\", \"batch\": %d, \"cold\": %d, \"stagger\": %d, \"begin_us\": %.2f, \"end_us\": %.2f}\n",
              batch, cold, stagger, begin_us[begin_us.size() / 2], end_us[end_us.size() / 2]);
}
