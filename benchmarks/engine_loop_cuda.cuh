/// @file
/// The CUDA platform of the engine loop: device-event timers, CUDA graphs recorded per row bucket
/// and a stand-in bf16 GEMM (cuBLAS). Every CUDA call is checked and becomes a
/// routing_replay::error naming the call.
#pragma once

#include "engine_loop.hpp"

#include <routing_replay/routing_replay.cuh>

#include <cuda/atomic>
#include <nv/target>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <exception>
#include <string>
#include <utility>

namespace rr_bench {

/// @brief Throws routing_replay::error for a failed cuBLAS call, naming the call.
inline void check_cublas(cublasStatus_t status, const char* what)
{
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw rr::error{rr::errc::backend_error,
                    std::string{what} + " failed: " + cublasGetStatusName(status) + " (" +
                      cublasGetStatusString(status) + ")"};
  }
}

/// @brief CUDA: timing events, graphs, cuBLAS.
struct cuda_platform {
  using backend = rr::cuda_backend;
  static constexpr bool has_device_timing = true;
  static constexpr bool has_graphs        = true;

  /// @brief A pair of timing events around work on one stream.
  class timer {
   public:
    timer()
    {
      rr::detail::check_cuda(cudaEventCreate(&start_), "cudaEventCreate");
      if (const cudaError_t e = cudaEventCreate(&stop_); e != cudaSuccess) {
        cudaEventDestroy(start_);
        rr::detail::check_cuda(e, "cudaEventCreate");
      }
    }
    timer(const timer&)            = delete;
    timer& operator=(const timer&) = delete;
    ~timer()
    {
      cudaEventDestroy(start_);
      cudaEventDestroy(stop_);
    }
    void start(cuda::stream_ref s) { rr::detail::check_cuda(cudaEventRecord(start_, s.get()), "cudaEventRecord"); }
    void stop(cuda::stream_ref s) { rr::detail::check_cuda(cudaEventRecord(stop_, s.get()), "cudaEventRecord"); }
    /// @brief Device time between start and stop; call after the stream was synchronized.
    [[nodiscard]] std::optional<double> elapsed_us() const
    {
      float ms = 0;
      rr::detail::check_cuda(cudaEventElapsedTime(&ms, start_, stop_), "cudaEventElapsedTime");
      return double{ms} * 1000.0;
    }

   private:
    cudaEvent_t start_ = nullptr;
    cudaEvent_t stop_  = nullptr;
  };

  /// @brief Holds a stream shut while the host enqueues work behind it, so that device-event time
  /// around that work measures the GPU alone, not the gaps while the host was still enqueueing.
  class stream_gate {
   public:
    /// @brief The kernel: spins until the flag in pinned memory is set (public: kernels need it).
    struct wait_open {
      int* flag;
      __host__ __device__ void operator()(std::int64_t) const
      {
        cuda::atomic_ref<int, cuda::thread_scope_system> open{*flag};
        while (open.load(cuda::std::memory_order_acquire) == 0) {
          NV_IF_TARGET(NV_IS_DEVICE, (__nanosleep(100);))
        }
      }
    };

    stream_gate() : flag_(1, 1) {}
    /// @brief Enqueues a kernel that waits until open() is called.
    void close(cuda::stream_ref s)
    {
      cuda::atomic_ref<int, cuda::thread_scope_system>{*rr::cuda_backend::data(flag_)}.store(0);
      rr::cuda_backend::bulk_async(1, wait_open{rr::cuda_backend::data(flag_)}, s);
    }
    /// @brief Lets the stream run on.
    void open() { cuda::atomic_ref<int, cuda::thread_scope_system>{*rr::cuda_backend::data(flag_)}.store(1); }

   private:
    rr::cuda_backend::pinned_vector<int> flag_;
  };

