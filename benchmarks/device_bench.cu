// CUDA microbenchmarks (L = 48, K = 8, E = 128): the library's device-side pieces, one policy
// swapped at a time, next to the physical limits of DESIGN.md section 5 measured the same way.
// Without a usable CUDA device nothing is registered: the program says so and exits 0.
//
//   capture/<index>/<layout>/rows:N/overlap:0|1   capture() of every layer from int64 router
//                                     output, recorded once in a CUDA graph and replayed: device time
//                                     per layer (manual time = one layer), bytes read + written per
//                                     second; overlap:1 with dependent (overlapping) launches
//   step/<policy>/rows:N              a whole step (begin_step, one kernel recording every layer
//                                     through ref(), end_step, stream synchronize), real time;
//                                     bytes moved per second and of_pinned_peak: that rate over the
//                                     pinned_d2h rate measured for the same bytes
//   pinned_d2h/bytes:N                cudaMemcpyAsync device -> pinned host (the reference peak)
//   mapped_write/bytes:N              a kernel writing mapped pinned host memory
//   empty_kernel/eager_sync           launch + stream synchronize round trip
//   empty_kernel/eager_launch         one launch of a batch of 100, synchronized per batch
//   empty_kernel/graph                one kernel of a 100-kernel CUDA graph replay
//   event/record/0, event/query/1     host cost of cudaEventRecord, of cudaEventQuery (completed)
//   end_of_step/<index>/<layout>/rows:N  the end-of-step kernel alone (check, snapshot, reset of N
//                                     rows): device time, bytes read + written per second
//   d2d_copy/bytes:N                  cudaMemcpyAsync device -> device (bytes read + written per
//                                     second): the memory speed the end-of-step kernel aims at
//   call/<name>                       host cost of each CUDA call end_step() may issue
//   host_register/bytes:N             cudaHostRegister + cudaHostUnregister of N fresh bytes (what
//                                     registering per-request rows as they grow would cost)
//   memfd_map/bytes:N                 mapping N bytes of a memfd into a reserved range and back
//                                     (what growing per-request rows costs instead)
#include "bench_common.hpp"

#include <routing_replay/routing_replay.cuh>

#include <sys/mman.h>
#include <unistd.h>

#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace rr_bench;

constexpr int kernels_per_batch = 100;  ///< calls timed together, then synchronized

void check(cudaError_t status, const char* what)
{
  if (status != cudaSuccess) {
    throw std::runtime_error{std::string{what} + " failed: " + cudaGetErrorName(status) + " (" +
                             cudaGetErrorString(status) + ")"};
  }
}

/// @brief A stream, a pair of timing events and helpers; everything checked, released at scope end.
class cuda_timing {
 public:
  cuda_timing()
  {
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    check(cudaEventCreate(&start_), "cudaEventCreate");
    check(cudaEventCreate(&stop_), "cudaEventCreate");
  }
  cuda_timing(const cuda_timing&)            = delete;
  cuda_timing& operator=(const cuda_timing&) = delete;
  ~cuda_timing()
  {
    cudaEventDestroy(stop_);
    cudaEventDestroy(start_);
    cudaStreamDestroy(stream);
  }
  void start() { check(cudaEventRecord(start_, stream), "cudaEventRecord"); }
  /// @brief Seconds since start(), once the stream reaches this point.
  double stop_seconds()
  {
    check(cudaEventRecord(stop_, stream), "cudaEventRecord");
    check(cudaEventSynchronize(stop_), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start_, stop_), "cudaEventElapsedTime");
    return double{ms} / 1e3;
  }
  cudaStream_t stream = nullptr;

 private:
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_  = nullptr;
};

/// @brief Device (or pinned, or mapped) memory that frees itself.
struct cuda_buffer {
  enum class kind { device, pinned, mapped };
  cuda_buffer(std::size_t bytes, kind k) : kind_(k)
  {
    if (k == kind::device) {
      check(cudaMalloc(&ptr, bytes), "cudaMalloc");
    } else {
      check(cudaHostAlloc(&ptr, bytes, k == kind::mapped ? cudaHostAllocMapped : cudaHostAllocDefault),
            "cudaHostAlloc");
    }
  }
  cuda_buffer(const cuda_buffer&)            = delete;
  cuda_buffer& operator=(const cuda_buffer&) = delete;
  ~cuda_buffer()
  {
    if (kind_ == kind::device) {
      cudaFree(ptr);
    } else {
      cudaFreeHost(ptr);
    }
  }
  void* ptr = nullptr;

