// Block-slot begin_step against the floor of its memory accesses (host backend, device scatter,
// int16, layer_major): per scheduled row, what any block-slot store must read and write whatever its
// code, done by a loop that does nothing else, on arrays of the store's shapes, in the same engine
// loop. The two alternate which runs first after each step, so the step's other work leaves the
// caches the same for both. docs/performance.md ("Floors") quotes both scenarios:
//
// - decode_B1024: 1024 requests decode one token each, every request in its own KV region (a random
//   place in the pool, as an engine's block table gives it). Per request: the position map's entry
//   (written), the slot's state (read and written) and its block's generation (read).
// - prefill_8k: 4 new requests of 2048 tokens a step in fresh 16-slot KV blocks, released once filed.
//   Per row: the slot checked (in the pool, not twice in the step: a stamp read and written), its
//   block's generation read, the position's 24-byte mapping and the slot's 16-byte claim written,
//   and the row placed (rows to consecutive slots gathered into one piece).
//
// One JSON line per scenario: medians over the last three quarters of the steps of begin_step and of
// the floor's loop. The floor has no error paths and no second pass: the gap between the two is what
// the store's code costs beyond reaching its lines.
//
// Usage: block_slot_floors [--scenarios decode_B1024,prefill_8k] [--decode-steps 1500]
//                          [--prefill-steps 400] [--host-memory-ahead BYTES (67108864)]
#include "bench_common.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

using namespace rr_bench;

namespace {

using replay_type = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major, rr::device_scatter<2>,
                                      rr::block_slot_storage>;
using clock_type  = std::chrono::steady_clock;

double micros(clock_type::time_point a, clock_type::time_point b)
{
  return std::chrono::duration<double, std::micro>(b - a).count();
}

double median(std::vector<double> v)
{
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct slot_like {  // block_slot_store's per-slot state: the claim and the validation stamp
  std::uint64_t claimed_by_step;
  std::uint32_t claimed_in;
  std::uint32_t stamp;
};
struct position_like {  // block_slot_store's position entry (24 bytes)
  std::int32_t slot;
  std::uint32_t generation;
  std::int32_t before_slot;
  std::uint32_t before_generation;
  std::uint64_t mapped_by;
};
struct piece_like {  // a range of consecutive slots the scatter writes
  std::int64_t slot;
  std::int64_t row;
  std::int64_t rows;
};

void print(const char* scenario, int rows, long ahead, const std::vector<double>& begin_us,
           const std::vector<double>& floor_us, std::uint64_t sink)
{
  std::printf("{\"bench\": \"block_slot_floor\", \"scenario\": \"%s\", \"rows\": %d, \"host_memory_ahead\": %ld, "
              "\"begin_us\": %.2f, \"floor_us\": %.2f, \"steps\": %zu, \"sink\": %llu}\n",
              scenario, rows, ahead, median(begin_us), median(floor_us), begin_us.size(),
              static_cast<unsigned long long>(sink % 7));
  std::fflush(stdout);
}

void decode(int steps)
{
  constexpr int batch = 1024;
  const auto config   = bench_config(batch, batch);
  replay_type replay{config};
  rr::host_stream stream;
  std::vector<rr::request_handle> handles;
  for (int r = 0; r < batch; ++r) { handles.push_back(replay.add_request(r)); }
  std::vector<std::int64_t> slots(batch);
  std::vector<slot_like> slot_state(static_cast<std::size_t>(config.num_blocks * config.block_size));
  std::vector<std::uint32_t> generation(static_cast<std::size_t>(config.num_blocks), 1u);
  std::vector<std::vector<position_like>> maps(batch);
  rr::step_plan plan;
  std::vector<double> begin_us, floor_us;
  std::int64_t position = 0;
  std::uint64_t sink    = 0;
  for (int i = 0; i < steps; ++i) {
    plan.clear();
    if (position + 1 > bench_model_len) { position = 0; }
    for (int r = 0; r < batch; ++r) {
      slots[r] = std::int64_t{r} * bench_model_len + position;
      plan.schedule({handles[r], position, 1, 0, std::span<const std::int64_t>{&slots[r], 1}});
    }
    const auto floor_loop = [&] {
      const auto t0 = clock_type::now();
      for (int r = 0; r < batch; ++r) {
        const auto s  = static_cast<std::size_t>(slots[r]);
        slot_like& st = slot_state[s];
        sink += generation[s / static_cast<std::size_t>(config.block_size)];
        st.claimed_by_step = static_cast<std::uint64_t>(i);
        st.stamp           = static_cast<std::uint32_t>(i);
        auto& map          = maps[r];
        if (map.size() <= static_cast<std::size_t>(position)) { map.emplace_back(); }
        map[static_cast<std::size_t>(position)].mapped_by = static_cast<std::uint64_t>(i);
      }
      return micros(t0, clock_type::now());
    };
    const bool floor_first = (i & 1) != 0;
    double floor           = floor_first ? floor_loop() : 0.0;
    const auto t0          = clock_type::now();
    replay.begin_step(plan, stream.ref());
    const auto t1 = clock_type::now();
    if (!floor_first) { floor = floor_loop(); }
    ++position;
    rr::host_backend::bulk_async(std::int64_t{bench_layers} * batch * bench_topk,
                                 record_all_layers<replay_type::ref_type>{replay.ref(batch), batch}, stream.ref());
    replay.end_step(stream.ref());
    stream.synchronize();
    if (i >= steps / 4) {
      begin_us.push_back(micros(t0, t1));
      floor_us.push_back(floor);
    }
  }
  replay.drain();
  print("decode_B1024", batch, config.host_memory_ahead, begin_us, floor_us, sink);
}

void prefill(int steps, long ahead)
{
  constexpr int per_step           = 4;
  constexpr int tokens             = 2048;
  constexpr int rows               = per_step * tokens;
  constexpr int block              = 16;
  constexpr int blocks_per_request = tokens / block;
  rr::replay_config config         = bench_config(rows, 2 * per_step);
  config.host_memory_ahead         = ahead;
  replay_type replay{config};
  rr::host_stream stream;
  rr::step_plan plan;
  std::vector<std::int64_t> slots(static_cast<std::size_t>(rows));
  std::vector<std::int64_t> fresh;
  std::vector<slot_like> slot_state(static_cast<std::size_t>(config.num_blocks * config.block_size));
  std::vector<std::uint32_t> generation(static_cast<std::size_t>(config.num_blocks), 1u);
  std::vector<std::vector<position_like>> maps(per_step, std::vector<position_like>(tokens));
  std::vector<piece_like> pieces;
  pieces.reserve(rows);
  std::vector<double> begin_us, floor_us;
  std::uint64_t sink        = 0;
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
    const auto step       = static_cast<std::uint64_t>(i + 1);
    const auto floor_loop = [&] {
      const auto t0 = clock_type::now();
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
          if (!pieces.empty() && pieces.back().slot + pieces.back().rows == s &&
              pieces.back().row + pieces.back().rows == row) {
            ++pieces.back().rows;
          } else {
            pieces.push_back({s, row, 1});
          }
        }
      }
      sink += pieces.size();
      return micros(t0, clock_type::now());
    };
    const bool floor_first = (i & 1) != 0;
    double floor           = floor_first ? floor_loop() : 0.0;
    const auto t0          = clock_type::now();
    replay.begin_step(plan, stream.ref());
    const auto t1 = clock_type::now();
    if (!floor_first) { floor = floor_loop(); }
    rr::host_backend::bulk_async(std::int64_t{bench_layers} * rows * bench_topk,
                                 record_all_layers<replay_type::ref_type>{replay.ref(rows), rows}, stream.ref());
    stream.synchronize();
    replay.end_step(stream.ref());
    replay.drain();
    for (const auto h : handles) { replay.release(h); }
    if (i >= steps / 4) {
      begin_us.push_back(micros(t0, t1));
      floor_us.push_back(floor);
    }
  }
  print("prefill_8k", rows, ahead, begin_us, floor_us, sink);
}

