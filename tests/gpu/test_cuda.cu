// CUDA-only checks: the concepts under nvcc, device-detected errors through real kernels, a
// forward recorded once into a CUDA graph and replayed with new ids every step, and fault injection
// over the CUDA backend. Returns 77 (CTest: skipped) when no GPU is present.
#define DOCTEST_CONFIG_IMPLEMENT
#include "../support/concept_checks.hpp"
#include "../support/error_checks.hpp"
#include "../support/fault_backend.hpp"
#include "../support/fault_sweep.hpp"
#include "../support/harness.hpp"
#include "../support/pipeline_stress.hpp"
#include "../support/strategy_lists.hpp"

#include <routing_replay/routing_replay.cuh>

#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

namespace rr = routing_replay;

static_assert(rr::backend<rr::cuda_backend>);
// an asynchronous CUDA error is returned by every later call: the copy's event reports a failure
// on the compute stream; the fault-injecting wrapper keeps every query a failure point
static_assert(rr::failures_are_sticky<rr::cuda_backend>);
static_assert(!rr::failures_are_sticky<rr_test::faulty_backend<rr::cuda_backend>>);
static_assert(std::is_trivially_copyable_v<rr::RoutingReplay<rr::cuda_backend>::ref_type>);

namespace {

void check(cudaError_t status)
{
  INFO(cudaGetErrorString(status));
  REQUIRE(status == cudaSuccess);
}

/// Records the forward once (one layer per capture path, all N_max rows, as graph padding does)
/// and replays it for every step of a randomized schedule.
template <class RR>
void run_graph_schedule(std::uint64_t seed)
{
  rr_test::sim_config sim = rr_test::schedule_for_seed(seed);
  rr_test::harness_shape shape;
  shape.max_padding = 0;
  rr_test::replay_harness<RR> h{sim, shape, seed};
  const cudaStream_t stream = h.stream_ref().get();

  cudaGraph_t graph = nullptr;
  check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  h.forward_layer(0, rr_test::capture_path::capture_int64, sim.max_tokens_per_step);
  h.forward_layer(1, rr_test::capture_path::layer_view, sim.max_tokens_per_step);
  h.forward_layer(2, rr_test::capture_path::device_ref, sim.max_tokens_per_step);
  check(cudaStreamEndCapture(stream, &graph));

  // router + capture() for layer 0, one fused "MoE kernel" each for layers 1 and 2: the library
  // added exactly one kernel (capture) and nothing for the view and the in-kernel recorder
  std::size_t num_nodes = 0;
  check(cudaGraphGetNodes(graph, nullptr, &num_nodes));
  std::vector<cudaGraphNode_t> nodes(num_nodes);
  check(cudaGraphGetNodes(graph, nodes.data(), &num_nodes));
  std::size_t kernels = 0;
  for (auto node : nodes) {
    cudaGraphNodeType type{};
    check(cudaGraphNodeGetType(node, &type));
    kernels += type == cudaGraphNodeTypeKernel ? 1 : 0;
  }
  CHECK(num_nodes == 4);
  CHECK(kernels == 4);

  cudaGraphExec_t exec = nullptr;
  check(cudaGraphInstantiate(&exec, graph, 0));
  h.set_forward([&](std::int64_t) { check(cudaGraphLaunch(exec, stream)); });
  h.run();
  CHECK(h.rows_checked() > 0);
  check(cudaGraphExecDestroy(exec));
  check(cudaGraphDestroy(graph));
}

}  // namespace

TEST_CASE_TEMPLATE_DEFINE("CUDA: device-detected problems discard the step and lose nothing", RR, errors_cuda)
{
  rr_test::check_device_detected_errors<RR>();
}
TEST_CASE_TEMPLATE_APPLY(errors_cuda, rr_test::every_strategy_and_storage<rr::cuda_backend>);

TEST_CASE_TEMPLATE_DEFINE("CUDA graph: a forward recorded once, replayed with new ids, every row checked", RR,
                          graph_cuda)
{
  for (std::uint64_t seed : {1u, 4u}) {
    CAPTURE(seed);
    run_graph_schedule<RR>(seed);
  }
}
TEST_CASE_TEMPLATE_APPLY(graph_cuda, rr_test::every_strategy_and_storage<rr::cuda_backend>);

TEST_CASE_TEMPLATE_DEFINE("CUDA pipeline stress: slow copies, many steps in flight, extraction mid-pipeline",
                          RR, stress_cuda)
{
  rr_test::check_pipeline_stress<RR>(/*copy_delay_us=*/200, /*decode_steps=*/80);
}
TEST_CASE_TEMPLATE_APPLY(stress_cuda, rr_test::one_per_strategy<rr::cuda_backend>);