 private:
  kind kind_;
};

/// @brief Records a CUDA graph of what `record` enqueues on `stream`.
template <class Record>
cudaGraphExec_t record_graph(cudaStream_t stream, Record&& record)
{
  check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  cudaGraph_t graph = nullptr;
  try {
    record();
  } catch (...) {
    cudaStreamEndCapture(stream, &graph);
    if (graph != nullptr) { cudaGraphDestroy(graph); }
    throw;
  }
  check(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
  cudaGraphExec_t exec = nullptr;
  const cudaError_t e  = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  check(e, "cudaGraphInstantiate");
  return exec;
}

/// @brief Runs a benchmark body; a CUDA or library failure becomes a skipped benchmark with the
/// message, never a crash.
template <class Body>
void guarded(benchmark::State& state, Body&& body)
{
  try {
    body();
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

/// @brief Bytes per second of a pinned D2H copy of `bytes`, measured once per size (median of 21).
double pinned_peak(std::size_t bytes)
{
  static std::map<std::size_t, double> measured;
  if (auto it = measured.find(bytes); it != measured.end()) { return it->second; }
  cuda_timing t;
  cuda_buffer device{bytes, cuda_buffer::kind::device};
  cuda_buffer host{bytes, cuda_buffer::kind::pinned};
  std::vector<double> rates;
  for (int i = 0; i < 21; ++i) {
    t.start();
    check(cudaMemcpyAsync(host.ptr, device.ptr, bytes, cudaMemcpyDeviceToHost, t.stream), "cudaMemcpyAsync");
    rates.push_back(static_cast<double>(bytes) / t.stop_seconds());
  }
  std::nth_element(rates.begin(), rates.begin() + 10, rates.end());
  return measured[bytes] = rates[10];
}

// ---- the library ------------------------------------------------------------------------------

/// @brief Fills int64 router output [rows, K] with valid ids.
struct fill_ids {
  std::int64_t* ids;
  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t i) const { ids[i] = (i * 17) % bench_experts; }
};

template <class Index, class Layout>
void capture_layers(benchmark::State& state)
{
  rr::cuda_backend::dependent_launches = state.range(1) != 0;
  guarded(state, [&] {
    using replay_type = rr::RoutingReplay<rr::cuda_backend, Index, Layout>;
    const auto rows   = static_cast<std::int32_t>(state.range(0));
    replay_type replay{bench_config(rows, 1)};
    cuda_timing t;
    cuda_buffer ids{static_cast<std::size_t>(rows) * bench_topk * sizeof(std::int64_t), cuda_buffer::kind::device};
    auto* source = static_cast<std::int64_t*>(ids.ptr);
    rr::cuda_backend::bulk_async(std::int64_t{rows} * bench_topk, fill_ids{source}, cuda::stream_ref{t.stream});
    // outside any step: the library resets these rows at the next begin_step (never called here)
    cudaGraphExec_t graph = record_graph(t.stream, [&] {
      for (std::int32_t layer = 0; layer < bench_layers; ++layer) {
        replay.capture(layer, source, rows, cuda::stream_ref{t.stream});
      }
    });
    for (auto _ : state) {
      t.start();
      check(cudaGraphLaunch(graph, t.stream), "cudaGraphLaunch");
      state.SetIterationTime(t.stop_seconds() / bench_layers);  // one layer
    }
    cudaGraphExecDestroy(graph);
    state.SetBytesProcessed(state.iterations() * std::int64_t{rows} * bench_topk *
                            static_cast<std::int64_t>(sizeof(std::int64_t) + sizeof(Index)));
  });
}

template <class Index, class Layout, class Copy, class Storage>
void library_step(benchmark::State& state)
{
  guarded(state, [&] {
    using replay_type = rr::RoutingReplay<rr::cuda_backend, Index, Layout, Copy, Storage>;
    const auto rows   = static_cast<std::int32_t>(state.range(0));
    const std::int32_t batch = std::min(rows, 1024);  // decode steps, or prefill chunks of rows / 1024
    replay_type replay{bench_config(rows, batch)};
    rr::cuda_stream stream;
    step_driver driver{batch, rows / batch};
    driver.add_requests(replay);
    const auto bytes = static_cast<std::size_t>(rows) * bench_layers * bench_topk * sizeof(Index);
    for (auto _ : state) {
      replay.begin_step(driver.next(), stream.ref());
      rr::cuda_backend::bulk_async(std::int64_t{bench_layers} * rows * bench_topk,
                                   record_all_layers<typename replay_type::ref_type>{replay.ref(rows), rows},
                                   stream.ref());
      replay.end_step(stream.ref());
      rr::cuda_backend::synchronize(stream.ref());  // the engine's readback of sampled tokens
    }
    replay.drain();
    rr::cuda_backend::synchronize(stream.ref());
    state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes));
    state.counters["of_pinned_peak"] = benchmark::Counter(
      static_cast<double>(bytes) / pinned_peak(bytes), benchmark::Counter::kIsIterationInvariantRate);
  });
}

