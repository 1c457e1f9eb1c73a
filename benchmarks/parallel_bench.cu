/// @file
/// Parallel engines on two GPUs (one process per GPU, real NCCL; started without arguments it starts
/// its ranks, tests/support/nccl_ranks.cuh). One JSON line per measurement on each rank's stdout:
/// - sp_gather: GPU time a step's routing capture adds on the compute stream under sequence
///   parallelism (L = 48, K = 8, int16, decode B256 / B1024, prefill 8k), side by side:
///   "once_per_step" (this library: each rank captures its shard, one all-gather at end_step) and
///   "all_gather_per_layer" (what engines do today: all-gather each layer's int32 top-k ids, then
///   capture all rows on the output rank). The stream is held shut while the host enqueues, and the
///   ranks meet in a one-float all-reduce right before the timed work, so the time is the GPUs' own;
/// - capture_only_end_step: host time of end_step() on a tensor-parallel capture-only rank (one
///   reset of the rows written), and on the output rank for comparison;
/// - capture_only_host_alloc: bytes operator new hands out to build a capture-only rank and run 20
///   steps, for a small and a huge KV pool and max_model_len (O(1): equal).
/// The whole run takes seconds (45 iterations of each measurement). Every wait that can hang (the
/// ranks meeting in NCCL, stream synchronizations, drains) is under a watchdog per rank
/// (tests/support/deadline.hpp): no progress for RR_BENCH_STALL_S seconds (default 60) or a run past
/// RR_BENCH_DEADLINE_S (default 180) prints which rank waited in what (measurement, scenario,
/// approach, operation, iteration, layer), aborts its communicator and exits with 3.
#include "engine_loop_cuda.cuh"

#include "../tests/support/allocation_counter.hpp"
#include "../tests/support/deadline.hpp"
#include "../tests/support/nccl_ranks.cuh"

#include <routing_replay/parallel/nccl_communicator.cuh>
#include <routing_replay/parallel/parallel_replay.hpp>
#include <routing_replay/routing_replay.cuh>

#include <nv/target>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <string>
#include <vector>


namespace {

namespace rr = routing_replay;
using platform = rr_bench::cuda_platform;
using output   = rr::RoutingReplay<rr::cuda_backend, std::int16_t, rr::layer_major, rr::double_buffered<2>,
                                   rr::per_request_storage>;
using ranked   = rr::parallel_replay<output, rr::nccl_communicator>;

constexpr std::int32_t layers  = 48;
constexpr std::int32_t top_k   = 8;
constexpr std::int32_t experts = 128;
constexpr int warmup           = 5;
constexpr int iterations       = 40;

struct scenario {
  const char* name;
  std::int32_t requests;
  std::int32_t tokens;  // per request
  [[nodiscard]] std::int64_t rows() const { return std::int64_t{requests} * tokens; }
};
constexpr scenario scenarios[] = {{"decode_B256", 256, 1}, {"decode_B1024", 1024, 1}, {"prefill_8k", 4, 2048}};

rr::replay_config bench_config(std::int64_t num_blocks = 16, std::int64_t max_model_len = 4096)
{
  rr::replay_config c;
  c.num_experts         = experts;
  c.top_k               = top_k;
  c.max_tokens_per_step = 8192;
  c.max_model_len       = max_model_len;
  c.moe_layers.resize(layers);
  std::iota(c.moe_layers.begin(), c.moe_layers.end(), 0);
  c.block_size = 16;
  c.num_blocks = num_blocks;
  return c;
}

rr::step_plan plan_of(const scenario& s)
{
  rr::step_plan plan;
  for (std::int32_t r = 0; r < s.requests; ++r) { plan.schedule({r, 0, s.tokens}); }
  return plan;
}

// Keeps the GPU busy for `cycles` clock cycles: the head start the host needs to enqueue the timed
// work, so that its enqueue gaps stay out of the GPU time. Unlike a stream held shut by the host,
// it ends by itself: NCCL may block the host while its work queue is full, until the GPU drains it.
struct spin_cycles {
  long long cycles;
  __host__ __device__ void operator()(std::int64_t) const
  {
    NV_IF_TARGET(NV_IS_DEVICE, (const long long start = clock64(); while (clock64() - start < cycles) {}))
  }
};

// A router output [8192, K] of int32 ids every layer reads (what torch.topk hands over).
struct router_ids {
  std::int32_t* out;
  __host__ __device__ void operator()(std::int64_t i) const
  {
    out[i] = static_cast<std::int32_t>(((i / top_k) * 31 + (i % top_k) * 17) % experts);
  }
};

struct stats {
  double median, p10, p90;
};
stats summarize(std::vector<double> v)
{
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return v[static_cast<std::size_t>(q * static_cast<double>(v.size() - 1))]; };
  return {at(0.5), at(0.1), at(0.9)};
}

