/// @file
/// The CUDA backend: device buffers in GPU memory, stagings in pinned host memory, CUDA streams
/// and events. Needs nvcc.
#pragma once

#include <routing_replay/errors.hpp>

#include <cub/device/device_for.cuh>
#include <cuda/stream_ref>
#include <thrust/device_vector.h>
#include <thrust/host_vector.h>
#include <thrust/mr/allocator.h>
#include <thrust/system/cuda/memory_resource.h>

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <new>
#include <string>
#include <utility>

namespace routing_replay {

namespace detail {

/// @brief Throws routing_replay::error for a failed CUDA runtime call, naming the call.
inline void check_cuda(cudaError_t status, const char* what)
{
  if (status != cudaSuccess) {
    throw error{errc::backend_error,
                std::string{what} + " failed: " + cudaGetErrorName(status) + " (" +
                  cudaGetErrorString(status) + ")"};
  }
}

/// @brief The kernel behind cuda_backend::launch_async: one CUDA block per `op` block, then
/// `op.block_done(block)` on one thread once every thread of the block is done.
template <class Op>
__global__ void block_kernel(Op op)
{
  const auto block = static_cast<std::int32_t>(blockIdx.x);
  op(block, static_cast<std::int32_t>(threadIdx.x));
  if constexpr (requires { op.block_done(block); }) {
    __syncthreads();
    if (threadIdx.x == 0) { op.block_done(block); }
  }
}

/// @brief The configuration of a launch of `num_blocks` blocks of `block_threads` threads on
/// `stream`: no dynamic shared memory, no attributes.
[[nodiscard]] inline cudaLaunchConfig_t launch_config(std::int32_t num_blocks, std::int32_t block_threads,
                                                      cudaStream_t stream) noexcept
{
  cudaLaunchConfig_t config{};
  config.gridDim  = dim3(static_cast<unsigned>(num_blocks));
  config.blockDim = dim3(static_cast<unsigned>(block_threads));
  config.stream   = stream;
  return config;
}

/// @brief As block_kernel, launched as a programmatic dependent of the kernel before it on the
/// stream: its blocks may be scheduled while that kernel finishes, and wait here for its results.
template <class Op>
__global__ void dependent_block_kernel(Op op)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();
#endif
  op(static_cast<std::int32_t>(blockIdx.x), static_cast<std::int32_t>(threadIdx.x));
}

}  // namespace detail

