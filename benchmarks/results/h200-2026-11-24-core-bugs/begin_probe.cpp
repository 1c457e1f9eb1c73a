// begin_step / end_step host cost, host backend, decode B requests, block_slot and per_request.
#include "bench_common.hpp"
#include <chrono>
#include <cstdio>
using namespace rr_bench;
template <class Storage, class Copy>
void run(const char* name, int batch, int steps)
{
  using R = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::token_major, Copy, Storage>;
  R replay{bench_config(batch, batch)};
  rr::host_stream stream;
  step_driver driver{batch, 1};
  driver.add_requests(replay);
  std::vector<double> b, e;
  for (int i = 0; i < steps; ++i) {
    const auto& plan = driver.next();
    auto t0 = std::chrono::steady_clock::now();
    replay.begin_step(plan, stream.ref());
    auto t1 = std::chrono::steady_clock::now();
    rr::host_backend::bulk_async(std::int64_t{bench_layers} * driver.rows() * bench_topk,
                                 record_all_layers<typename R::ref_type>{replay.ref(driver.rows()), driver.rows()}, stream.ref());
    stream.synchronize();
    auto t2 = std::chrono::steady_clock::now();
    replay.end_step(stream.ref());
    auto t3 = std::chrono::steady_clock::now();
    if (i >= steps / 4) { b.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count()); e.push_back(std::chrono::duration<double, std::micro>(t3 - t2).count()); }
  }
  replay.drain();
  std::sort(b.begin(), b.end()); std::sort(e.begin(), e.end());
  std::printf("{\"probe\":\"%s\",\"batch\":%d,\"begin_us\":%.2f,\"end_us\":%.2f}\n", name, batch, b[b.size()/2], e[e.size()/2]);
}
int main()
{
  for (int batch : {64, 1024}) {
    run<rr::block_slot_storage, rr::device_scatter<2>>("block_slot/device_scatter", batch, 800);
    run<rr::per_request_storage, rr::device_scatter<2>>("per_request/device_scatter", batch, 800);
  }
}
