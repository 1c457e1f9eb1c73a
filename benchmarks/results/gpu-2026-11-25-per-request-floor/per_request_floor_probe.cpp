// Per-request begin_step at decode B (host backend, device scatter, handles in the plan) against the
// floor of its work: per scheduled request, what any begin_step with these guarantees must read and
// write, done by a loop that does nothing else, on arrays shaped as the library's (80-byte request
// states, 144-byte storage entries, 56-byte runs, 40-byte pieces), in the same engine loop, so that
// the step's other work leaves the caches as cold for it as for begin_step. The floor loop, one pass:
// the plan entry read; the request's liveness (generation), duplicate stamp and position range
// checked; its storage entry read (fresh positions, room in the last segment) and its claim
// extended; a run and a piece written; the request's T and step serial written. No error paths, no
// second pass (the library validates the whole plan before it changes anything), no growth.
// Which of the two runs first after a step alternates. One JSON line per batch: medians over the
// last three quarters of the steps.
// Build: g++ -std=c++20 -O3 -DNDEBUG -pthread -I include -I benchmarks -I <cccl> per_request_floor_probe.cpp
// Arguments: steps (1500), cold (0; 1 sweeps 32 MB between steps, as an engine's other work would).
#include "bench_common.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

using namespace rr_bench;