void print_line(const std::string& fields) { std::printf("{%s}\n", fields.c_str()); std::fflush(stdout); }

std::string num(double v)
{
  char b[64];
  std::snprintf(b, sizeof b, "%.2f", v);
  return b;
}

class bench_rank {
 public:
  explicit bench_rank(ncclComm_t comm) : comm_(comm), ids_(8192 * top_k), gathered_(8192 * top_k + 2 * top_k), one_(1)
  {
    ncclCommUserRank(comm_, &rank_);
    ncclCommCount(comm_, &size_);
    rr::cuda_backend::bulk_async(8192 * top_k, router_ids{rr::cuda_backend::data(ids_)}, stream_.ref());
    rr::cuda_backend::synchronize(stream_.ref());
  }

  // Sequence parallel: the library's once-per-step gather against an all-gather per layer.
  void sp_gather(const scenario& sc)
  {
    const auto plan  = plan_of(sc);
    const auto shard = rr::sequence_shard::of(plan.num_rows(), -1, rank_, size_);
    {
      rr_test::progress().context("parallel_bench sp_gather " + std::string{sc.name} + " once_per_step");
      ranked replay{bench_config(), {rr::parallel_scheme::sequence, 0, {}}, rr::nccl_communicator{comm_}};
      add_requests(replay.is_output_rank() ? &replay.output() : nullptr, sc);
      report("sp_gather", sc, "once_per_step", timed([&](cuda::stream_ref s) {
               for (std::int32_t l = 0; l < layers; ++l) {
                 rr_test::progress().at("capture (enqueue)", iteration_, l);
                 replay.capture(l, ids() + shard.first_row * top_k, shard.shard_rows, s);
               }
               rr_test::progress().at("end_step (enqueues the step's all-gather)", iteration_);
               replay.end_step(s);
             },
             [&](cuda::stream_ref s) { replay.begin_step(plan, s); }, [&] { replay.drain(); }));
    }
    rr_test::progress().context("parallel_bench sp_gather " + std::string{sc.name} + " all_gather_per_layer");
    std::optional<output> lib;
    if (rank_ == 0) { lib.emplace(bench_config()); }
    add_requests(lib ? &*lib : nullptr, sc);
    report("sp_gather", sc, "all_gather_per_layer", timed([&](cuda::stream_ref s) {
             for (std::int32_t l = 0; l < layers; ++l) {
               rr_test::progress().at("ncclAllGather of the layer's ids (enqueue; may block while NCCL's queue is full)",
                                      iteration_, l);
               check(ncclAllGather(ids() + shard.first_row * top_k, rr::cuda_backend::data(gathered_),
                                   static_cast<std::size_t>(shard.shard_rows * top_k), ncclInt32, comm_, s.get()));
               if (lib) { lib->capture(l, static_cast<const std::int32_t*>(rr::cuda_backend::data(gathered_)), plan.num_rows(), s); }
             }
             if (lib) { lib->end_step(s); }
           },
           [&](cuda::stream_ref s) { if (lib) { lib->begin_step(plan, s); } }, [&] { if (lib) { lib->drain(); } }));
  }

