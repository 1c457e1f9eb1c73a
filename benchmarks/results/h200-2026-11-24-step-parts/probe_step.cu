// Probe of 2026-11-24 (kept with its results): begin_step/end_step host time on a GPU, by part.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>
#define private public
#define protected public
#include <routing_replay/routing_replay.cuh>
#include <cuda/atomic>
namespace rr = routing_replay;
using clk = std::chrono::steady_clock;
static double us(clk::time_point a, clk::time_point b) { return std::chrono::duration<double, std::micro>(b - a).count(); }
static double med(std::vector<double> v) { if (v.empty()) return -1; std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end()); return v[v.size() / 2]; }

struct wait_open {
  int* flag;
  __host__ __device__ void operator()(std::int64_t) const {
    cuda::atomic_ref<int, cuda::thread_scope_system> open{*flag};
    while (open.load(cuda::std::memory_order_acquire) == 0) { NV_IF_TARGET(NV_IS_DEVICE, (__nanosleep(100);)) }
  }
};
struct nop { __host__ __device__ void operator()(std::int64_t) const {} };
struct gate_t {
  int* flag;
  gate_t() { cudaHostAlloc(&flag, 4, cudaHostAllocMapped); *flag = 1; }
  void close(cuda::stream_ref s) { cuda::atomic_ref<int, cuda::thread_scope_system>{*flag}.store(0); rr::cuda_backend::bulk_async(1, wait_open{flag}, s); }
  void open() { cuda::atomic_ref<int, cuda::thread_scope_system>{*flag}.store(1); }
};
__global__ void fill_ids(std::int64_t* ids, std::int64_t n) { for (std::int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) ids[i] = (i * 7) % 128; }

static gate_t* gate;
static std::vector<double>* junk;
static double sweep() { double a = 0; for (auto& x : *junk) { x += 1.0; a += x; } return a; }

void floors(cuda::stream_ref s, bool gated) {
  std::vector<double> launch, rec, wait, query, memcpy_ops;
  rr::cuda_event e;
  rr::cuda_stream other;
  for (int i = 0; i < 300; ++i) {
    if (gated) gate->close(s);
    auto a = clk::now(); rr::cuda_backend::bulk_async(1, nop{}, s); auto b = clk::now();
    cudaEventRecord(e.get(), s.get()); auto c = clk::now();
    cudaStreamWaitEvent(other.get(), e.get(), 0); auto d = clk::now();
    (void)cudaEventQuery(e.get()); auto f = clk::now();
    if (gated) gate->open();
    cudaStreamSynchronize(s.get()); cudaStreamSynchronize(other.get());
    if (i >= 20) { launch.push_back(us(a, b)); rec.push_back(us(b, c)); wait.push_back(us(c, d)); query.push_back(us(d, f)); }
  }
  std::printf("{\"probe\":\"floors\",\"gated\":%d,\"launch_us\":%.2f,\"record_us\":%.2f,\"wait_us\":%.2f,\"query_us\":%.2f}\n", gated, med(launch), med(rec), med(wait), med(query));
}

