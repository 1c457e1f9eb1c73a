// Parallel engines on two GPUs: one process per GPU, a real NCCL communicator, the same randomized
// schedules as the host tests (tests/support/parallel_harness.hpp) for tensor parallel with only the
// output rank filing, the sequence-parallel gather and the pipeline-parallel merge, plus expert
// parallel under EPLB replication and the data-parallel CUDA graph replayed with changing splits;
// bit-exact against the reference model. Started without arguments it starts one process per rank
// (tests/support/nccl_ranks.cuh); returns 77 (CTest: skipped) with fewer than 2 GPUs. Each rank runs
// under a watchdog (tests/support/deadline.hpp): no progress for RR_MULTI_GPU_STALL_S seconds
// (default 60) or a run past RR_MULTI_GPU_DEADLINE_S (default 300) prints which rank waited in what
// (test case, seed, scheme, operation, step, layer), aborts its communicator and exits with 3.
#define DOCTEST_CONFIG_IMPLEMENT
#include "../support/concept_checks.hpp"
#include "../support/data_parallel.hpp"
#include "../support/deadline.hpp"
#include "../support/nccl_ranks.cuh"
#include "../support/parallel_harness.hpp"

#include <routing_replay/parallel/nccl_communicator.cuh>
#include <routing_replay/routing_replay.cuh>

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <string>

namespace rr = routing_replay;

static_assert(rr::communicator<rr::nccl_communicator, cuda::stream_ref>);
static_assert(std::is_trivially_copyable_v<rr::nccl_communicator>);