  // Tensor parallel: end_step()'s host time on a capture-only rank (and on the output rank).
  void capture_only_end_step(const scenario& sc)
  {
    const auto plan = plan_of(sc);
    rr_test::progress().context("parallel_bench capture_only_end_step " + std::string{sc.name});
    ranked replay{bench_config(), {rr::parallel_scheme::replicated, 0, {}}, rr::nccl_communicator{comm_}};
    add_requests(replay.is_output_rank() ? &replay.output() : nullptr, sc);
    std::vector<double> host_us;
    auto s = stream_.ref();
    for (int i = 0; i < warmup + iterations; ++i) {
      auto& now = rr_test::progress();
      now.at("begin_step", i);
      replay.begin_step(plan, s);
      for (std::int32_t l = 0; l < layers; ++l) { replay.capture(l, ids(), plan.num_rows(), s); }
      now.at("end_step", i);
      const auto t0 = std::chrono::steady_clock::now();
      replay.end_step(s);
      const auto t1 = std::chrono::steady_clock::now();
      now.at("cudaStreamSynchronize after end_step", i);
      rr::cuda_backend::synchronize(s);
      now.at("drain (files the step)", i);
      replay.drain();
      if (i >= warmup) { host_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count()); }
    }
    const stats st = summarize(host_us);
    print_line("\"bench\": \"capture_only_end_step\", \"scenario\": \"" + std::string{sc.name} +
               "\", \"rows\": " + std::to_string(sc.rows()) + ", \"rank\": " + std::to_string(rank_) +
               ", \"role\": \"" + (replay.is_output_rank() ? "output (double_buffered)" : "capture_only") +
               "\", \"host_us_median\": " + num(st.median) + ", \"host_us_p10\": " + num(st.p10) +
               ", \"host_us_p90\": " + num(st.p90) + ", \"iterations\": " + std::to_string(iterations));
  }

  // A capture-only rank's host allocations for a small and a huge KV pool and model length.
  void capture_only_host_alloc()
  {
    using pooled = rr::RoutingReplay<rr::cuda_backend, std::int16_t, rr::layer_major, rr::double_buffered<2>,
                                     rr::block_slot_storage>;
    for (const auto& [blocks, model_len] : {std::pair<std::int64_t, std::int64_t>{1024, 4096}, {1 << 20, 1 << 20}}) {
      rr_test::progress().context("parallel_bench capture_only_host_alloc, num_blocks " + std::to_string(blocks));
      rr_test::progress().at("building a capture-only rank");
      auto plan = plan_of(scenarios[1]);
      rr_test::count_allocations(true);
      (void)rr_test::allocated_bytes_taken();
      rr::parallel_replay<pooled, rr::nccl_communicator> replay{bench_config(blocks, model_len), {rr::parallel_scheme::replicated, 1 - rank_, {}},
                                                               rr::nccl_communicator{comm_}};
      const std::size_t built = rr_test::allocated_bytes_taken();
      for (int i = 0; i < 20; ++i) {
        rr_test::progress().at("step (begin_step, captures, end_step)", i);
        replay.begin_step(plan, stream_.ref());
        for (std::int32_t l = 0; l < layers; ++l) { replay.capture(l, ids(), plan.num_rows(), stream_.ref()); }
        replay.end_step(stream_.ref());
      }
      rr_test::progress().at("cudaStreamSynchronize after 20 steps");
      rr::cuda_backend::synchronize(stream_.ref());
      const std::size_t steps = rr_test::allocated_bytes_taken();
      rr_test::count_allocations(false);
      print_line("\"bench\": \"capture_only_host_alloc\", \"rank\": " + std::to_string(rank_) + ", \"num_blocks\": " +
                 std::to_string(blocks) + ", \"max_model_len\": " + std::to_string(model_len) +
                 ", \"host_bytes_built\": " + std::to_string(built) + ", \"host_bytes_20_steps\": " +
                 std::to_string(steps) + ", \"device_bytes_D\": " + std::to_string(8192LL * layers * top_k * 2));
    }
  }

 private:
  static void check(ncclResult_t r)
  {
    if (r != ncclSuccess) { throw rr::error{rr::errc::backend_error, ncclGetErrorString(r)}; }
  }
  [[nodiscard]] const std::int32_t* ids() { return rr::cuda_backend::data(ids_); }

  template <class Host>
  static void add_requests(Host* host, const scenario& sc)
  {
    if (host == nullptr) { return; }
    for (std::int32_t r = 0; r < sc.requests; ++r) { host->add_request(r); }
  }

  // GPU time of `work` on the compute stream, per iteration: `before` (host, untimed), then `work`
  // is enqueued behind a one-float all-reduce (the ranks meet) and a few milliseconds of a busy
  // GPU (the host's head start); `after` files what the step left in flight.
  template <class Work, class Before, class After>
  std::vector<double> timed(Work&& work, Before&& before, After&& after)
  {
    std::vector<double> us;
    auto s = stream_.ref();
    auto& now = rr_test::progress();
    for (int i = 0; i < warmup + iterations; ++i) {
      iteration_ = i;
      now.at("begin_step", i);
      before(s);
      now.at("ncclAllReduce of one float (enqueue): the ranks meet", i);
      check(ncclAllReduce(rr::cuda_backend::data(one_), rr::cuda_backend::data(one_), 1, ncclFloat, ncclSum, comm_, s.get()));
      rr::cuda_backend::bulk_async(1, spin_cycles{4'000'000}, s);  // about 2 ms
      timer_.start(s);
      work(s);
      timer_.stop(s);
      now.at("cudaStreamSynchronize: the all-reduce and the timed work (needs the peer rank)", i);
      rr::cuda_backend::synchronize(s);
      now.at("drain (files the step)", i);
      after();
      if (i >= warmup) { us.push_back(*timer_.elapsed_us()); }
    }
    return us;
  }

  void report(const char* bench, const scenario& sc, const char* approach, std::vector<double> us)
  {
    const stats st = summarize(std::move(us));
    print_line("\"bench\": \"" + std::string{bench} + "\", \"scenario\": \"" + sc.name + "\", \"rows\": " +
               std::to_string(sc.rows()) + ", \"layers\": 48, \"top_k\": 8, \"index\": \"int16\", \"ranks\": " +
               std::to_string(size_) + ", \"rank\": " + std::to_string(rank_) + ", \"approach\": \"" + approach +
               "\", \"gpu_us_median\": " + num(st.median) + ", \"gpu_us_p10\": " + num(st.p10) + ", \"gpu_us_p90\": " +
               num(st.p90) + ", \"iterations\": " + std::to_string(iterations));
  }

  ncclComm_t comm_;
  int rank_ = 0, size_ = 1;
  int iteration_ = 0;  // of timed(), for the progress board
  rr::cuda_stream stream_;
  platform::timer timer_;
  rr::cuda_backend::device_vector<std::int32_t> ids_;
  rr::cuda_backend::device_vector<std::int32_t> gathered_;
  rr::cuda_backend::device_vector<float> one_;
};

}  // namespace

