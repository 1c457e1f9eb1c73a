// Block-slot begin_step at prefill 8k (4 new requests of 2048 tokens a step, in fresh KV blocks of
// 16, released once filed; device scatter, host backend) against the floor of what any block-slot
// store must do per row, whatever its code: check the slot (in the pool, not twice in the step: a
// stamp read and written), read its block's generation, write the position's mapping (24 bytes,
// as block_slot_store's), write the slot's claim (16 bytes), and place the row (rows to
// consecutive slots gathered into one piece). The floor's loop runs on arrays of the store's
// shapes in the same engine loop, alternating with begin_step which of the two runs first, so the
// step's other work leaves the caches the same for both. One JSON line: medians over the last three
// quarters of the steps. Arguments: steps (400), ahead (67108864: replay_config::host_memory_ahead).
// Build: g++ -std=c++20 -O3 -DNDEBUG -pthread -I include -I benchmarks -I <cccl> <this file>
#include "bench_common.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

using namespace rr_bench;
using replay_type = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major, rr::device_scatter<2>,
                                      rr::block_slot_storage>;

namespace {
struct slot_like {  // block_slot_store::slot_state
  std::uint64_t claimed_by_step;
  std::uint32_t claimed_in;
  std::uint32_t stamp;
};
struct position_like {  // block_slot_store::position_ref
  std::int32_t slot;
  std::uint32_t generation;
  std::int32_t before_slot;
  std::uint32_t before_generation;
  std::uint64_t mapped_by;
};
struct piece_like {
  std::int64_t slot;
  std::int64_t row;
  std::int64_t rows;
};
}  // namespace

int main(int argc, char** argv)
{
  const int steps     = argc > 1 ? std::atoi(argv[1]) : 400;
  const long ahead    = argc > 2 ? std::atol(argv[2]) : 67108864L;
  constexpr int per_step = 4;
  constexpr int tokens   = 2048;
  constexpr int rows     = per_step * tokens;
  constexpr int block    = 16;
  constexpr int blocks_per_request = tokens / block;
  rr::replay_config config = bench_config(rows, 2 * per_step);
  config.host_memory_ahead = ahead;
  replay_type replay{config};
  rr::host_stream stream;
  rr::step_plan plan;
  std::vector<std::int64_t> slots(static_cast<std::size_t>(rows));
  std::vector<std::int64_t> fresh;
  // the floor's structures, shaped as the store's: a slot state per slot, a generation per block,
  // a position map per request (kept allocated, as the store's pages are), the step's pieces
  std::vector<slot_like> slot_state(static_cast<std::size_t>(config.num_blocks * config.block_size));
  std::vector<std::uint32_t> generation(static_cast<std::size_t>(config.num_blocks), 1u);
  std::vector<std::vector<position_like>> maps(per_step, std::vector<position_like>(tokens));
  std::vector<piece_like> pieces;
  pieces.reserve(rows);
  std::vector<double> begin_us, floor_us;
  std::uint64_t sink = 0;
  const std::int64_t region = bench_model_len / block;
  for (int i = 0; i < steps; ++i) {
    plan.clear();
    fresh.clear();
    std::vector<rr::request_handle> handles;
    for (int q = 0; q < per_step; ++q) {
      const std::int64_t id    = std::int64_t{i} * per_step + q;
      const std::int64_t first = ((i % 2) * per_step + q) * region;
      handles.push_back(replay.add_request(id, {.prompt_length = tokens}));
      for (int b = 0; b < blocks_per_request; ++b) { fresh.push_back(first + b); }
      for (int t = 0; t < tokens; ++t) { slots[static_cast<std::size_t>(q * tokens + t)] = first * block + t; }
      plan.schedule({.id = handles.back(), .first_position = 0, .num_tokens = tokens, .num_draft_tokens = 0,
                     .slots = std::span<const std::int64_t>{slots}.subspan(static_cast<std::size_t>(q * tokens),
                                                                         static_cast<std::size_t>(tokens))});
    }
    plan.add_fresh_blocks(fresh);
    const auto step = static_cast<std::uint64_t>(i + 1);
    const auto floor_loop = [&] {
      const auto t0 = std::chrono::steady_clock::now();
      for (const std::int64_t b : fresh) { ++generation[static_cast<std::size_t>(b)]; }
      for (const std::int64_t s : slots) {  // the check pass
        if (s < 0 || s >= static_cast<std::int64_t>(slot_state.size())) { std::abort(); }
        slot_like& st = slot_state[static_cast<std::size_t>(s)];
        if (st.stamp == static_cast<std::uint32_t>(step)) { std::abort(); }
        st.stamp = static_cast<std::uint32_t>(step);
      }
      pieces.clear();
      for (int q = 0; q < per_step; ++q) {  // the claim pass
        position_like* map = maps[static_cast<std::size_t>(q)].data();
        for (int t = 0; t < tokens; ++t) {
          const std::int64_t row = q * tokens + t;
          const std::int64_t s   = slots[static_cast<std::size_t>(row)];
          const std::uint32_t g  = generation[static_cast<std::size_t>(s / block)];
          map[t]                 = {static_cast<std::int32_t>(s), g, -1, 0u, step};
          slot_like& st          = slot_state[static_cast<std::size_t>(s)];
          st.claimed_in          = g;
          st.claimed_by_step     = step;
          if (!pieces.empty() && pieces.back().slot + pieces.back().rows == s && pieces.back().row + pieces.back().rows == row) {
            ++pieces.back().rows;
          } else {
            pieces.push_back({s, row, 1});
          }
        }
      }
      sink += pieces.size();
      return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    };
    const bool floor_first = (i & 1) != 0;  // which of the two runs first after the step alternates
    double floor           = floor_first ? floor_loop() : 0.0;
    const auto t0          = std::chrono::steady_clock::now();
    replay.begin_step(plan, stream.ref());
    const auto t1 = std::chrono::steady_clock::now();
    if (!floor_first) { floor = floor_loop(); }
    rr::host_backend::bulk_async(std::int64_t{bench_layers} * rows * bench_topk,
                                 record_all_layers<replay_type::ref_type>{replay.ref(rows), rows}, stream.ref());
    stream.synchronize();
    replay.end_step(stream.ref());
    replay.drain();
    for (const auto h : handles) { replay.release(h); }
    if (i >= steps / 4) {
      begin_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      floor_us.push_back(floor);
    }
  }
  std::sort(begin_us.begin(), begin_us.end());
  std::sort(floor_us.begin(), floor_us.end());
  std::printf("{\"probe\": \"block_slot_prefill_floor\", \"rows\": %d, \"ahead\": %ld, \"begin_us\": %.2f, \"floor_us\": %.2f, \"sink\": %llu}\n",
              rows, ahead, begin_us[begin_us.size() / 2], floor_us[floor_us.size() / 2],
              static_cast<unsigned long long>(sink % 7));
}
