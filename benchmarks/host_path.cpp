// Host-backend cost of the library's per-step path and of extraction (L = 48, K = 8, E = 128),
// swapping one policy at a time from int16/layer_major/sync/per_request (benchmarks/policies.hpp).
// On the host backend the "device" work (capture, check, copy, reset) runs on a host stream too.
//
//   decode_step/<policy>/batch:B   a whole decode step: begin_step, one pass recording every layer
//                                  through ref(), end_step (real time per step)
//   end_step/<policy>/batch:B      end_step() alone, after the forward has finished: the library's
//                                  post-forward host path (check, copy, scatter), manual time
//   extract/<storage>/rows:T       extract() of a finished request of T rows
//   prefill_begin/per_request      add_request() + begin_step() of a prefill step of 4 new requests
//                                  of 2048 rows, in steady state: each step releases the requests of
//                                  the step before (their storage is reused), manual time
//   host_memcpy/bytes:N            one host thread's memcpy: the limit of any host-side scatter
#include "bench_common.hpp"

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

namespace {

using namespace rr_bench;

template <class Index, class Layout, class Copy, class Storage>
using host_replay = rr::RoutingReplay<rr::host_backend, Index, Layout, Copy, Storage>;

/// @brief Enqueues the step's forward: every layer recorded through ref() in one pass.
template <class Replay>
void record_forward(Replay& replay, std::int32_t rows, rr::host_stream_ref stream)
{
  rr::host_backend::bulk_async(std::int64_t{bench_layers} * rows * bench_topk,
                               record_all_layers<typename Replay::ref_type>{replay.ref(rows), rows}, stream);
}

/// @brief Decode steps of `batch` requests, one token each.
template <class Index, class Layout, class Copy, class Storage>
struct decode_workload {
  explicit decode_workload(std::int32_t batch) : replay{bench_config(batch, batch)}, driver{batch, 1}
  {
    driver.add_requests(replay);
  }
  /// @brief Opens the next step and enqueues its forward.
  void begin_and_forward()
  {
    replay.begin_step(driver.next(), stream.ref());
    record_forward(replay, driver.rows(), stream.ref());
  }
  /// @brief Bytes of rows one step moves.
  [[nodiscard]] std::int64_t step_bytes() const
  {
    return std::int64_t{driver.rows()} * bench_layers * bench_topk * static_cast<std::int64_t>(sizeof(Index));
  }

  host_replay<Index, Layout, Copy, Storage> replay;
  rr::host_stream stream;  // after the replay: drained before the buffers its tasks touch go
  step_driver driver;
};

template <class Index, class Layout, class Copy, class Storage>
void decode_step(benchmark::State& state)
{
  decode_workload<Index, Layout, Copy, Storage> w{static_cast<std::int32_t>(state.range(0))};
  for (auto _ : state) {
    w.begin_and_forward();
    w.replay.end_step(w.stream.ref());
  }
  w.replay.drain();
  state.SetItemsProcessed(state.iterations() * w.driver.rows());
  state.SetBytesProcessed(state.iterations() * w.step_bytes());
}

template <class Index, class Layout, class Copy, class Storage>
void end_step_only(benchmark::State& state)
{
  decode_workload<Index, Layout, Copy, Storage> w{static_cast<std::int32_t>(state.range(0))};
  for (auto _ : state) {
    w.begin_and_forward();
    w.stream.synchronize();  // the forward has finished: time the library's own path only
    const auto t0 = std::chrono::steady_clock::now();
    w.replay.end_step(w.stream.ref());
    state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  w.replay.drain();
  state.SetBytesProcessed(state.iterations() * w.step_bytes());
}

template <class Storage>
void extract_request(benchmark::State& state)
{
  using replay_type = host_replay<std::int16_t, rr::token_major, rr::sync_copy, Storage>;
  const auto rows   = static_cast<std::int32_t>(state.range(0));
  constexpr std::int32_t chunk = 1024;
  replay_type replay{bench_config(chunk, 1)};
  rr::host_stream stream;
  step_driver driver{1, chunk};
  driver.add_requests(replay);
  for (std::int32_t first = 0; first < rows; first += chunk) {
    replay.begin_step(driver.next(), stream.ref());
    record_forward(replay, chunk, stream.ref());
    replay.end_step(stream.ref());
  }
  replay.drain();
  const rr::extract_options range{.end_position = rows};
  for (auto _ : state) {
    auto r = replay.extract(0, range);
    benchmark::DoNotOptimize(r.flat().data());
  }
  state.SetBytesProcessed(state.iterations() * std::int64_t{rows} * bench_layers * bench_topk * 2);
}

void prefill_begin(benchmark::State& state)
{
  using replay_type = host_replay<std::int16_t, rr::layer_major, rr::async_event, rr::per_request_storage>;
  constexpr std::int32_t requests_per_step = 4;
  constexpr std::int32_t prompt            = 2048;
  replay_type replay{bench_config(requests_per_step * prompt, 1)};
  rr::host_stream stream;
  std::int64_t next = 0;
  std::vector<std::int64_t> previous;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    rr::step_plan plan;
    for (std::int32_t i = 0; i < requests_per_step; ++i) {
      replay.add_request(next + i);
      plan.schedule({.id = next + i, .first_position = 0, .num_tokens = prompt});
    }
    replay.begin_step(plan, stream.ref());
    state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    record_forward(replay, requests_per_step * prompt, stream.ref());
    replay.end_step(stream.ref());
    replay.drain();
    for (const std::int64_t id : previous) { replay.release(id); }
    previous.clear();
    for (std::int32_t i = 0; i < requests_per_step; ++i) { previous.push_back(next + i); }
    next += requests_per_step;
  }
}

void host_memcpy(benchmark::State& state)
{
  const auto bytes = static_cast<std::size_t>(state.range(0));
  std::vector<unsigned char> from(bytes, 1), to(bytes, 0);
  for (auto _ : state) {
    std::memcpy(to.data(), from.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes));
}

}  // namespace

int main(int argc, char** argv)
{
  for_each_single_swap([](auto i, auto l, auto c, auto s) {
    using I = typename decltype(i)::type;
    using L = typename decltype(l)::type;
    using C = typename decltype(c)::type;
    using S = typename decltype(s)::type;
    const std::string policy = policy_name<I, L, C, S>();
    benchmark::RegisterBenchmark(("decode_step/" + policy).c_str(), decode_step<I, L, C, S>)
      ->ArgName("batch")->Arg(64)->Arg(256)->Arg(1024)->UseRealTime();
    benchmark::RegisterBenchmark(("end_step/" + policy).c_str(), end_step_only<I, L, C, S>)
      ->ArgName("batch")->Arg(64)->Arg(256)->Arg(1024)->UseManualTime();
  });
  for_each_type(storage_types{}, [](auto s) {
    using S = typename decltype(s)::type;
    benchmark::RegisterBenchmark(("extract/" + std::string{name_of<S>()}).c_str(), extract_request<S>)
      ->ArgName("rows")->Arg(1088)->Arg(4096);
  });
  benchmark::RegisterBenchmark("prefill_begin/per_request", prefill_begin)->UseManualTime()->Iterations(64);
  benchmark::RegisterBenchmark("host_memcpy", host_memcpy)->ArgName("bytes")->Arg(786432)->Arg(6291456);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) { return 1; }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