namespace {

using replay_type = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major, rr::device_scatter<2>,
                                      rr::per_request_storage>;

struct state_like {  // request_state: 80 bytes
  const void* id;
  std::uint32_t generation;
  std::int64_t recorded_rows, prompt_length;
  std::uint64_t stamp, open_step, reads_step;
  void* drafts[3];
};
struct rows_like {  // per_request_store::request_rows: 144 bytes
  std::byte* view;
  std::size_t capacity, tail_start;
  std::byte* tail_address;
  std::int64_t claimed_end;
  std::size_t mapped;
  std::int64_t run_first, run_count;
  std::uint64_t run_serial;
  bool per_step;
  void* segments[3];
  void* claimed_by[3];
  std::uint64_t last_claim;
  bool adopted;
};
struct run_like {  // step_run: 56 bytes
  std::uint32_t handle, generation;
  std::int64_t first_row, first_position;
  std::int32_t num_tokens, num_draft;
  std::int64_t slots_begin, recorded_before, recorded_after;
};
struct op_like {  // scatter_op: 40 bytes
  std::int16_t* dst;
  const std::int16_t* copy_from;
  std::int64_t src, elems;
  bool replaces;
};
static_assert(sizeof(state_like) == 80 && sizeof(rows_like) == 144 && sizeof(run_like) == 56 && sizeof(op_like) == 40);

void run(int batch, int steps, int cold)
{
  const auto cfg = bench_config(8192, batch);
  replay_type replay{cfg};
  rr::host_stream stream;
  std::vector<rr::request_handle> handles;
  for (int r = 0; r < batch; ++r) { handles.push_back(replay.add_request(r)); }
  // the floor's structures: live requests with room for every position
  constexpr std::size_t row_bytes = std::size_t{bench_layers} * bench_topk * sizeof(std::int16_t);
  std::vector<state_like> states(static_cast<std::size_t>(batch));
  std::vector<rows_like> rows(static_cast<std::size_t>(batch));
  for (int r = 0; r < batch; ++r) {
    states[r]            = {};
    states[r].id         = &states[r];
    states[r].generation = handles[r].generation;
    rows[r]              = {};
    rows[r].capacity     = static_cast<std::size_t>(bench_model_len) * row_bytes;
    rows[r].tail_address = reinterpret_cast<std::byte*>(std::uintptr_t{1} << 40);
  }
  std::vector<run_like> runs;
  std::vector<op_like> ops;
  runs.reserve(static_cast<std::size_t>(batch));
  ops.reserve(static_cast<std::size_t>(batch));
  std::vector<char> sweep(cold != 0 ? (32u << 20) : 0);
  rr::step_plan plan;
  std::vector<double> begin_us, floor_us;
  std::int64_t position = 0;
  std::uint64_t serial  = 0, refused = 0;
  for (int i = 0; i < steps; ++i) {
    plan.clear();
    if (position + 1 > bench_model_len) { position = 0; }
    for (int r = 0; r < batch; ++r) { plan.schedule(handles[r], position, 1); }
    if (cold != 0) { std::memset(sweep.data(), i, sweep.size()); }
    auto touch = [&] {
      const auto t0 = std::chrono::steady_clock::now();
      ++serial;
      runs.clear();
      ops.clear();
      for (const auto& e : plan.entries()) {
        const rr::scheduled_request& s = e.request;
        const rr::request_handle h     = s.id.handle();
        state_like& st                 = states[h.index];
        if (st.id == nullptr || st.generation != h.generation || st.stamp == serial || s.first_position < 0 ||
            s.first_position > bench_model_len - s.num_tokens || s.num_draft_tokens != 0) {
          ++refused;
          continue;
        }
        st.stamp                = serial;
        rows_like& rw           = rows[h.index];
        const std::size_t begin = static_cast<std::size_t>(s.first_position) * row_bytes;
        if (s.first_position < rw.claimed_end) { ++refused; }  // a recomputed position: the long way
        if (begin < rw.tail_start || begin + static_cast<std::size_t>(s.num_tokens) * row_bytes > rw.capacity) {
          ++refused;
          continue;
        }
        auto* dst = reinterpret_cast<std::int16_t*>(reinterpret_cast<std::uintptr_t>(rw.tail_address) + (begin - rw.tail_start));
        runs.push_back({h.index, h.generation, e.first_row, s.first_position, s.num_tokens, 0, -1, st.recorded_rows,
                        s.first_position + s.num_tokens});
        ops.push_back({dst, nullptr, e.first_row * std::int64_t{bench_layers * bench_topk},
                       std::int64_t{s.num_tokens} * bench_layers * bench_topk, false});
        rw.run_count += s.num_tokens;
        rw.claimed_end = s.first_position + s.num_tokens;
        rw.last_claim  = serial;
        st.recorded_rows = s.first_position + s.num_tokens;
        st.open_step     = serial;
        st.reads_step    = serial;
      }
      return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    };
    const bool floor_first = (i & 1) != 0;
    double f               = floor_first ? touch() : 0.0;
    const auto t0          = std::chrono::steady_clock::now();
    replay.begin_step(plan, stream.ref());
    const auto t1 = std::chrono::steady_clock::now();
    if (!floor_first) { f = touch(); }
    ++position;
    rr::host_backend::bulk_async(std::int64_t{bench_layers} * batch * bench_topk,
                                 record_all_layers<replay_type::ref_type>{replay.ref(batch), batch}, stream.ref());
    replay.end_step(stream.ref());
    stream.synchronize();
    if (i >= steps / 4) {
      begin_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      floor_us.push_back(f);
    }
  }
  replay.drain();
  std::sort(begin_us.begin(), begin_us.end());
  std::sort(floor_us.begin(), floor_us.end());
  std::printf("{\"probe\": \"per_request_floor\", \"batch\": %d, \"cold\": %d, \"begin_us\": %.2f, \"floor_touch_us\": %.2f, "
              "\"refused\": %llu, \"runs\": %zu}\n",
              batch, cold, begin_us[begin_us.size() / 2], floor_us[floor_us.size() / 2],
              static_cast<unsigned long long>(refused), runs.size());
}

}  // namespace

int main(int argc, char** argv)
{
  const int steps = argc > 1 ? std::atoi(argv[1]) : 1500;
  const int cold  = argc > 2 ? std::atoi(argv[2]) : 0;
  run(1024, steps, cold);
  run(64, steps, cold);
}
