// slot_rows on a GPU: the capture kernel, the end-of-step kernel reading the step's slots from device
// memory, and the scatter writing the pinned, device-mapped pool, eager and from a CUDA graph replayed
// with padded batches, for every stored index type and every way a step reaches the pool (a scatter
// on a side stream or the compute stream, the end-of-step kernel itself); device-detected
// problems (a slot outside the pool, a captured layer left unwritten) refuse their step. The host never
// sees a step's slots. Returns 77 (CTest: skipped) when no GPU is present.
#define DOCTEST_CONFIG_IMPLEMENT
#include <routing_replay/routing_replay.cuh>
#include <routing_replay/slot_rows.hpp>

#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <span>
#include <vector>

namespace rr = routing_replay;

namespace {

constexpr std::int32_t num_layers = 6;  // model layer 0 is dense
constexpr std::int32_t top_k      = 8;
constexpr std::int32_t experts    = 128;
constexpr std::int64_t pool_slots = 4096;
constexpr std::int32_t max_rows   = 256;

void check(cudaError_t status)
{
  INFO(cudaGetErrorString(status));
  REQUIRE(status == cudaSuccess);
}

rr::slot_rows_config gpu_config(bool on_compute)
{
  rr::slot_rows_config c;
  c.num_experts               = experts;
  c.top_k                     = top_k;
  c.num_fused_shared_experts  = 1;
  c.max_tokens_per_step       = max_rows;
  c.num_model_layers          = num_layers;
  c.num_slots                 = pool_slots;
  c.page_size                 = 16;
  c.steps_in_flight           = 3;
  c.scatter_on_compute_stream = on_compute;
  return c;
}

std::int32_t id_of(std::int64_t slot, std::int32_t layer, std::int32_t column, std::int64_t step)
{
  return static_cast<std::int32_t>((slot * 7 + layer * 13 + column * 3 + step * 5) % experts);
}

// Device buffers of one engine: router outputs [layer][max_rows, K + 1] int32 and the step's slots.
struct device_inputs {
  device_inputs()
  {
    check(cudaMalloc(&ids, sizeof(std::int32_t) * num_layers * max_rows * (top_k + 1)));
    check(cudaMalloc(&slots, sizeof(std::int64_t) * max_rows));
  }
  ~device_inputs()
  {
    cudaFree(ids);
    cudaFree(slots);
  }
  device_inputs(const device_inputs&)            = delete;
  device_inputs& operator=(const device_inputs&) = delete;

  [[nodiscard]] const std::int32_t* layer(std::int32_t l) const { return ids + static_cast<std::size_t>(l) * max_rows * (top_k + 1); }

  // uploads a step (rows beyond its slots hold -1: a graph's padding) on `stream`
  void upload(const std::vector<std::int64_t>& step_slots, std::int64_t step, cudaStream_t stream)
  {
    host_ids.assign(static_cast<std::size_t>(num_layers) * max_rows * (top_k + 1), -1);
    for (std::int32_t l = 1; l < num_layers; ++l) {
      for (std::size_t r = 0; r < step_slots.size(); ++r) {
        for (std::int32_t c = 0; c < top_k; ++c) {
          host_ids[(static_cast<std::size_t>(l) * max_rows + r) * (top_k + 1) + static_cast<std::size_t>(c)] =
            id_of(step_slots[r], l, c, step);
        }
      }
    }
    host_slots = step_slots;
    check(cudaMemcpyAsync(ids, host_ids.data(), host_ids.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice, stream));
    check(cudaMemcpyAsync(slots, host_slots.data(), host_slots.size() * sizeof(std::int64_t), cudaMemcpyHostToDevice,
                          stream));
    check(cudaStreamSynchronize(stream));  // the host vectors are reused by the next upload
  }