TEST_CASE_TEMPLATE_DEFINE("CUDA: with the copy stream shut, end_step returns and the compute stream runs on",
                          RR, gate_cuda)
{
  rr_test::check_compute_never_waits_for_copies<RR>();
}
TEST_CASE_TEMPLATE_APPLY(gate_cuda, rr_test::side_stream_strategies<rr::cuda_backend>);

// Fault injection over the CUDA backend: every backend operation and device/pinned allocation fails
// once in the fault sweep's schedule (tests/support/fault_sweep.hpp).
TEST_CASE_TEMPLATE_DEFINE("CUDA: every backend operation and device/pinned allocation fails once: documented state, no hang",
                          RR, faults_cuda)
{
  rr_test::check_sweep(rr_test::sweep<RR>(rr_test::fault_source::backend), "CUDA backend");
}
TEST_CASE_TEMPLATE_APPLY(
  faults_cuda,
  std::tuple<rr::RoutingReplay<rr_test::faulty_backend<rr::cuda_backend>, std::int16_t, rr::layer_major, rr::sync_copy,
                               rr::per_request_storage>,
             rr::RoutingReplay<rr_test::faulty_backend<rr::cuda_backend>, std::uint8_t, rr::token_major,
                               rr::async_event, rr::block_slot_storage>,
             rr::RoutingReplay<rr_test::faulty_backend<rr::cuda_backend>, std::int16_t, rr::layer_major,
                               rr::device_scatter<2>, rr::block_slot_storage>>);

// PyTorch records CUDA graphs in global capture mode: while any thread records one, a
// cudaHostRegister from any other thread is refused and invalidates the recording, unless that
// thread chose relaxed mode. The row arena's worker pins device-scatter rows ahead of need while an
// engine may be recording its graphs (vLLM records them at start-up, right after building the
// capturer); its registrations must neither break a recording nor stop.
TEST_CASE("CUDA graph: a global-mode capture is not invalidated by the row worker pinning memory ahead")
{
  using replay_type =
    rr::RoutingReplay<rr::cuda_backend, std::int16_t, rr::layer_major, rr::device_scatter<2>, rr::per_request_storage>;
  rr::replay_config config;
  config.num_experts         = 128;
  config.top_k               = 8;
  config.max_tokens_per_step = 64;
  config.max_model_len       = 4096;
  config.moe_layers          = {0, 1};
  config.host_memory_ahead   = std::int64_t{512} << 20;  // the worker pins for a few hundred ms
  replay_type replay{config};
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::int64_t* ids = nullptr;
  check(cudaMalloc(&ids, 64 * 8 * sizeof(std::int64_t)));
  check(cudaMemsetAsync(ids, 0, 64 * 8 * sizeof(std::int64_t), stream));
  check(cudaStreamSynchronize(stream));
  for (int recording = 0; recording < 30; ++recording) {  // spans the worker's pinning
    cudaGraph_t graph = nullptr;
    check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    replay.capture(0, ids, 64, cuda::stream_ref{stream});
    std::this_thread::sleep_for(std::chrono::milliseconds{10});
    check(cudaStreamEndCapture(stream, &graph));  // cudaErrorStreamCaptureInvalidated if the worker's pinning broke the recording
    check(cudaGraphDestroy(graph));
  }
  // the worker is still pinning (or done), and a step's rows still land
  replay.reset_device_buffer(cuda::stream_ref{stream});
  rr::step_plan plan;
  const auto request = replay.add_request(7);
  plan.schedule({.id = request, .first_position = 0, .num_tokens = 64});
  replay.begin_step(plan, cuda::stream_ref{stream});
  replay.capture(0, ids, 64, cuda::stream_ref{stream});
  replay.capture(1, ids, 64, cuda::stream_ref{stream});
  replay.end_step(cuda::stream_ref{stream});
  replay.drain();
  const auto rows = replay.extract(request);
  CHECK(rows.num_rows() == 64);
  check(cudaFree(ids));
  check(cudaStreamDestroy(stream));
}

int main(int argc, char** argv)
{
  if (!rr::cuda_backend::available()) {
    std::puts("gpu_tests: no CUDA device found; skipping (exit code 77)");
    return 77;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) { std::printf("gpu_tests on %s\n", prop.name); }
  doctest::Context context{argc, argv};
  return context.run();
}
