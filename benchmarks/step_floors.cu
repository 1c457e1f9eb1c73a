// begin_step and end_step of the common decode step (CUDA backend, int16, layer_major, device
// scatter, per-request storage, requests named by handle) against the floor of each, timed in
// alternation in the same GPU engine loop, so that both see the same caches and the same GPU.
//
// begin_step's floor: per scheduled request, what any begin_step with the library's guarantees must
// read and write, in a loop that does nothing else, on arrays of the library's current shapes (a
// 64-byte-aligned request state and storage entry whose hot fields share one line, 56-byte runs,
// 40-byte pieces): the plan entry; the request's liveness (generation), duplicate stamp and position
// range; its storage entry (fresh positions, room in the last segment) and claim; the run and the
// piece; its T and step serial. No error paths, no second pass, no growth.
//
// end_step's floor: the CUDA calls any end_step of a side-stream copy must make, with nothing else
// around them: a kernel launch on the compute stream (the end-of-step kernel: snapshot and reset),
// an event recorded behind it, the copy stream made to wait on that event, a kernel launch on the
// copy stream (the scatter), an event recorded behind it, and a query of the previous step's event
// (is there a step to file?). Both kernels do nothing and take an argument block of the size the
// library's kernels take (launch_async, as the library launches them). The ops' 40 bytes a
// request, which end_step copies into pinned memory for the scatter, are not in the floor.
//
// Two orders, as the two engine loops run them:
// - "engine" (benchmarks/engine_loop, C++): begin, forward enqueued, end while the GPU runs the
//   forward, synchronize; caches as the loop leaves them;
// - "python" (benchmarks/python/engine_loop.py): caches swept (32 MB) before begin, forward,
//   synchronize, caches swept again, end: what a Python engine's work between the calls leaves.
// One JSON line per (batch, order): medians over the last three quarters of the steps; `refused`
// counts the floor's refusals and requests not filed in full (0 in a valid run).
// docs/performance.md ("Floors") quotes it.
//
// Usage: step_floors [--steps 1200] [--forward-us 300 (the spin kernel that stands for the forward)]
//                    [--batches 1024,64] [--orders engine,python]
// Exits 77 (skipped) where no GPU is usable, 2 on bad usage.
#include "bench_common.hpp"

#include <routing_replay/routing_replay.cuh>

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

using replay_type = rr::RoutingReplay<rr::cuda_backend, std::int16_t, rr::layer_major, rr::device_scatter<2>,
                                      rr::per_request_storage>;
using clock_type = std::chrono::steady_clock;

double micros(clock_type::time_point a, clock_type::time_point b)
{
  return std::chrono::duration<double, std::micro>(b - a).count();
}