/// @brief Writes every row of every layer through a device reference (a forward that captured all).
template <class Ref>
struct fill_rows {
  Ref ref;
  std::int32_t rows;
  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t i) const
  {
    const auto layer = static_cast<std::int32_t>(i / (std::int64_t{rows} * bench_topk));
    const auto row   = static_cast<std::int32_t>((i / bench_topk) % rows);
    ref.record(layer, row, static_cast<std::int32_t>(i % bench_topk), (i * 7) % bench_experts);
  }
};

template <class Index, class Layout>
void end_of_step(benchmark::State& state)
{
  guarded(state, [&] {
    const auto rows   = static_cast<std::int32_t>(state.range(0));
    const auto config = rr::detail::validated_config<Index>(bench_config(rows, 1));
    rr::capture_buffer<rr::cuda_backend, Index, Layout> buffer{config, rr::layer_map{config}};
    const auto elems = static_cast<std::size_t>(rows) * bench_layers * bench_topk;
    thrust::device_vector<Index> snapshot(elems);
    thrust::device_vector<rr::detail::step_status> status(1);
    cuda_timing t;
    const cuda::stream_ref stream{t.stream};
    for (auto _ : state) {
      buffer.begin_step(rows, stream);
      rr::cuda_backend::bulk_async(static_cast<std::int64_t>(elems), fill_rows<decltype(buffer.ref(rows))>{buffer.ref(rows), rows},
                                   stream);
      t.start();
      buffer.end_step(thrust::raw_pointer_cast(snapshot.data()), thrust::raw_pointer_cast(status.data()), rows, -1,
                      stream);
      state.SetIterationTime(t.stop_seconds());
    }
    state.SetBytesProcessed(state.iterations() * 3 * static_cast<std::int64_t>(elems * sizeof(Index)));
  });
}

void d2d_copy(benchmark::State& state)
{
  guarded(state, [&] {
    const auto bytes = static_cast<std::size_t>(state.range(0));
    cuda_timing t;
    cuda_buffer from{bytes, cuda_buffer::kind::device};
    cuda_buffer to{bytes, cuda_buffer::kind::device};
    for (auto _ : state) {
      t.start();
      check(cudaMemcpyAsync(to.ptr, from.ptr, bytes, cudaMemcpyDeviceToDevice, t.stream), "cudaMemcpyAsync");
      state.SetIterationTime(t.stop_seconds());
    }
    state.SetBytesProcessed(state.iterations() * 2 * static_cast<std::int64_t>(bytes));
  });
}

struct empty_block_op {
  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int32_t, std::int32_t) const noexcept {}
};
struct empty_flat_op {
  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t) const noexcept {}
};

/// @brief Host cost of one CUDA call of end_step(): 0 launch_async (a plain launch), 1 CUB
/// DeviceFor::Bulk, 2 cudaStreamWaitEvent, 3 cudaMemcpyAsync of 24 KiB pinned -> device, 4 copying
/// 1024 pieces (24 KiB) into pinned memory on the host. Batches of 100, synchronized per batch.
void call_cost(benchmark::State& state)
{
  guarded(state, [&] {
    cuda_timing t;
    const cuda::stream_ref stream{t.stream};
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    check(cudaEventRecord(e, t.stream), "cudaEventRecord");
    cuda_buffer device{24 << 10, cuda_buffer::kind::device};
    cuda_buffer pinned{24 << 10, cuda_buffer::kind::pinned};
    std::vector<rr::detail::scatter_op<std::int16_t>> ops(1024);
    const auto which = state.range(0);
    for (auto _ : state) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int k = 0; k < kernels_per_batch; ++k) {
        switch (which) {
          case 0: rr::cuda_backend::launch_async(1, 32, empty_block_op{}, stream); break;
          case 1: rr::cuda_backend::bulk_async(32, empty_flat_op{}, stream); break;
          case 2: check(cudaStreamWaitEvent(t.stream, e, 0), "cudaStreamWaitEvent"); break;
          case 3: check(cudaMemcpyAsync(device.ptr, pinned.ptr, 24 << 10, cudaMemcpyHostToDevice, t.stream), "memcpy"); break;
          default: std::copy(ops.begin(), ops.end(), static_cast<rr::detail::scatter_op<std::int16_t>*>(pinned.ptr));
        }
      }
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      check(cudaStreamSynchronize(t.stream), "cudaStreamSynchronize");
      state.SetIterationTime(seconds / kernels_per_batch);
    }
    cudaEventDestroy(e);
  });
}

