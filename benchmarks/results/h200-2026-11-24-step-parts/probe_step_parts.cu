// Probe of 2026-11-24 (kept with its results): end_step by part, the legacy stream, prefill mapping,
// contention. Built against the tree 0e11edb with probe_step_parts_timers.patch applied (the timers g_acc).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <string>
#include <thread>
#include <vector>
#include <sys/mman.h>
#include <unistd.h>
#define private public
#define protected public
#include <routing_replay/routing_replay.cuh>
#include <cuda/atomic>
namespace rr = routing_replay;
using clk = std::chrono::steady_clock;
static double us(clk::time_point a, clk::time_point b) { return std::chrono::duration<double, std::micro>(b - a).count(); }
static double med(std::vector<double> v) { if (v.empty()) return -1; std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end()); return v[v.size() / 2]; }
struct nop { __host__ __device__ void operator()(std::int64_t) const {} };
__global__ void fill_ids(std::int64_t* ids, std::int64_t n) { for (std::int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) ids[i] = (i * 7) % 128; }

static void dump(const char* name, int B, int legacy, long long ahead) {
  std::printf("{\"probe\":\"timers\",\"combo\":\"%s\",\"B\":%d,\"legacy\":%d,\"ahead\":%lld", name, B, legacy, ahead);
  for (int k = 0; k < 64; ++k) if (g_cnt[k]) std::printf(",\"t%d\":[%.2f,%ld]", k, g_acc[k] / g_cnt[k], g_cnt[k]);
  std::printf("}\n");
}

template <class Storage, class Copy>
void run(int B, int T, const char* name, int steps, bool legacy = false, long long ahead = -1, int sleep_ms = 0) {
  rr::replay_config c;
  c.num_experts = 128; c.top_k = 8; c.max_tokens_per_step = 8192; c.max_model_len = 4096;
  c.moe_layers.resize(48); std::iota(c.moe_layers.begin(), c.moe_layers.end(), 0);
  const std::int64_t bs = 16, bpr = (4096 + bs - 1) / bs;
  c.block_size = bs; c.num_blocks = bpr * (T > 1 ? B * steps : B) + 16;
  c.host_memory_ahead = ahead;
  using R = rr::RoutingReplay<rr::cuda_backend, std::int16_t, rr::layer_major, Copy, Storage>;
  R rep{c};
  if (sleep_ms) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
  rr::cuda_stream cs;
  auto s = legacy ? cuda::stream_ref{cudaStreamLegacy} : cs.ref();
  std::int64_t* ids; cudaMalloc(&ids, sizeof(std::int64_t) * 8192 * 8); fill_ids<<<64, 256>>>(ids, 8192 * 8); cudaDeviceSynchronize();
  std::vector<rr::request_handle> hs;
  if (T == 1) for (int r = 0; r < B; ++r) hs.push_back(rep.add_request(r));
  rr::step_plan plan;
  std::vector<std::int64_t> slots, fresh;
  std::vector<double> vb, ve;
  for (int st = 0; st < steps; ++st) {
    if (st == (T > 1 ? 0 : 20)) { for (auto& a : g_acc) a = 0; for (auto& n : g_cnt) n = 0; }
    if (T > 1) { hs.clear(); for (int r = 0; r < B; ++r) hs.push_back(rep.add_request(1000 + st * B + r)); }
    plan.clear(); slots.clear(); fresh.clear(); slots.reserve(std::size_t(B) * T);
    const std::int64_t p0 = T > 1 ? 0 : st;
    for (int r = 0; r < B; ++r) {
      const std::int64_t req = T > 1 ? st * B + r : r;
      std::size_t first = slots.size();
      for (int i = 0; i < T; ++i) { auto p = p0 + i; if (p % bs == 0) fresh.push_back(req * bpr + p / bs); slots.push_back((req * bpr + p / bs) * bs + p % bs); }
      rr::scheduled_request q{.id = hs[r], .first_position = p0, .num_tokens = T};
      if constexpr (R::filer_type::store_type::slot_indexed) q.slots = std::span<const std::int64_t>{slots}.subspan(first);
      plan.schedule(q);
    }
    plan.add_fresh_blocks(fresh);
    auto t0 = clk::now();
    rep.begin_step(plan, s);
    auto t1 = clk::now();
    for (int l = 0; l < 48; ++l) rep.capture(l, ids, std::int64_t(B) * T, s);
    cudaStreamSynchronize(s.get());
    auto t3 = clk::now();
    rep.end_step(s);
    auto t4 = clk::now();
    cudaStreamSynchronize(s.get());
    if (T > 1) std::printf("{\"probe\":\"prefill_step\",\"ahead\":%lld,\"step\":%d,\"begin_us\":%.1f,\"end_us\":%.1f}\n", ahead, st, us(t0, t1), us(t3, t4));
    if (T > 1 || st >= 20) { vb.push_back(us(t0, t1)); ve.push_back(us(t3, t4)); }
  }
  rep.drain();
  dump(name, B, legacy, ahead);
  std::printf("{\"probe\":\"step\",\"combo\":\"%s\",\"B\":%d,\"T\":%d,\"legacy\":%d,\"ahead\":%lld,\"begin_us\":%.2f,\"end_us\":%.2f}\n", name, B, T, legacy, ahead, med(vb), med(ve));
  std::fflush(stdout);
  cudaFree(ids);
}