  /// @brief Work recorded once on a stream (thread-local capture mode) and replayed.
  class graph {
   public:
    template <class Record>
    graph(cuda::stream_ref s, Record&& record)
    {
      rr::detail::check_cuda(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeThreadLocal),
                             "cudaStreamBeginCapture");
      cudaGraph_t g = nullptr;
      try {
        record();
      } catch (...) {
        cudaStreamEndCapture(s.get(), &g);  // leaves the stream usable
        if (g != nullptr) { cudaGraphDestroy(g); }
        throw;
      }
      rr::detail::check_cuda(cudaStreamEndCapture(s.get(), &g), "cudaStreamEndCapture");
      const cudaError_t e = cudaGraphInstantiate(&exec_, g, 0);
      cudaGraphDestroy(g);
      rr::detail::check_cuda(e, "cudaGraphInstantiate");
    }
    graph(const graph&)            = delete;
    graph& operator=(const graph&) = delete;
    ~graph()
    {
      if (exec_ != nullptr) { cudaGraphExecDestroy(exec_); }
    }
    void launch(cuda::stream_ref s) { rr::detail::check_cuda(cudaGraphLaunch(exec_, s.get()), "cudaGraphLaunch"); }

   private:
    cudaGraphExec_t exec_ = nullptr;
  };

  /// @brief A stand-in for a layer's dense work: Y[n, H] = X[n, H] W[H, H] in bf16 with fp32
  /// accumulation (cuBLAS), with a fixed workspace so that it records into CUDA graphs.
  class gemm {
   public:
    gemm(std::int32_t hidden, std::int32_t max_rows) : hidden_(hidden)
    {
      if (hidden_ == 0) { return; }
      const std::size_t h = static_cast<std::size_t>(hidden_);
      const std::size_t bf16 = 2;
      try {
        allocate(&x_, h * static_cast<std::size_t>(max_rows) * bf16);
        allocate(&w_, h * h * bf16);
        allocate(&y_, h * static_cast<std::size_t>(max_rows) * bf16);
        allocate(&workspace_, workspace_bytes);
        // bf16 0x3C3C ~ 0.0115 everywhere: finite, non-zero operands
        rr::detail::check_cuda(cudaMemset(x_, 0x3C, h * static_cast<std::size_t>(max_rows) * bf16), "cudaMemset");
        rr::detail::check_cuda(cudaMemset(w_, 0x3C, h * h * bf16), "cudaMemset");
        check_cublas(cublasCreate(&handle_), "cublasCreate");
      } catch (...) {
        release();
        throw;
      }
    }
    gemm(const gemm&)            = delete;
    gemm& operator=(const gemm&) = delete;
    ~gemm() { release(); }

    void run(std::int64_t rows, cuda::stream_ref s)
    {
      if (hidden_ == 0 || rows == 0) { return; }
      const float alpha = 1.0F;
      const float beta  = 0.0F;
      if (stream_ != s.get()) {
        // setting the stream resets the workspace to cuBLAS's pool: set ours again, so that no
        // allocation happens inside graph capture
        check_cublas(cublasSetStream(handle_, s.get()), "cublasSetStream");
        check_cublas(cublasSetWorkspace(handle_, workspace_, workspace_bytes), "cublasSetWorkspace");
        stream_ = s.get();
      }
      // column-major: Y^T [H, n] = W^T [H, H] X^T [H, n], i.e. row-major Y = X W
      check_cublas(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, hidden_, static_cast<int>(rows), hidden_,
                                &alpha, w_, CUDA_R_16BF, hidden_, x_, CUDA_R_16BF, hidden_, &beta, y_,
                                CUDA_R_16BF, hidden_, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                   "cublasGemmEx");
    }

   private:
    static constexpr std::size_t workspace_bytes = std::size_t{32} << 20;

    static void allocate(void** p, std::size_t bytes)
    {
      rr::detail::check_cuda(cudaMalloc(p, bytes), "cudaMalloc");
    }
    void release() noexcept
    {
      if (handle_ != nullptr) { cublasDestroy(handle_); }
      for (void* p : {x_, w_, y_, workspace_}) {
        if (p != nullptr) { cudaFree(p); }
      }
      handle_ = nullptr;
      x_ = w_ = y_ = workspace_ = nullptr;
    }

    std::int32_t hidden_ = 0;
    cublasHandle_t handle_ = nullptr;
    cudaStream_t stream_   = nullptr;
    void* x_ = nullptr;
    void* w_ = nullptr;
    void* y_ = nullptr;
    void* workspace_ = nullptr;
  };
};

}  // namespace rr_bench
