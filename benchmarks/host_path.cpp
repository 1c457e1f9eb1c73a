// Host-backend cost of the library's per-step path and of extraction, per host storage and
// buffer layout (L = 48, K = 8, E = 128, int16). On the host backend the "device" work (capture,
// check, copy, reset) runs on a host stream too, so a step here is all of it, end to end.
#include <routing_replay/routing_replay.hpp>

#include <benchmark/benchmark.h>

#include <cstdint>
#include <numeric>
#include <vector>

namespace rr = routing_replay;

namespace {

constexpr std::int32_t layers  = 48;
constexpr std::int32_t top_k   = 8;
constexpr std::int32_t experts = 128;

rr::replay_config bench_config(std::int32_t batch)
{
  rr::replay_config c;
  c.num_experts         = experts;
  c.top_k               = top_k;
  c.max_tokens_per_step = std::max(batch, 1024);
  c.max_model_len       = 4096;
  c.moe_layers.resize(layers);
  std::iota(c.moe_layers.begin(), c.moe_layers.end(), 0);
  c.block_size = 16;
  c.num_blocks = (batch * 2048) / 16;
  return c;
}

/// The router of every layer, as one pass: what a fused in-kernel recorder would write.
template <class Ref>
struct record_all_layers {
  Ref ref;
  std::int32_t batch;
  void operator()(std::int64_t i) const
  {
    const auto layer = static_cast<std::int32_t>(i / (batch * top_k));
    const auto row   = static_cast<std::int32_t>((i / top_k) % batch);
    const auto k     = static_cast<std::int32_t>(i % top_k);
    ref.record(layer, row, k, (row * 31 + layer * 131 + k * 17) % experts);
  }
};

template <class Layout, class Storage>
void decode_step(benchmark::State& state)
{
  using replay      = rr::RoutingReplay<rr::host_backend, std::int16_t, Layout, rr::sync_copy, Storage>;
  const auto batch  = static_cast<std::int32_t>(state.range(0));
  replay rr_{bench_config(batch)};
  rr::host_stream stream;
  std::vector<std::int64_t> slots(static_cast<std::size_t>(batch));
  for (std::int32_t r = 0; r < batch; ++r) { rr_.add_request(r); }
  std::int64_t position = 0;
  rr::step_plan plan;
  for (auto _ : state) {
    plan.clear();
    for (std::int32_t r = 0; r < batch; ++r) {
      slots[static_cast<std::size_t>(r)] = std::int64_t{r} * 2048 + position;
      plan.schedule({r, position, 1, 0, std::span<const std::int64_t>{&slots[static_cast<std::size_t>(r)], 1}});
    }
    rr_.begin_step(plan, stream.ref());
    rr::host_backend::bulk_async(std::int64_t{layers} * batch * top_k,
                                 record_all_layers<typename replay::ref_type>{rr_.ref(batch), batch},
                                 stream.ref());
    rr_.end_step(stream.ref());
    if (++position == 2048) { position = 0; }
  }
  state.SetItemsProcessed(state.iterations() * batch);
  state.SetBytesProcessed(state.iterations() * batch * layers * top_k * 2);
}

template <class Storage>
void extract_request(benchmark::State& state)
{
  using replay     = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::token_major, rr::sync_copy, Storage>;
  const auto rows  = static_cast<std::int32_t>(state.range(0));
  replay rr_{bench_config(1024)};
  rr::host_stream stream;
  rr_.add_request(0);
  std::vector<std::int64_t> slots(1024);
  for (std::int32_t first = 0; first < rows; first += 1024) {
    const std::int32_t n = std::min(1024, rows - first);
    std::iota(slots.begin(), slots.end(), first);
    rr::step_plan plan;
    plan.schedule({0, first, n, 0, std::span<const std::int64_t>{slots.data(), static_cast<std::size_t>(n)}});
    rr_.begin_step(plan, stream.ref());
    rr::host_backend::bulk_async(std::int64_t{layers} * n * top_k,
                                 record_all_layers<typename replay::ref_type>{rr_.ref(n), n}, stream.ref());
    rr_.end_step(stream.ref());
  }
  for (auto _ : state) {
    auto r = rr_.extract(0);
    benchmark::DoNotOptimize(r.flat().data());
  }
  state.SetBytesProcessed(state.iterations() * std::int64_t{rows} * layers * top_k * 2);
}

}  // namespace

BENCHMARK(decode_step<rr::layer_major, rr::per_request_storage>)->Arg(64)->Arg(256)->Arg(1024)->UseRealTime();
BENCHMARK(decode_step<rr::token_major, rr::per_request_storage>)->Arg(64)->Arg(256)->Arg(1024)->UseRealTime();
BENCHMARK(decode_step<rr::layer_major, rr::block_slot_storage>)->Arg(64)->Arg(256)->Arg(1024)->UseRealTime();
BENCHMARK(decode_step<rr::token_major, rr::block_slot_storage>)->Arg(64)->Arg(256)->Arg(1024)->UseRealTime();
BENCHMARK(extract_request<rr::per_request_storage>)->Arg(1024)->Arg(4096);
BENCHMARK(extract_request<rr::block_slot_storage>)->Arg(1024)->Arg(4096);
BENCHMARK_MAIN();