void host_register(benchmark::State& state)
{
  guarded(state, [&] {
    const auto bytes = static_cast<std::size_t>(state.range(0));
    for (auto _ : state) {
      void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) { throw std::runtime_error{"mmap failed"}; }
      const auto t0 = std::chrono::steady_clock::now();
      check(cudaHostRegister(p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable), "cudaHostRegister");
      check(cudaHostUnregister(p), "cudaHostUnregister");
      state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      ::munmap(p, bytes);
    }
    state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes));
  });
}

void memfd_map(benchmark::State& state)
{
  guarded(state, [&] {
    const auto bytes = static_cast<std::size_t>(state.range(0));
    const int fd     = ::memfd_create("bench", MFD_CLOEXEC);
    if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) { throw std::runtime_error{"memfd failed"}; }
    void* range = ::mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    for (auto _ : state) {
      const auto t0 = std::chrono::steady_clock::now();
      ::mmap(range, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
      ::mmap(range, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
      state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    ::munmap(range, bytes);
    ::close(fd);
  });
}

// ---- physical limits --------------------------------------------------------------------------

void pinned_d2h(benchmark::State& state)
{
  guarded(state, [&] {
    const auto bytes = static_cast<std::size_t>(state.range(0));
    cuda_timing t;
    cuda_buffer device{bytes, cuda_buffer::kind::device};
    cuda_buffer host{bytes, cuda_buffer::kind::pinned};
    for (auto _ : state) {
      t.start();
      check(cudaMemcpyAsync(host.ptr, device.ptr, bytes, cudaMemcpyDeviceToHost, t.stream), "cudaMemcpyAsync");
      state.SetIterationTime(t.stop_seconds());
    }
    state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes));
  });
}

struct write_words {
  std::uint64_t* out;
  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t i) const { out[i] = static_cast<std::uint64_t>(i); }
};

void mapped_write(benchmark::State& state)
{
  guarded(state, [&] {
    const auto bytes = static_cast<std::size_t>(state.range(0));
    cuda_timing t;
    cuda_buffer host{bytes, cuda_buffer::kind::mapped};
    void* device_view = nullptr;
    check(cudaHostGetDevicePointer(&device_view, host.ptr, 0), "cudaHostGetDevicePointer");
    const auto words = static_cast<std::int64_t>(bytes / sizeof(std::uint64_t));
    for (auto _ : state) {
      t.start();
      rr::cuda_backend::bulk_async(words, write_words{static_cast<std::uint64_t*>(device_view)},
                                   cuda::stream_ref{t.stream});
      state.SetIterationTime(t.stop_seconds());
    }
    state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes));
  });
}

__global__ void empty_kernel() {}

void launch_empty(cudaStream_t stream)
{
  empty_kernel<<<1, 1, 0, stream>>>();
  check(cudaGetLastError(), "empty_kernel launch");
}

void empty_kernel_eager_sync(benchmark::State& state)
{
  guarded(state, [&] {
    cuda_timing t;
    for (auto _ : state) {
      launch_empty(t.stream);
      check(cudaStreamSynchronize(t.stream), "cudaStreamSynchronize");
    }
  });
}

void empty_kernel_eager_launch(benchmark::State& state)
{
  guarded(state, [&] {
    cuda_timing t;
    for (auto _ : state) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int k = 0; k < kernels_per_batch; ++k) { launch_empty(t.stream); }
      check(cudaStreamSynchronize(t.stream), "cudaStreamSynchronize");
      state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
                             kernels_per_batch);
    }
  });
}