int usage(const char* program)
{
  std::fprintf(stderr,
               "usage: %s [--scenarios decode_B1024,prefill_8k] [--decode-steps N (1500)] [--prefill-steps N (400)] "
               "[--host-memory-ahead BYTES (67108864)]\n",
               program);
  return 2;
}

}  // namespace

int main(int argc, char** argv)
{
  std::string scenarios = "decode_B1024,prefill_8k";
  int decode_steps      = 1500;
  int prefill_steps     = 400;
  long ahead            = 67108864L;
  for (int a = 1; a < argc; ++a) {
    const std::string flag = argv[a];
    if (a + 1 >= argc) { return usage(argv[0]); }
    const char* value = argv[++a];
    if (flag == "--scenarios") {
      scenarios = value;
    } else if (flag == "--decode-steps") {
      decode_steps = std::atoi(value);
    } else if (flag == "--prefill-steps") {
      prefill_steps = std::atoi(value);
    } else if (flag == "--host-memory-ahead") {
      ahead = std::atol(value);
    } else {
      return usage(argv[0]);
    }
  }
  if (decode_steps < 4 || prefill_steps < 4) { return usage(argv[0]); }
  const auto wants = [&](const char* name) {
    return ("," + scenarios + ",").find(std::string{","} + name + ",") != std::string::npos;
  };
  if (wants("decode_B1024")) { decode(decode_steps); }
  if (wants("prefill_8k")) { prefill(prefill_steps, ahead); }
}