/// @brief An owning, non-blocking CUDA stream (move-only).
class cuda_stream {
 public:
  /// @brief Creates a stream that does not synchronize with the legacy default stream.
  cuda_stream()
  {
    detail::check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                       "cudaStreamCreateWithFlags");
  }
  /// @brief Takes over the stream; `other` is left empty.
  cuda_stream(cuda_stream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}
  /// @brief Swaps streams; the one given up is destroyed with `other`.
  cuda_stream& operator=(cuda_stream&& other) noexcept
  {
    std::swap(stream_, other.stream_);
    return *this;
  }
  cuda_stream(const cuda_stream&)            = delete;
  cuda_stream& operator=(const cuda_stream&) = delete;
  ~cuda_stream()
  {
    if (stream_ != nullptr) { cudaStreamDestroy(stream_); }
  }
  /// @brief A non-owning reference.
  [[nodiscard]] cuda::stream_ref ref() const noexcept { return cuda::stream_ref{stream_}; }
  /// @brief The raw handle.
  [[nodiscard]] cudaStream_t get() const noexcept { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

/// @brief An owning CUDA event without timing (move-only): the cheapest kind to record and query.
class cuda_event {
 public:
  cuda_event()
  {
    detail::check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming),
                       "cudaEventCreateWithFlags");
  }
  /// @brief Takes over the event; `other` is left empty.
  cuda_event(cuda_event&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  /// @brief Swaps events; the one given up is destroyed with `other`.
  cuda_event& operator=(cuda_event&& other) noexcept
  {
    std::swap(event_, other.event_);
    return *this;
  }
  cuda_event(const cuda_event&)            = delete;
  cuda_event& operator=(const cuda_event&) = delete;
  ~cuda_event()
  {
    if (event_ != nullptr) { cudaEventDestroy(event_); }
  }
  /// @brief The raw handle.
  [[nodiscard]] cudaEvent_t get() const noexcept { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

/// @brief Backend policy for CUDA GPUs.
struct cuda_backend {
  /// @brief Non-owning stream handle taken by every asynchronous call (libcu++).
  using stream_ref = cuda::stream_ref;
  /// @brief Owning stream, for side streams the library creates itself.
  using stream = cuda_stream;
  /// @brief Owning event.
  using event = cuda_event;
  /// @brief GPU memory (Thrust).
  template <class T>
  using device_vector = thrust::device_vector<T>;
  /// @brief Pinned host memory (Thrust's pinned memory resource), so D2H copies are truly async.
  template <class T>
  using pinned_vector = thrust::host_vector<
    T,
    thrust::mr::stateless_resource_allocator<T,
                                             thrust::system::cuda::universal_host_pinned_memory_resource>>;

  /// @brief Human-readable name.
  static constexpr const char* name = "cuda";
  /// @brief A kernel's failure is reported by every later call (routing_replay::failures_are_sticky).
  static constexpr bool failures_are_sticky = true;

  /// @brief Whether a usable CUDA device is present (false without a driver or a GPU).
  [[nodiscard]] static bool available() noexcept
  {
    int count = 0;
    return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  }

  /// @brief Raw pointer to the first element of a device or pinned vector.
  template <class Vector>
  [[nodiscard]] static auto* data(Vector& v) noexcept
  {
    return thrust::raw_pointer_cast(v.data());
  }

  /// @brief Enqueues a strided 2-D copy of `height` rows of `width` bytes (any direction).
  static void copy_2d_async(void* dst,
                            std::size_t dst_pitch,
                            const void* src,
                            std::size_t src_pitch,
                            std::size_t width,
                            std::size_t height,
                            stream_ref stream)
  {
    if (width == 0 || height == 0) { return; }
    detail::check_cuda(
      cudaMemcpy2DAsync(
        dst, dst_pitch, src, src_pitch, width, height, cudaMemcpyDefault, stream.get()),
      "cudaMemcpy2DAsync");
  }

  /// @brief Enqueues a 1-D copy of `bytes` bytes (any direction).
  static void copy_async(void* dst, const void* src, std::size_t bytes, stream_ref stream)
  {
    if (bytes == 0) { return; }
    detail::check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream.get()),
                       "cudaMemcpyAsync");
  }

  /// @brief Enqueues a strided 2-D byte fill of device memory.
  static void fill_2d_async(void* dst,
                            std::size_t pitch,
                            unsigned char value,
                            std::size_t width,
                            std::size_t height,
                            stream_ref stream)
  {
    if (width == 0 || height == 0) { return; }
    detail::check_cuda(cudaMemset2DAsync(dst, pitch, value, width, height, stream.get()),
                       "cudaMemset2DAsync");
  }

  /// @brief Enqueues one kernel that calls `op(i)` for every i in [0, n) (CUB DeviceFor::Bulk:
  /// no temporary storage, no synchronization, so it is safe inside CUDA graph capture).
  template <class Op>
  static void bulk_async(std::int64_t n, Op op, stream_ref stream)
  {
    if (n <= 0) { return; }
    detail::check_cuda(cub::DeviceFor::Bulk(n, op, stream.get()), "cub::DeviceFor::Bulk");
  }

  /// @brief Enqueues one kernel of `num_blocks` blocks of `block_threads` threads that calls
  /// `op(block, thread)` (a plain launch: its shape is the caller's, so no occupancy query).
  template <class Op>
  static void launch_async(std::int32_t num_blocks, std::int32_t block_threads, Op op, stream_ref stream)
  {
    if (num_blocks <= 0 || block_threads <= 0) { return; }
    // cudaLaunchKernelEx, not <<<>>>: the triple chevrons push and pop a launch configuration
    // around cudaLaunchKernel and leave the error to a cudaGetLastError() after it
    const cudaLaunchConfig_t config = detail::launch_config(num_blocks, block_threads, stream.get());
    const cudaError_t status        = cudaLaunchKernelEx(&config, detail::block_kernel<Op>, op);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();  // a refused launch is reported once, here
      detail::check_cuda(status, "kernel launch");
    }
  }

  /// @brief Whether launch_dependent_async overlaps launches (set false to launch plainly, e.g. next
  /// to kernels that trigger their dependents before their last writes).
  static inline bool dependent_launches = true;

  /// @brief As launch_async, for a kernel that only reads what the kernel before it on the stream
  /// wrote (capture() after the router): launched with programmatic stream serialization, so on
  /// Hopper and later its launch overlaps the end of that kernel (also inside CUDA graphs). Falls
  /// back to a plain launch where the driver refuses the attribute.
  template <class Op>
  static void launch_dependent_async(std::int32_t num_blocks, std::int32_t block_threads, Op op, stream_ref stream)
  {
    if (num_blocks <= 0 || block_threads <= 0) { return; }
    // the same answer for every launch in this process; atomic: replays on several host threads
    // (ranks as threads, the concurrent CUDA soak) launch at once
    static std::atomic<bool> refused{false};
    if (dependent_launches && !refused.load(std::memory_order_relaxed)) {
      cudaLaunchAttribute attribute{};
      attribute.id                                         = cudaLaunchAttributeProgrammaticStreamSerialization;
      attribute.val.programmaticStreamSerializationAllowed = 1;
      cudaLaunchConfig_t config = detail::launch_config(num_blocks, block_threads, stream.get());
      config.attrs              = &attribute;
      config.numAttrs           = 1;
      if (cudaLaunchKernelEx(&config, detail::dependent_block_kernel<Op>, op) == cudaSuccess) { return; }
      (void)cudaGetLastError();  // clear the refusal: a plain launch follows
      refused.store(true, std::memory_order_relaxed);
    }
    launch_async(num_blocks, block_threads, op, stream);
  }

  /// @brief Pins `bytes` of host memory at `p` and maps it for kernels, which then write it
  /// through the same address (unified addressing; refused on a device that cannot).
  static void register_host(void* p, std::size_t bytes)
  {
    int device = 0;
    int same_address = 0;
    detail::check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    detail::check_cuda(cudaDeviceGetAttribute(&same_address, cudaDevAttrCanUseHostPointerForRegisteredMem, device),
                       "cudaDeviceGetAttribute");
    if (same_address == 0) {
      throw error{errc::backend_error, "device scatter needs a device that reaches registered host memory through "
                                       "the host's addresses (cudaDevAttrCanUseHostPointerForRegisteredMem)"};
    }
    detail::check_cuda(cudaHostRegister(p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable),
                       "cudaHostRegister");
  }

  /// @brief Unpins memory registered by register_host() (errors ignored: called on teardown).
  static void unregister_host(void* p) noexcept { (void)cudaHostUnregister(p); }

  /// @brief `bytes` of pinned host memory (cudaMallocHost) that kernels read through the same
  /// address, for what the host writes and a kernel reads in place
  /// (detail/data_path/pinned_memory.hpp).
  /// @throws std::bad_alloc when the memory is not there (as Thrust's pinned vectors); error
  /// backend_error for another CUDA failure
  [[nodiscard]] static void* allocate_pinned(std::size_t bytes)
  {
    void* p                 = nullptr;
    const cudaError_t error = cudaMallocHost(&p, bytes);
    if (error == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // not sticky: clear it, so that later calls do not report it
      throw std::bad_alloc{};
    }
    detail::check_cuda(error, "cudaMallocHost");
    return p;
  }

  /// @brief Frees allocate_pinned() memory (cudaFreeHost, which waits for the device; errors
  /// ignored: called on teardown).
  static void free_pinned(void* p, std::size_t) noexcept { (void)cudaFreeHost(p); }

  /// @brief What a helper thread adopts: the device current on the thread that made it.
  struct host_thread_state {
    int device = 0;  ///< the engine's device
  };
  /// @brief The calling thread's current device.
  [[nodiscard]] static host_thread_state host_thread_context()
  {
    host_thread_state s;
    detail::check_cuda(cudaGetDevice(&s.device), "cudaGetDevice");
    return s;
  }
  /// @brief Makes the calling (helper) thread use `state`'s device, not device 0 (whose primary
  /// context it would otherwise create: hundreds of MB on a GPU the engine never uses), and puts
  /// it in relaxed stream-capture mode: an engine recording a CUDA graph in global mode (PyTorch's
  /// default) has every other thread's cudaHostRegister refused and its own capture invalidated,
  /// unless that thread opted out; pinning memory enqueues nothing a graph could miss.
  static void adopt_host_thread_context(host_thread_state state)
  {
    detail::check_cuda(cudaSetDevice(state.device), "cudaSetDevice");
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    detail::check_cuda(cudaThreadExchangeStreamCaptureMode(&mode), "cudaThreadExchangeStreamCaptureMode");
  }

  /// @brief Records `e` on `stream`.
  static void record(event& e, stream_ref stream)
  {
    detail::check_cuda(cudaEventRecord(e.get(), stream.get()), "cudaEventRecord");
  }

  /// @brief Makes later work on `stream` wait for the latest record of `e`.
  static void wait(stream_ref stream, const event& e)
  {
    detail::check_cuda(cudaStreamWaitEvent(stream.get(), e.get(), 0), "cudaStreamWaitEvent");
  }

  /// @brief Whether the latest record of `e` has completed.
  [[nodiscard]] static bool ready(const event& e)
  {
    const cudaError_t status = cudaEventQuery(e.get());
    if (status == cudaErrorNotReady) { return false; }
    detail::check_cuda(status, "cudaEventQuery");
    return true;
  }

  /// @brief Blocks the calling thread until the latest record of `e` has completed.
  static void synchronize(const event& e)
  {
    // Steps are mostly retired once their event has completed (ready() said so, or the copy that
    // waited for it did), and on a completed event a query costs 0.2 us where
    // cudaEventSynchronize costs 1.5 us (H200): two of them were a fifth of end_step().
    const cudaError_t status = cudaEventQuery(e.get());
    if (status == cudaSuccess) { return; }
    if (status != cudaErrorNotReady) { detail::check_cuda(status, "cudaEventQuery"); }
    detail::check_cuda(cudaEventSynchronize(e.get()), "cudaEventSynchronize");
  }

  /// @brief Blocks the calling thread until `stream` has run everything enqueued so far.
  static void synchronize(stream_ref stream)
  {
    detail::check_cuda(cudaStreamSynchronize(stream.get()), "cudaStreamSynchronize");
  }

  /// @brief Whether work enqueued on `stream` now is recorded into a CUDA graph rather than run
  /// (its replays will run it later, unseen by the host).
  [[nodiscard]] static bool is_capturing(stream_ref stream)
  {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    detail::check_cuda(cudaStreamIsCapturing(stream.get(), &status), "cudaStreamIsCapturing");
    return status != cudaStreamCaptureStatusNone;
  }
};

}  // namespace routing_replay