void check(cudaError_t e, const char* what)
{
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

/// The forward's GPU time, without its host work: one thread spins on the global timer.
__global__ void spin(long long ns)
{
  unsigned long long start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (static_cast<long long>(now - start) < ns);
}

/// A kernel argument block of the scatter's size that does nothing.
struct no_op {
  const void* a;
  const void* b;
  const void* c;
  const void* d;
  const void* e;
  std::int32_t n, m;
  __host__ __device__ void operator()(std::int32_t, std::int32_t) const noexcept {}
};
static_assert(sizeof(no_op) == sizeof(rr::detail::scatter_rows<std::int16_t>));

struct alignas(64) state_like {  // request_state: its hot fields in the first line
  const void* id;
  std::uint32_t generation;
  std::int64_t recorded_rows;
  std::uint64_t stamp, open_step, reads_step;
};
struct alignas(64) rows_like {  // per_request_store::request_rows: its hot line
  std::size_t capacity, tail_start;
  std::byte* tail_address;
  std::int64_t claimed_end;
  std::int64_t run_first;
  std::uint64_t run_serial;
  std::int32_t run_count;
  bool per_step;
  std::uint64_t last_claim;
};
struct run_like {  // step_run
  std::uint32_t handle, generation;
  std::int64_t first_row, first_position;
  std::int32_t num_tokens, num_draft;
  std::int64_t slots_begin, recorded_before, recorded_after;
};
struct op_like {  // scatter_op
  std::int16_t* dst;
  const std::int16_t* copy_from;
  std::int64_t src, elems;
  bool replaces;
};
static_assert(sizeof(rows_like) == 64 && sizeof(run_like) == sizeof(rr::step_run) &&
              sizeof(op_like) == sizeof(rr::detail::scatter_op<std::int16_t>));

double median(std::vector<double> v)
{
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void run(int batch, int steps, bool python_order, long long forward_ns)
{
  const auto cfg = bench_config(8192, batch);
  cudaStream_t compute_raw = nullptr, copy_raw = nullptr;
  check(cudaStreamCreateWithFlags(&compute_raw, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cudaStreamCreateWithFlags(&copy_raw, cudaStreamNonBlocking), "cudaStreamCreate");
  const cuda::stream_ref compute{compute_raw};
  const cuda::stream_ref copy{copy_raw};
  std::vector<double> begin_us, begin_floor_us, end_us, end_floor_us;
  std::uint64_t refused = 0;  // the floor's refusals, and requests not filed in full: 0
  {
    replay_type replay{cfg};
    std::vector<rr::request_handle> handles;
    for (int r = 0; r < batch; ++r) { handles.push_back(replay.add_request(r)); }
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
    cudaEvent_t snapshot_taken[2], copied[2];
    for (int k = 0; k < 2; ++k) {
      check(cudaEventCreateWithFlags(&snapshot_taken[k], cudaEventDisableTiming), "cudaEventCreate");
      check(cudaEventCreateWithFlags(&copied[k], cudaEventDisableTiming), "cudaEventCreate");
    }
    std::vector<char> sweep(python_order ? (32u << 20) : 0);
    rr::step_plan plan;
    std::int64_t position = 0;
    std::uint64_t serial  = 0;

    auto begin_floor = [&] {
      const auto t0 = clock_type::now();
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
        auto* dst = reinterpret_cast<std::int16_t*>(reinterpret_cast<std::uintptr_t>(rw.tail_address) +
                                                    (begin - rw.tail_start));
        runs.push_back({h.index, h.generation, e.first_row, s.first_position, s.num_tokens, 0, -1, st.recorded_rows,
                        s.first_position + s.num_tokens});
        ops.push_back({dst, nullptr, e.first_row * std::int64_t{bench_layers * bench_topk},
                       std::int64_t{s.num_tokens} * bench_layers * bench_topk, false});
        rw.run_count += s.num_tokens;
        rw.claimed_end   = s.first_position + s.num_tokens;
        rw.last_claim    = serial;
        st.recorded_rows = s.first_position + s.num_tokens;
        st.open_step     = serial;
        st.reads_step    = serial;
      }
      return micros(t0, clock_type::now());
    };
    int floor_slot = 0;
    auto end_floor = [&] {
      const auto t0 = clock_type::now();
      rr::cuda_backend::launch_async(1, 32, no_op{}, compute);
      check(cudaEventRecord(snapshot_taken[floor_slot], compute_raw), "cudaEventRecord");
      check(cudaStreamWaitEvent(copy_raw, snapshot_taken[floor_slot], 0), "cudaStreamWaitEvent");
      rr::cuda_backend::launch_async(1, 32, no_op{}, copy);
      check(cudaEventRecord(copied[floor_slot], copy_raw), "cudaEventRecord");
      (void)cudaEventQuery(copied[floor_slot ^ 1]);
      floor_slot ^= 1;
      return micros(t0, clock_type::now());
    };
    auto sweep_caches = [&](int i) {
      if (python_order) { std::memset(sweep.data(), i, sweep.size()); }
    };

    for (int i = 0; i < steps; ++i) {
      plan.clear();
      if (position + 1 > bench_model_len) { position = 0; }
      for (int r = 0; r < batch; ++r) { plan.schedule(handles[r], position, 1); }
      const bool floor_first = (i & 1) != 0;
      sweep_caches(i);
      double bf = floor_first ? begin_floor() : 0.0;
      const auto b0 = clock_type::now();
      replay.begin_step(plan, compute);
      const auto b1 = clock_type::now();
      if (!floor_first) { bf = begin_floor(); }
      ++position;
      spin<<<1, 1, 0, compute_raw>>>(forward_ns);
      rr::cuda_backend::bulk_async(std::int64_t{bench_layers} * batch * bench_topk,
                                   record_all_layers<replay_type::ref_type>{replay.ref(batch), batch}, compute);
      if (python_order) {
        check(cudaStreamSynchronize(compute_raw), "cudaStreamSynchronize");
        sweep_caches(i + 1);
      }
      double ef = floor_first ? end_floor() : 0.0;
      const auto e0 = clock_type::now();
      replay.end_step(compute);
      const auto e1 = clock_type::now();
      if (!floor_first) { ef = end_floor(); }
      check(cudaStreamSynchronize(compute_raw), "cudaStreamSynchronize");
      if (i >= steps / 4) {
        begin_us.push_back(micros(b0, b1));
        begin_floor_us.push_back(bf);
        end_us.push_back(micros(e0, e1));
        end_floor_us.push_back(ef);
      }
    }
    replay.drain();
    check(cudaStreamSynchronize(copy_raw), "cudaStreamSynchronize");
    // every step was filed: each request's T is the number of steps
    for (int r = 0; r < batch; ++r) {
      if (replay.recorded_rows(r) != steps) { ++refused; }
    }
    for (int k = 0; k < 2; ++k) {
      cudaEventDestroy(snapshot_taken[k]);
      cudaEventDestroy(copied[k]);
    }
  }
  cudaStreamDestroy(compute_raw);
  cudaStreamDestroy(copy_raw);
  std::printf("{\"bench\": \"step_floor\", \"batch\": %d, \"order\": \"%s\", \"begin_us\": %.2f, \"begin_floor_us\": %.2f, "
              "\"end_us\": %.2f, \"end_floor_us\": %.2f, \"refused\": %llu, \"steps\": %zu}\n",
              batch, python_order ? "python" : "engine", median(begin_us), median(begin_floor_us), median(end_us),
              median(end_floor_us), static_cast<unsigned long long>(refused), begin_us.size());
  std::fflush(stdout);
}

int usage(const char* program)
{
  std::fprintf(stderr,
               "usage: %s [--steps N (1200)] [--forward-us US (300)] [--batches 1024,64] [--orders engine,python]\n",
               program);
  return 2;
}

std::vector<int> parse_batches(const std::string& list)
{
  std::vector<int> out;
  std::size_t at = 0;
  while (at <= list.size()) {
    const std::size_t comma = std::min(list.find(',', at), list.size());
    const int b             = std::atoi(list.substr(at, comma - at).c_str());
    if (b < 1 || b > 8192) { return {}; }
    out.push_back(b);
    at = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv)
{
  int steps             = 1200;
  long long forward_us  = 300;
  std::string batches   = "1024,64";
  std::string orders    = "engine,python";
  for (int a = 1; a < argc; ++a) {
    const std::string flag = argv[a];
    if (a + 1 >= argc) { return usage(argv[0]); }
    const char* value = argv[++a];
    if (flag == "--steps") {
      steps = std::atoi(value);
    } else if (flag == "--forward-us") {
      forward_us = std::atoll(value);
    } else if (flag == "--batches") {
      batches = value;
    } else if (flag == "--orders") {
      orders = value;
    } else {
      return usage(argv[0]);
    }
  }
  const std::vector<int> batch_list = parse_batches(batches);
  if (steps < 4 || forward_us < 0 || batch_list.empty()) { return usage(argv[0]); }
  if (!rr::cuda_backend::available()) {
    std::fprintf(stderr, "step_floors: no usable CUDA device: skipped\n");
    return 77;
  }
  for (const bool python_order : {false, true}) {
    if (("," + orders + ",").find(python_order ? ",python," : ",engine,") == std::string::npos) { continue; }
    for (const int batch : batch_list) { run(batch, steps, python_order, forward_us * 1000); }
  }
}
