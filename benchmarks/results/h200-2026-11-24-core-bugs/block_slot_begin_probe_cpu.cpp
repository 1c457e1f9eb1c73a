// block_slot begin_step host cost, decode B requests scheduled by handle (host backend).
#include "bench_common.hpp"
#include <chrono>
#include <cstdio>
using namespace rr_bench;
template <class Storage>
void run(const char* name, int batch, int steps)
{
  using R = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major, rr::device_scatter<2>, Storage>;
  R replay{bench_config(batch, batch)};
  rr::host_stream stream;
  std::vector<rr::request_handle> handles;
  for (int r = 0; r < batch; ++r) handles.push_back(replay.add_request(r));
  std::vector<std::int64_t> slots(batch);
  rr::step_plan plan;
  std::vector<double> b;
  std::int64_t position = 0;
  for (int i = 0; i < steps; ++i) {
    plan.clear();
    if (position + 1 > bench_model_len) position = 0;
    for (int r = 0; r < batch; ++r) {
      slots[r] = std::int64_t{r} * bench_model_len + position;
      plan.schedule({handles[r], position, 1, 0, std::span<const std::int64_t>{&slots[r], 1}});
    }
    ++position;
    auto t0 = std::chrono::steady_clock::now();
    replay.begin_step(plan, stream.ref());
    auto t1 = std::chrono::steady_clock::now();
    rr::host_backend::bulk_async(std::int64_t{bench_layers} * batch * bench_topk,
                                 record_all_layers<typename R::ref_type>{replay.ref(batch), batch}, stream.ref());
    replay.end_step(stream.ref());
    stream.synchronize();
    if (i >= steps / 4) b.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  replay.drain();
  std::sort(b.begin(), b.end());
  std::printf("{\"probe\":\"%s\",\"batch\":%d,\"begin_us\":%.2f,\"p10\":%.2f}\n", name, batch, b[b.size()/2], b[b.size()/10]);
}
int main(int argc, char** argv)
{
  int steps = argc > 1 ? std::atoi(argv[1]) : 1500;
  run<rr::block_slot_storage>("block_slot", 1024, steps);
  if (argc < 3) run<rr::per_request_storage>("per_request", 1024, steps);
}