namespace {

ncclComm_t world = nullptr;  // this process's communicator (set in main)
std::atomic<ncclComm_t> abort_on_deadline{nullptr};  // what the watchdog aborts (world, while it lives)

// Output sides under test: each copy strategy kind, both storages, both layouts, three index types.
using sync_int16     = rr::RoutingReplay<rr::cuda_backend, std::int16_t, rr::layer_major, rr::sync_copy, rr::per_request_storage>;
using ring_uint8     = rr::RoutingReplay<rr::cuda_backend, std::uint8_t, rr::token_major, rr::double_buffered<2>,
                                         rr::block_slot_storage>;
using scatter_uint16 = rr::RoutingReplay<rr::cuda_backend, std::uint16_t, rr::token_major, rr::device_scatter<2>,
                                         rr::block_slot_storage>;

// The scheme, for the watchdog's report.
const char* scheme_name(rr::parallel_scheme s)
{
  switch (s) {
    case rr::parallel_scheme::replicated: return "tensor (replicated)";
    case rr::parallel_scheme::sequence: return "sequence";
    case rr::parallel_scheme::pipeline: return "pipeline";
  }
  return "?";
}

// This process's rank of the engine on the schedule of `seed`; the output rank checks its rows.
template <class Output>
void run_rank(const rr::parallel_options& options, std::uint64_t seed, const rr_test::replication_map* map = nullptr)
{
  const rr_test::sim_config sim = rr_test::schedule_for_seed(seed);
  rr_test::harness_shape shape;
  shape.overwrite = seed == 3;
  rr::parallel_replay<Output, rr::nccl_communicator> replay{rr_test::make_replay_config(sim, shape), options,
                                                           rr::nccl_communicator{world}};
  rr_test::rank_driver driver{replay, sim, shape, seed, map};
  driver.run(replay.is_output_rank() ? &replay.output() : static_cast<Output*>(nullptr));
  if (replay.is_output_rank()) { CHECK(driver.rows_checked() > 0); }
  MESSAGE("rank " << replay.rank() << ": " << driver.steps() << " steps, " << driver.rows_checked() << " rows checked");
}

// run_rank() for every layout on the schedule of every seed.
template <class Output>
void check_seeds(std::initializer_list<std::uint64_t> seeds, std::initializer_list<rr::parallel_options> layouts,
                 const rr_test::replication_map* map = nullptr)
{
  for (const std::uint64_t seed : seeds) {
    for (const auto& options : layouts) {
      CAPTURE(seed);
      CAPTURE(options.output_rank);
      rr_test::progress().context(std::string{scheme_name(options.scheme)} + " parallel, output " + Output::copy_type::name +
                                  "/" + Output::storage_type::name + ", seed " + std::to_string(seed) +
                                  ", output rank " + std::to_string(options.output_rank) + (map != nullptr ? ", EPLB" : ""));
      run_rank<Output>(options, seed, map);
    }
  }
}

constexpr auto replicated = rr::parallel_scheme::replicated;
constexpr auto sequence   = rr::parallel_scheme::sequence;
constexpr auto pipeline   = rr::parallel_scheme::pipeline;

// The data-parallel forward recorded into a CUDA graph once, launched every step.
struct cuda_recorder {
  cudaGraphExec_t exec = nullptr;
  template <class Forward>
  std::function<void(cuda::stream_ref)> record(Forward forward, cuda::stream_ref s)
  {
    cudaGraph_t graph = nullptr;
    REQUIRE(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    forward();
    REQUIRE(cudaStreamEndCapture(s.get(), &graph) == cudaSuccess);
    REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
    cudaGraphDestroy(graph);
    return [this](cuda::stream_ref st) { REQUIRE(cudaGraphLaunch(exec, st.get()) == cudaSuccess); };
  }
  ~cuda_recorder()
  {
    if (exec != nullptr) { cudaGraphExecDestroy(exec); }
  }
};

int world_rank()
{
  int r = 0;
  ncclCommUserRank(world, &r);
  return r;
}

}  // namespace

TEST_CASE_TEMPLATE("2 GPUs, tensor parallel: only the output rank copies and files", Output, sync_int16, ring_uint8,
                   scatter_uint16)
{
  check_seeds<Output>({1, 4}, {{replicated, 0, {}}, {replicated, 1, {}}});
}

TEST_CASE_TEMPLATE("2 GPUs, sequence parallel: shards gathered once per step with NCCL", Output, sync_int16, ring_uint8,
                   scatter_uint16)
{
  check_seeds<Output>({2, 3, 8}, {{sequence, 0, {}}, {sequence, 1, {}}});
}

TEST_CASE_TEMPLATE("2 GPUs, pipeline parallel: stage slabs merged on the output rank", Output, sync_int16, ring_uint8,
                   scatter_uint16)
{
  check_seeds<Output>({1, 4, 12}, {{pipeline, 1, {2, 1}}, {pipeline, 0, {1, 2}}});
}

TEST_CASE_TEMPLATE("2 GPUs, expert parallel with EPLB: replicated physical experts stored as logical ids", Output,
                   sync_int16, ring_uint8)
{
  const rr_test::replication_map map{rr_test::harness_shape{}.num_experts, 20};
  check_seeds<Output>({1, 4}, {{replicated, 0, {}}}, &map);
}

TEST_CASE_TEMPLATE("2 GPUs, data parallel: one CUDA graph replayed as the per-rank splits change", RR, sync_int16,
                   ring_uint8, scatter_uint16)
{
  for (const std::uint64_t seed : {1, 4}) {
    CAPTURE(seed);
    rr_test::progress().context(std::string{"data parallel CUDA graph, "} + RR::copy_type::name + "/" +
                                RR::storage_type::name + ", seed " + std::to_string(seed));
    rr_test::dp_driver<RR> driver{world_rank(), 2, rr_test::schedule_for_seed(seed), rr_test::harness_shape{}, seed};
    cuda_recorder recorder;
    driver.run(recorder);
    CHECK(driver.rows_checked() > 0);
  }
}

int main(int argc, char** argv)
{
  auto args = rr_test::ranks::take_rank_args(argc, argv);
  if (args.rank < 0) {  // the launcher
    if (rr_test::ranks::gpu_count() < 2) {
      std::puts("multi_gpu_tests: fewer than 2 GPUs; skipping (exit code 77)");
      return 77;
    }
    return rr_test::ranks::launch_ranks(argc, argv, 2, std::getenv("RR_MULTI_GPU_LOG_DIR"),
                                        static_cast<int>(rr_test::ranks::env_seconds("RR_MULTI_GPU_DEADLINE_S", 300) + 30));
  }
  // from here on a hang ends this rank (and, through ncclCommAbort, its peer's collectives)
  const rr_test::progress_watchdog watchdog{
    "multi_gpu_tests rank " + std::to_string(args.rank),
    std::chrono::seconds{rr_test::ranks::env_seconds("RR_MULTI_GPU_STALL_S", 60)},
    std::chrono::seconds{rr_test::ranks::env_seconds("RR_MULTI_GPU_DEADLINE_S", 300)}, [] {
      if (const ncclComm_t c = abort_on_deadline.load(); c != nullptr) { ncclCommAbort(c); }
    }};
  rr_test::progress().at("joining the NCCL communicator");
  world = rr_test::ranks::join_communicator(args);
  abort_on_deadline.store(world);
  rr_test::progress().at("running the test cases");
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, args.rank);
  std::printf("multi_gpu_tests rank %d of %d on %s\n", args.rank, args.size, prop.name);
  doctest::Context context{argc, argv};
  const int status = context.run();
  rr_test::progress().at("ncclCommDestroy");
  abort_on_deadline.store(nullptr);
  ncclCommDestroy(world);
  return status;
}
