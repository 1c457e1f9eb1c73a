// Host time of one launch of the staging kernel's shape (64 rows of K = 8 int64 ids into int32), by
// the ways the library and its binding can enqueue it: cub::DeviceFor::Bulk (the binding's staged
// capture before this folder's change), triple chevrons and cudaGetLastError() (launch_async before
// this folder's change), cuda_backend::launch_async (cudaLaunchKernelEx, no attributes, since) and
// cuda_backend::launch_dependent_async (cudaLaunchKernelEx with programmatic stream serialization,
// as capture() launches). Each way: 1000 launches back to back on one stream, then
// a synchronize; the median over 16 such batches, alternating the ways. One JSON line per way.
// Build (repository root): nvcc -std=c++20 -O3 -DNDEBUG -arch=native -I include
//   benchmarks/results/h200-2026-11-26-planner-trim/launch_probe.cu -o build/launch_probe
#include <routing_replay/cuda_backend.cuh>
#include <routing_replay/detail/kernels.hpp>

#include <cub/device/device_for.cuh>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace rr = routing_replay;

namespace {

constexpr std::int64_t rows = 64, top_k = 8, items = rows * top_k;

struct stage_item {  // one thread per id, as cub::DeviceFor::Bulk calls it
  std::int32_t* out;
  const std::int64_t* in;
  __device__ void operator()(std::int64_t i) const { out[i] = static_cast<std::int32_t>(in[i]); }
};

struct stage_block {  // the same work in the block shape of Backend::launch_async
  std::int32_t* out;
  const std::int64_t* in;
  std::int64_t n;
  __device__ void operator()(std::int32_t block, std::int32_t thread) const
  {
    const std::int64_t i = static_cast<std::int64_t>(block) * rr::detail::kernel_block_threads + thread;
    if (i < n) { out[i] = static_cast<std::int32_t>(in[i]); }
  }
};

template <class Launch>
double batch_us(Launch&& launch, cudaStream_t s)
{
  constexpr int calls = 1000;
  const auto t0       = std::chrono::steady_clock::now();
  for (int c = 0; c < calls; ++c) { launch(); }
  const auto t1 = std::chrono::steady_clock::now();
  cudaStreamSynchronize(s);
  return std::chrono::duration<double, std::micro>(t1 - t0).count() / calls;
}

}  // namespace

int main()
{
  std::int32_t* out = nullptr;
  std::int64_t* in  = nullptr;
  cudaMalloc(&out, items * sizeof(std::int32_t));
  cudaMalloc(&in, items * sizeof(std::int64_t));
  cudaMemset(in, 0, items * sizeof(std::int64_t));
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  const cuda::stream_ref ref{s};
  const int blocks = rr::detail::blocks_for(items);
  auto cub_bulk    = [&] { cub::DeviceFor::Bulk(items, stage_item{out, in}, s); };
  auto chevrons    = [&] {
    rr::detail::block_kernel<<<blocks, rr::detail::kernel_block_threads, 0, s>>>(stage_block{out, in, items});
    (void)cudaGetLastError();
  };
  auto plain = [&] { rr::cuda_backend::launch_async(blocks, rr::detail::kernel_block_threads, stage_block{out, in, items}, ref); };
  auto dependent   = [&] {
    rr::cuda_backend::launch_dependent_async(blocks, rr::detail::kernel_block_threads, stage_block{out, in, items}, ref);
  };
  constexpr int ways = 4;
  auto run_way = [&](int way) {
    switch (way) {
      case 0: return batch_us(cub_bulk, s);
      case 1: return batch_us(chevrons, s);
      case 2: return batch_us(plain, s);
      default: return batch_us(dependent, s);
    }
  };
  for (int way = 0; way < ways; ++way) { run_way(way); }  // warm-up: modules loaded, caches filled
  std::vector<double> t[ways];
  for (int b = 0; b < 16; ++b) {
    for (int k = 0; k < ways; ++k) {  // which way goes first rotates
      const int way = (b + k) % ways;
      t[way].push_back(run_way(way));
    }
  }
  const char* names[ways] = {"cub_device_for_bulk", "triple_chevrons", "launch_async", "launch_dependent_async"};
  for (int way = 0; way < ways; ++way) {
    std::sort(t[way].begin(), t[way].end());
    std::printf("{\"probe\": \"launch\", \"way\": \"%s\", \"items\": %lld, \"us_per_launch\": %.3f, "
                "\"min\": %.3f, \"max\": %.3f}\n",
                names[way], static_cast<long long>(items), t[way][t[way].size() / 2], t[way].front(), t[way].back());
  }
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