// thread A pins fresh shared memory superblock by superblock; the main thread maps segments and launches
void contention(bool busy) {
  const std::size_t sb = 6u << 20, seg = 1u << 20;
  int fd = memfd_create("probe", 0); if (ftruncate(fd, 1ll << 32) != 0) return;
  std::atomic<bool> stop{false}; std::atomic<long> regs{0};
  std::thread a([&] {
    std::size_t off = 1ull << 31;
    while (busy && !stop.load()) {
      void* p = mmap(nullptr, sb, PROT_READ | PROT_WRITE, MAP_SHARED, fd, off); off += sb;
      for (std::size_t b = 0; b < sb; b += 4096) static_cast<volatile char*>(p)[b] = 0;
      cudaHostRegister(p, sb, cudaHostRegisterMapped | cudaHostRegisterPortable); ++regs;
      if (off > (1ull << 31) + (1ull << 30)) off = 1ull << 31;
      cudaHostUnregister(p); munmap(p, sb);
    }
  });
  char* view = static_cast<char*>(mmap(nullptr, 256u << 20, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
  std::vector<double> m, l; rr::cuda_stream cs;
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  for (int i = 0; i < 200; ++i) {
    auto t0 = clk::now();
    mmap(view + (i % 128) * seg, seg, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, std::size_t(i) * seg);
    auto t1 = clk::now();
    rr::cuda_backend::bulk_async(1, nop{}, cs.ref());
    auto t2 = clk::now();
    m.push_back(us(t0, t1)); l.push_back(us(t1, t2));
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  stop = true; a.join(); cudaStreamSynchronize(cs.get());
  std::sort(m.begin(), m.end()); std::sort(l.begin(), l.end());
  std::printf("{\"probe\":\"contention\",\"busy\":%d,\"registrations\":%ld,\"mmap_fixed_us_p50_p90_max\":[%.1f,%.1f,%.1f],\"launch_us_p50_p90_max\":[%.1f,%.1f,%.1f]}\n", busy, regs.load(),
              m[100], m[180], m[199], l[100], l[180], l[199]);
  munmap(view, 256u << 20); close(fd);
}

int main() {
  for (bool legacy : {false, true})
    for (int B : {1, 64, 1024}) run<rr::per_request_storage, rr::device_scatter<>>(B, 1, "device_scatter/per_request", 200, legacy);
  run<rr::block_slot_storage, rr::device_scatter<>>(1024, 1, "device_scatter/block_slot", 200);
  run<rr::per_request_storage, rr::device_scatter<>>(4, 2048, "device_scatter/per_request", 8, false, -1, 0);
  run<rr::per_request_storage, rr::device_scatter<>>(4, 2048, "device_scatter/per_request", 8, false, 64ll << 20, 1500);
  run<rr::per_request_storage, rr::device_scatter<>>(4, 2048, "device_scatter/per_request", 8, false, 0, 0);
  run<rr::per_request_storage, rr::device_scatter<>>(4, 2048, "device_scatter/per_request", 8, false, -1, 1500);
  contention(false); contention(true);
}