template <class Storage, class Copy>
void run(int B, int T, const char* name, bool gated, int steps) {
  rr::replay_config c;
  c.num_experts = 128; c.top_k = 8; c.max_tokens_per_step = 8192; c.max_model_len = 4096;
  c.moe_layers.resize(48); std::iota(c.moe_layers.begin(), c.moe_layers.end(), 0);
  const std::int64_t bs = 16, bpr = (4096 + bs - 1) / bs;
  c.block_size = bs; c.num_blocks = bpr * B + 16;
  using R = rr::RoutingReplay<rr::cuda_backend, std::int16_t, rr::layer_major, Copy, Storage>;
  R rep{c};
  rr::cuda_stream cs; auto s = cs.ref();
  std::int64_t* ids; cudaMalloc(&ids, sizeof(std::int64_t) * 8192 * 8); fill_ids<<<64, 256>>>(ids, 8192 * 8); cudaDeviceSynchronize();
  std::vector<rr::request_handle> hs;
  for (int r = 0; r < B; ++r) hs.push_back(rep.add_request(r));
  rr::step_plan plan;
  std::vector<std::int64_t> slots, fresh;
  std::vector<double> vb, va, vo, ve, pre, harv, post;
  for (int st = 0; st < steps; ++st) {
    plan.clear(); slots.clear(); fresh.clear(); slots.reserve(std::size_t(B) * T);
    const std::int64_t p0 = T > 1 ? st * T : st;
    for (int r = 0; r < B; ++r) {
      std::size_t first = slots.size();
      for (int i = 0; i < T; ++i) { auto p = p0 + i; if (p % bs == 0) fresh.push_back(r * bpr + p / bs); slots.push_back((r * bpr + p / bs) * bs + p % bs); }
      rr::scheduled_request q{.id = hs[r], .first_position = p0, .num_tokens = T};
      if constexpr (R::filer_type::store_type::slot_indexed) q.slots = std::span<const std::int64_t>{slots}.subspan(first);
      plan.schedule(q);
    }
    plan.add_fresh_blocks(fresh);
    auto t0 = clk::now();
    rep.planner_.validate(plan, rep.requests_, rep.filer_);
    rep.buffer_.begin_step(plan.num_rows(), s);
    auto t1 = clk::now();
    rep.planner_.open(plan, rep.requests_, rep.filer_);
    auto t2 = clk::now();
    for (int l = 0; l < 48; ++l) rep.capture(l, ids, std::int64_t(B) * T, s);
    cudaStreamSynchronize(s.get());
    if (junk) sweep();
    if (gated) gate->close(s);
    clk::time_point h0, h1;
    auto t3 = clk::now();
    rep.end_step(s, [&](auto& d, const auto& closed, auto* snapshot, auto* status, auto str) {
      h0 = clk::now(); d.end_step(snapshot, status, closed.num_rows, closed.padded_rows, str); h1 = clk::now(); });
    auto t4 = clk::now();
    if (gated) gate->open();
    cudaStreamSynchronize(s.get());
    if (T > 1 || st >= 20) { va.push_back(us(t0, t1)); vo.push_back(us(t1, t2)); vb.push_back(us(t0, t2)); ve.push_back(us(t3, t4)); pre.push_back(us(t3, h0)); harv.push_back(us(h0, h1)); post.push_back(us(h1, t4)); }
  }
  rep.drain();
  std::printf("{\"probe\":\"step\",\"combo\":\"%s\",\"B\":%d,\"T\":%d,\"gated\":%d,\"begin_us\":%.2f,\"validate_us\":%.2f,\"open_us\":%.2f,\"end_us\":%.2f,\"end_pre_us\":%.2f,\"harvest_us\":%.2f,\"end_post_us\":%.2f}\n",
              name, B, T, gated, med(vb), med(va), med(vo), med(ve), med(pre), med(harv), med(post));
  cudaFree(ids);
}
int main(int argc, char** argv) {
  gate = new gate_t;
  rr::cuda_stream cs;
  if (argc > 1 && std::string{argv[1]} == "sweep") {
    junk = new std::vector<double>(std::size_t{64} << 17, 1.0);  // 64 MB
    for (int B : {1, 64, 1024}) run<rr::per_request_storage, rr::device_scatter<>>(B, 1, "device_scatter/per_request+sweep64MB", false, 200);
    delete junk; junk = nullptr;
    for (int B : {1, 64, 1024}) run<rr::per_request_storage, rr::device_scatter<>>(B, 1, "device_scatter/per_request", false, 200);
    return 0;
  }
  if (argc > 1) { run<rr::per_request_storage, rr::device_scatter<>>(64, 1, "device_scatter/per_request", false, 200); return 0; }
  for (bool g : {false, true}) floors(cs.ref(), g);
  for (bool g : {false, true})
    for (int B : {1, 64, 1024}) {
      run<rr::per_request_storage, rr::device_scatter<>>(B, 1, "device_scatter/per_request", g, 200);
      run<rr::block_slot_storage, rr::device_scatter<>>(B, 1, "device_scatter/block_slot", g, 200);
      run<rr::per_request_storage, rr::double_buffered<>>(B, 1, "double_buffered/per_request", g, 200);
    }
  run<rr::per_request_storage, rr::device_scatter<>>(4, 2048, "device_scatter/per_request", false, 2);
}