void empty_kernel_graph(benchmark::State& state)
{
  guarded(state, [&] {
    cuda_timing t;
    cudaGraphExec_t graph = record_graph(t.stream, [&] {
      for (int k = 0; k < kernels_per_batch; ++k) { launch_empty(t.stream); }
    });
    for (auto _ : state) {
      t.start();
      check(cudaGraphLaunch(graph, t.stream), "cudaGraphLaunch");
      state.SetIterationTime(t.stop_seconds() / kernels_per_batch);
    }
    cudaGraphExecDestroy(graph);
  });
}

/// @brief Host cost of cudaEventRecord (range 0) or of cudaEventQuery on a completed event (1).
void event_cost(benchmark::State& state)
{
  guarded(state, [&] {
    const bool query = state.range(0) == 1;
    cuda_timing t;
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    check(cudaEventRecord(e, t.stream), "cudaEventRecord");
    check(cudaEventSynchronize(e), "cudaEventSynchronize");
    for (auto _ : state) {
      benchmark::DoNotOptimize(query ? cudaEventQuery(e) : cudaEventRecord(e, t.stream));
    }
    check(cudaStreamSynchronize(t.stream), "cudaStreamSynchronize");
    cudaEventDestroy(e);
  });
}

void register_all()
{
  for_each_type(index_types{}, [](auto i) {
    for_each_type(layout_types{}, [](auto l) {
      using I = typename decltype(i)::type;
      using L = typename decltype(l)::type;
      const std::string name = "capture/" + std::string{name_of<I>()} + "/" + std::string{name_of<L>()};
      benchmark::RegisterBenchmark(name.c_str(), capture_layers<I, L>)
        ->ArgNames({"rows", "overlap"})
        ->ArgsProduct({{1, 64, 1024, 8192}, {0, 1}})
        ->UseManualTime();
      const std::string eos = "end_of_step/" + std::string{name_of<I>()} + "/" + std::string{name_of<L>()};
      benchmark::RegisterBenchmark(eos.c_str(), end_of_step<I, L>)
        ->ArgName("rows")->Arg(1024)->Arg(8192)->UseManualTime();
    });
  });
  for_each_single_swap([](auto i, auto l, auto c, auto s) {
    using I = typename decltype(i)::type;
    using L = typename decltype(l)::type;
    using C = typename decltype(c)::type;
    using S = typename decltype(s)::type;
    benchmark::RegisterBenchmark(("step/" + policy_name<I, L, C, S>()).c_str(), library_step<I, L, C, S>)
      ->ArgName("rows")->Arg(1024)->Arg(8192)->UseRealTime();
  });
  benchmark::RegisterBenchmark("pinned_d2h", pinned_d2h)
    ->ArgName("bytes")->Arg(4096)->Arg(786432)->Arg(6291456)->Arg(64 << 20)->UseManualTime();
  benchmark::RegisterBenchmark("mapped_write", mapped_write)
    ->ArgName("bytes")->Arg(786432)->Arg(6291456)->Arg(64 << 20)->UseManualTime();
  benchmark::RegisterBenchmark("empty_kernel/eager_sync", empty_kernel_eager_sync)->UseRealTime();
  benchmark::RegisterBenchmark("empty_kernel/eager_launch", empty_kernel_eager_launch)->UseManualTime();
  benchmark::RegisterBenchmark("empty_kernel/graph", empty_kernel_graph)->UseManualTime();
  benchmark::RegisterBenchmark("event/record", event_cost)->Arg(0)->UseRealTime();
  benchmark::RegisterBenchmark("d2d_copy", d2d_copy)->ArgName("bytes")->Arg(786432)->Arg(6291456)->UseManualTime();
  benchmark::RegisterBenchmark("call", call_cost)->ArgName("which")->DenseRange(0, 4)->UseManualTime();
  benchmark::RegisterBenchmark("host_register", host_register)
    ->ArgName("bytes")->Arg(64 << 10)->Arg(1536 << 10)->Arg(32 << 20)->UseManualTime();
  benchmark::RegisterBenchmark("memfd_map", memfd_map)
    ->ArgName("bytes")->Arg(64 << 10)->Arg(1536 << 10)->Arg(32 << 20)->UseManualTime();
  benchmark::RegisterBenchmark("event/query", event_cost)->Arg(1)->UseRealTime();
}

}  // namespace

int main(int argc, char** argv)
{
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) { return 1; }
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "device_bench: no usable CUDA device (%s): no CUDA benchmark registered\n",
                 status != cudaSuccess ? cudaGetErrorString(status) : "none found");
  } else {
    register_all();
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