  std::int32_t* ids     = nullptr;
  std::int64_t* slots   = nullptr;
  std::vector<std::int32_t> host_ids;
  std::vector<std::int64_t> host_slots;
};

template <class Index>
void check_read(const rr::slot_rows<rr::cuda_backend, Index>& rows, const std::vector<std::int64_t>& slots,
                std::int64_t step)
{
  std::vector<std::int32_t> out(slots.size() * num_layers * top_k, -7);
  rows.template read<std::int32_t>(std::span<const std::int64_t>{slots}, out.data());
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    for (std::int32_t l = 0; l < num_layers; ++l) {
      for (std::int32_t c = 0; c < top_k; ++c) {
        const auto got = out[(i * num_layers + static_cast<std::size_t>(l)) * top_k + static_cast<std::size_t>(c)];
        wrong += got != (l == 0 ? 0 : id_of(slots[i], l, c, step));
      }
    }
  }
  CHECK(wrong == 0);
}

std::vector<std::int64_t> random_slots(std::mt19937_64& rng, std::size_t n)
{
  std::vector<std::int64_t> slots;
  while (slots.size() < n) {
    const auto s = static_cast<std::int64_t>(rng() % pool_slots);
    if (std::find(slots.begin(), slots.end(), s) == slots.end()) { slots.push_back(s); }
  }
  return slots;
}

}  // namespace

TEST_CASE_TEMPLATE("CUDA slot_rows: eager steps land at the slots the device holds", Index, std::uint8_t, std::uint16_t,
                   std::int32_t)
{
  for (const bool on_compute : {false, true}) {
    CAPTURE(on_compute);
    rr::cuda_stream compute;
    device_inputs in;
    rr::slot_rows<rr::cuda_backend, Index> rows{gpu_config(on_compute)};
    std::mt19937_64 rng{42};
    std::vector<std::pair<std::vector<std::int64_t>, std::int64_t>> written;
    for (std::int64_t step = 1; step <= 30; ++step) {
      const auto slots = random_slots(rng, static_cast<std::size_t>(rng() % max_rows));
      in.upload(slots, step, compute.get());
      for (std::int32_t l = 1; l < num_layers; ++l) {
        rows.capture(l, in.layer(l), static_cast<std::int64_t>(slots.size()), compute.ref(), top_k + 1);
      }
      const std::uint64_t serial = rows.end_step(in.slots, static_cast<std::int64_t>(slots.size()), compute.ref());
      rows.wait(serial);
      CHECK_NOTHROW(rows.throw_failure(serial));
      check_read(rows, slots, step);
    }
  }
}

TEST_CASE("CUDA slot_rows: steps stored by the end-of-step kernel alone and scattered ones interleave")
{
  // 0: every step scattered; 32: steps of 1..96 rows both ways; max_rows: every step stored by one kernel
  for (const std::int32_t fused_rows : {0, 32, max_rows}) {
    for (const bool on_compute : {false, true}) {
      CAPTURE(fused_rows);
      CAPTURE(on_compute);
      rr::cuda_stream compute;
      device_inputs in;
      rr::slot_rows_config c   = gpu_config(on_compute);
      c.fused_scatter_max_rows = fused_rows;
      rr::slot_rows<rr::cuda_backend, std::uint16_t> rows{c};
      std::mt19937_64 rng{static_cast<std::uint64_t>(fused_rows + (on_compute ? 1 : 0))};
      std::vector<std::int64_t> step_of(256, -1);  // steps keep rewriting slots [0, 256)
      std::vector<std::uint64_t> serials;
      for (std::int64_t step = 1; step <= 40; ++step) {
        std::vector<std::int64_t> slots;
        const auto n = static_cast<std::size_t>(1 + rng() % 96);
        while (slots.size() < n) {
          const auto s = static_cast<std::int64_t>(rng() % 256);
          if (std::find(slots.begin(), slots.end(), s) == slots.end()) { slots.push_back(s); }
        }
        in.upload(slots, step, compute.get());
        for (std::int32_t l = 1; l < num_layers; ++l) {
          rows.capture(l, in.layer(l), static_cast<std::int64_t>(slots.size()), compute.ref(), top_k + 1);
        }
        serials.push_back(rows.end_step(in.slots, static_cast<std::int64_t>(slots.size()), compute.ref()));
        for (const std::int64_t s : slots) { step_of[static_cast<std::size_t>(s)] = step; }
        if (step % 5 == 0) {  // otherwise several steps stay in flight, rewriting the same slots
          rows.wait(serials.back());
          for (std::int64_t s = 0; s < 256; ++s) {
            if (step_of[static_cast<std::size_t>(s)] >= 0) { check_read(rows, {s}, step_of[static_cast<std::size_t>(s)]); }
          }
        }
      }
      rows.wait(serials.back());
      CHECK_NOTHROW(rows.throw_failure(serials.back()));
    }
  }
}