int main(int argc, char** argv)
{
  auto args = rr_test::ranks::take_rank_args(argc, argv);
  if (args.rank < 0) {
    if (rr_test::ranks::gpu_count() < 2) {
      std::puts("parallel_bench: needs 2 GPUs");
      return 77;
    }
    return rr_test::ranks::launch_ranks(argc, argv, 2, std::getenv("RR_MULTI_GPU_LOG_DIR"),
                                        static_cast<int>(rr_test::ranks::env_seconds("RR_BENCH_DEADLINE_S", 180) + 30));
  }
  static std::atomic<ncclComm_t> abort_on_deadline{nullptr};  // the communicator, while it lives
  const rr_test::progress_watchdog watchdog{
    "parallel_bench rank " + std::to_string(args.rank),
    std::chrono::seconds{rr_test::ranks::env_seconds("RR_BENCH_STALL_S", 60)},
    std::chrono::seconds{rr_test::ranks::env_seconds("RR_BENCH_DEADLINE_S", 180)}, [] {
      if (const ncclComm_t c = abort_on_deadline.load(); c != nullptr) { ncclCommAbort(c); }
    }};
  try {
    rr_test::progress().at("joining the NCCL communicator");
    ncclComm_t comm = rr_test::ranks::join_communicator(args);
    abort_on_deadline.store(comm);
    {
      bench_rank bench{comm};
      for (const auto& sc : scenarios) {
        std::fprintf(stderr, "parallel_bench rank %d: sp_gather %s\n", args.rank, sc.name);
        bench.sp_gather(sc);
      }
      for (const auto& sc : {scenarios[1], scenarios[2]}) {
        std::fprintf(stderr, "parallel_bench rank %d: capture_only_end_step %s\n", args.rank, sc.name);
        bench.capture_only_end_step(sc);
      }
      std::fprintf(stderr, "parallel_bench rank %d: capture_only_host_alloc\n", args.rank);
      bench.capture_only_host_alloc();
    }
    rr_test::progress().at("ncclCommDestroy");
    abort_on_deadline.store(nullptr);
    ncclCommDestroy(comm);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "parallel_bench rank %d: %s\n", args.rank, e.what());
    return 1;
  }
  return 0;
}
