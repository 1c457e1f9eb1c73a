// block_slot begin_step at decode B1024 (host backend) against the floor of its access pattern: per
// request, the lines block-slot storage must touch whatever its code (the request's position-map
// entry, written; the slot's state, read and written; the block's generation, read), touched by a
// loop that does nothing else, on structures of the same shapes, in the same engine loop (so the
// step's other work leaves the caches as cold for it as for begin_step).
#include "bench_common.hpp"
#include <chrono>
#include <cstdio>
using namespace rr_bench;
struct slot_like { std::uint64_t a; std::uint32_t b, c; };
struct pos_like { std::int32_t s; std::uint32_t g; std::int32_t s2; std::uint32_t g2; std::uint64_t m; };
template <class Storage>
void run(const char* name, int batch, int steps)
{
  using R = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major, rr::device_scatter<2>, Storage>;
  const auto cfg = bench_config(batch, batch);
  R replay{cfg};
  rr::host_stream stream;
  std::vector<rr::request_handle> handles;
  for (int r = 0; r < batch; ++r) handles.push_back(replay.add_request(r));
  std::vector<std::int64_t> slots(batch);
  // the floor's structures, shaped as block_slot_store's
  std::vector<slot_like> slot_state(static_cast<std::size_t>(cfg.num_blocks * cfg.block_size));
  std::vector<std::uint32_t> generation(static_cast<std::size_t>(cfg.num_blocks), 1u);
  std::vector<std::vector<pos_like>> maps(batch);
  rr::step_plan plan;
  std::vector<double> b, f;
  std::int64_t position = 0;
  std::uint64_t sink = 0;
  for (int i = 0; i < steps; ++i) {
    plan.clear();
    if (position + 1 > bench_model_len) position = 0;
    for (int r = 0; r < batch; ++r) {
      slots[r] = std::int64_t{r} * bench_model_len + position;
      plan.schedule({handles[r], position, 1, 0, std::span<const std::int64_t>{&slots[r], 1}});
    }
    const bool floor_first = (i & 1) != 0;  // alternate which of the two runs first after the step
    auto touch = [&] {
      auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < batch; ++r) {
        const auto s = static_cast<std::size_t>(slots[r]);
        auto& st = slot_state[s];
        sink += generation[s / 16];
        st.a = static_cast<std::uint64_t>(i); st.c = static_cast<std::uint32_t>(i);
        auto& m = maps[r];
        if (m.size() <= static_cast<std::size_t>(position)) { m.emplace_back(); }
        m[static_cast<std::size_t>(position)].m = static_cast<std::uint64_t>(i);
      }
      return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    };
    double fu = floor_first ? touch() : 0.0;
    auto t0 = std::chrono::steady_clock::now();
    replay.begin_step(plan, stream.ref());
    auto t1 = std::chrono::steady_clock::now();
    if (!floor_first) fu = touch();
    ++position;
    rr::host_backend::bulk_async(std::int64_t{bench_layers} * batch * bench_topk,
                                 record_all_layers<typename R::ref_type>{replay.ref(batch), batch}, stream.ref());
    replay.end_step(stream.ref());
    stream.synchronize();
    if (i >= steps / 4) {
      b.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      f.push_back(fu);
    }
  }
  replay.drain();
  std::sort(b.begin(), b.end());
  std::sort(f.begin(), f.end());
  std::printf("{\"probe\":\"%s\",\"batch\":%d,\"begin_us\":%.2f,\"floor_touch_us\":%.2f,\"sink\":%llu}\n", name, batch,
              b[b.size() / 2], f[f.size() / 2], static_cast<unsigned long long>(sink % 7));
}
int main(int argc, char** argv)
{
  int steps = argc > 1 ? std::atoi(argv[1]) : 1500;
  run<rr::block_slot_storage>("block_slot", 1024, steps);
}