TEST_CASE("CUDA slot_rows: a forward recorded once in a graph, replayed with padded batches")
{
  for (const bool on_compute : {false, true}) {
    CAPTURE(on_compute);
    rr::cuda_stream compute;
    device_inputs in;
    rr::slot_rows<rr::cuda_backend, std::uint8_t> rows{gpu_config(on_compute)};
    constexpr std::int64_t graph_rows = 64;
    cudaGraph_t graph                 = nullptr;
    check(cudaStreamBeginCapture(compute.get(), cudaStreamCaptureModeThreadLocal));
    for (std::int32_t l = 1; l < num_layers; ++l) { rows.capture(l, in.layer(l), graph_rows, compute.ref(), top_k + 1); }
    check(cudaStreamEndCapture(compute.get(), &graph));
    cudaGraphExec_t exec = nullptr;
    check(cudaGraphInstantiate(&exec, graph, 0));
    std::mt19937_64 rng{7};
    for (std::int64_t step = 1; step <= 20; ++step) {
      const auto slots = random_slots(rng, 1 + rng() % graph_rows);  // the real batch; the graph writes 64 rows
      in.upload(slots, step, compute.get());
      check(cudaGraphLaunch(exec, compute.get()));
      const std::uint64_t serial = rows.end_step(in.slots, static_cast<std::int64_t>(slots.size()), compute.ref(),
                                                 {.graph_replayed = true});
      rows.wait(serial);
      CHECK_NOTHROW(rows.throw_failure(serial));
      check_read(rows, slots, step);
    }
    check(cudaGraphExecDestroy(exec));
    check(cudaGraphDestroy(graph));
  }
}

TEST_CASE("CUDA slot_rows: a slot outside the pool and a captured layer left unwritten refuse their steps")
{
  for (const std::int32_t fused_rows : {0, 64}) {  // refused by the scatter, by the end-of-step kernel
    CAPTURE(fused_rows);
    rr::cuda_stream compute;
    device_inputs in;
    rr::slot_rows_config c   = gpu_config(false);
    c.fused_scatter_max_rows = fused_rows;
    rr::slot_rows<rr::cuda_backend, std::uint8_t> rows{c};
    in.upload({3, pool_slots + 9}, 1, compute.get());
    for (std::int32_t l = 1; l < num_layers; ++l) { rows.capture(l, in.layer(l), 2, compute.ref(), top_k + 1); }
    const std::uint64_t bad_slot = rows.end_step(in.slots, 2, compute.ref());
    in.upload({5, 6}, 2, compute.get());
    for (std::int32_t l = 1; l < num_layers - 1; ++l) { rows.capture(l, in.layer(l), 2, compute.ref(), top_k + 1); }
    const std::uint64_t missing_layer = rows.end_step(in.slots, 2, compute.ref());
    rows.wait(missing_layer);
    for (const auto& [serial, code] : {std::pair{bad_slot, rr::errc::slot_out_of_range},
                                       std::pair{missing_layer, rr::errc::missing_routing}}) {
      try {
        rows.throw_failure(serial);
        FAIL("no error");
      } catch (const rr::error& e) {
        CHECK(e.code() == code);
      }
    }
    std::vector<std::int32_t> out(num_layers * top_k);
    for (const std::int64_t slot : {3, 5}) {
      CHECK_THROWS_AS(rows.read<std::int32_t>(std::span<const std::int64_t>{&slot, 1}, out.data()), rr::error);
    }
  }
}

int main(int argc, char** argv)
{
  if (!rr::cuda_backend::available()) {
    std::puts("slot_rows_gpu_tests: no CUDA device found; skipping (exit code 77)");
    return 77;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) { std::printf("slot_rows_gpu_tests on %s\n", prop.name); }
  doctest::Context context{argc, argv};
  return context.run();
}
