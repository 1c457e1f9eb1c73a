/// @file
/// The host backend: device memory is host memory, streams are in-order worker threads and events
/// are completion flags. It runs the same policies as the CUDA backend on machines without a GPU,
/// with the same asynchrony.
#pragma once

#include <routing_replay/detail/policies/host_queue.hpp>
#include <routing_replay/errors.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

namespace routing_replay {

class host_stream;

/// @brief Non-owning, trivially copyable handle to a host_stream; what the library's calls take.
class host_stream_ref {
 public:
  /// @brief Refers to a stream; the stream must outlive every use of the reference.
  host_stream_ref(host_stream& stream) noexcept;  // NOLINT: implicit, like cuda::stream_ref

  /// @brief The queue behind the stream.
  [[nodiscard]] detail::host_queue& queue() const noexcept { return *queue_; }
  /// @brief Two references to one stream compare equal.
  friend bool operator==(host_stream_ref, host_stream_ref) = default;

 private:
  detail::host_queue* queue_;
};

/// @brief An owning host stream: a worker thread that runs enqueued work in order.
class host_stream {
 public:
  host_stream() : queue_(std::make_unique<detail::host_queue>()) {}

  /// @brief Enqueues a task.
  void enqueue(std::function<void()> task) { queue_->enqueue(std::move(task)); }
  /// @brief Waits for every task enqueued so far.
  /// @throws error backend_error if one of those tasks failed
  void synchronize() { queue_->synchronize(); }
  /// @brief A non-owning reference.
  [[nodiscard]] host_stream_ref ref() noexcept { return host_stream_ref{*this}; }

 private:
  friend class host_stream_ref;
  std::unique_ptr<detail::host_queue> queue_;
};

inline host_stream_ref::host_stream_ref(host_stream& stream) noexcept : queue_(stream.queue_.get())
{
}

/// @brief Runs the calling thread's work on an idle host stream at once, on the calling thread,
/// while it is alive: the host analogue of nothing CUDA has, for work that reads memory the caller
/// is about to reuse (a router output the engine overwrites at the next layer). A launch that
/// would have run next anyway runs before the call returns, so the caller neither copies what the
/// work reads nor pays the worker's wake. Other threads' work on the stream waits for it to end.
/// On a stream with work pending or running, active() is false and nothing changes.
class host_inline_scope {
 public:
  /// @brief Holds `stream` for the calling thread if it is idle.
  explicit host_inline_scope(host_stream_ref stream) : section_(stream.queue()) {}
  /// @brief Whether the calling thread's work on the stream runs at once, on this thread.
  [[nodiscard]] bool active() const noexcept { return section_.active(); }

 private:
  detail::host_queue::inline_section section_;
};

/// @brief An owning host event (move-only). Recording it on a stream marks the work enqueued so far.
class host_event {
 public:
  host_event() : flag_(std::make_shared<detail::completion_flag>()) {}

 private:
  friend struct host_backend;
  // shared with queued tasks, so destroying an event with pending records is safe, as in CUDA
  std::shared_ptr<detail::completion_flag> flag_;
};

/// @brief Backend policy for machines without a GPU (tests, CI, the demo, CPU-expert engines).
///
/// "Device" memory is ordinary host memory, so kernels are loops that run on the stream's worker
/// thread. Every asynchronous operation really is asynchronous.
struct host_backend {
  /// @brief Non-owning stream handle taken by every asynchronous call.
  using stream_ref = host_stream_ref;
  /// @brief Owning stream, for side streams the library creates itself.
  using stream = host_stream;
  /// @brief Owning event.
  using event = host_event;
  /// @brief Memory that kernels read and write; freeing it waits for the host streams, as cudaFree
  /// synchronizes the device.
  template <class T>
  using device_vector = std::vector<T, detail::stream_ordered_allocator<T>>;
  /// @brief Host memory that asynchronous copies may target; freeing it waits as device memory does.
  template <class T>
  using pinned_vector = std::vector<T, detail::stream_ordered_allocator<T>>;

  /// @brief Human-readable name.
  static constexpr const char* name = "host";

  /// @brief Always true: the host is always there.
  [[nodiscard]] static bool available() noexcept { return true; }

  /// @brief Raw pointer to the first element of a device or pinned vector.
  template <class Vector>
  [[nodiscard]] static auto* data(Vector& v) noexcept
  {
    return v.data();
  }

  /// @brief Enqueues a strided 2-D copy of `height` rows of `width` bytes.
  static void copy_2d_async(void* dst,
                            std::size_t dst_pitch,
                            const void* src,
                            std::size_t src_pitch,
                            std::size_t width,
                            std::size_t height,
                            stream_ref stream)
  {
    if (width == 0 || height == 0) { return; }
    stream.queue().enqueue([=] {
      if (dst_pitch == width && src_pitch == width) {  // contiguous rows: one copy
        std::memcpy(dst, src, width * height);
        return;
      }
      for (std::size_t r = 0; r < height; ++r) {
        std::memcpy(static_cast<unsigned char*>(dst) + r * dst_pitch,
                    static_cast<const unsigned char*>(src) + r * src_pitch,
                    width);
      }
    });
  }

  /// @brief Enqueues a 1-D copy of `bytes` bytes.
  static void copy_async(void* dst, const void* src, std::size_t bytes, stream_ref stream)
  {
    copy_2d_async(dst, bytes, src, bytes, bytes, 1, stream);
  }

  /// @brief Enqueues a strided 2-D byte fill.
  static void fill_2d_async(void* dst,
                            std::size_t pitch,
                            unsigned char value,
                            std::size_t width,
                            std::size_t height,
                            stream_ref stream)
  {
    if (width == 0 || height == 0) { return; }
    stream.queue().enqueue([=] {
      for (std::size_t r = 0; r < height; ++r) {
        std::memset(static_cast<unsigned char*>(dst) + r * pitch, value, width);
      }
    });
  }

  /// @brief Enqueues `op(i)` for every i in [0, n): the host analogue of a kernel launch.
  template <class Op>
  static void bulk_async(std::int64_t n, Op op, stream_ref stream)
  {
    if (n <= 0) { return; }
    stream.queue().enqueue([=] {
      for (std::int64_t i = 0; i < n; ++i) {
        op(i);
      }
    });
  }

  /// @brief Enqueues `op(block, thread)` for every block in [0, num_blocks) and thread in
  /// [0, block_threads), blocks one after the other, each followed by `op.block_done(block)` if
  /// `op` has it: the host analogue of a kernel launch whose threads share work by block.
  template <class Op>
  static void launch_async(std::int32_t num_blocks, std::int32_t block_threads, Op op, stream_ref stream)
  {
    if (num_blocks <= 0 || block_threads <= 0) { return; }
    stream.queue().enqueue([=] {
      for (std::int32_t b = 0; b < num_blocks; ++b) {
        for (std::int32_t t = 0; t < block_threads; ++t) { op(b, t); }
        if constexpr (requires { op.block_done(b); }) { op.block_done(b); }
      }
    });
  }

  /// @brief As launch_async: stream order already makes the kernel wait for the one before it.
  template <class Op>
  static void launch_dependent_async(std::int32_t num_blocks, std::int32_t block_threads, Op op, stream_ref stream)
  {
    launch_async(num_blocks, block_threads, op, stream);
  }

  /// @brief Nothing to do: "kernels" already reach host memory.
  static void register_host(void*, std::size_t) noexcept {}
  /// @brief Nothing to do.
  static void unregister_host(void*) noexcept {}

  /// @brief `bytes` of host memory that "kernels" read in place (as cudaMallocHost's).
  [[nodiscard]] static void* allocate_pinned(std::size_t bytes)
  {
    return detail::stream_ordered_allocator<std::byte>{}.allocate(bytes);
  }

  /// @brief Frees allocate_pinned() memory once every queue has run what was enqueued before (as
  /// cudaFreeHost waits for the device).
  static void free_pinned(void* p, std::size_t bytes) noexcept
  {
    detail::stream_ordered_allocator<std::byte>{}.deallocate(static_cast<std::byte*>(p), bytes);
  }

  /// @brief Makes `device` the calling thread's host device (as cudaSetDevice): streams it makes
  /// from now on belong to it, and memory it frees waits for that device's streams only. Ranks
  /// that run as threads of one process (thread_communicator) each set their own, as ranks on GPUs
  /// each have theirs; everything else may leave the default, 0.
  static void set_device(int device) noexcept { detail::current_host_device() = device; }
  /// @brief The calling thread's host device (as cudaGetDevice).
  [[nodiscard]] static int get_device() noexcept { return detail::current_host_device(); }

  /// @brief What a helper thread adopts: the host device of the thread that made it.
  struct host_thread_state {
    int device = 0;  ///< the engine thread's host device
  };
  /// @brief The calling thread's host device.
  [[nodiscard]] static host_thread_state host_thread_context() noexcept { return {get_device()}; }
  /// @brief Makes the calling (helper) thread use `state`'s host device.
  static void adopt_host_thread_context(host_thread_state state) noexcept { set_device(state.device); }

  /// @brief Marks the work enqueued on `stream` so far.
  static void record(event& e, stream_ref stream)
  {
    const std::uint64_t ticket = e.flag_->arm();
    detail::host_queue* queue  = &stream.queue();  // alive while its own task runs
    queue->enqueue([flag = e.flag_, ticket, queue] { flag->complete(ticket, queue->take_failure()); });
  }

  /// @brief Makes later work on `stream` wait for the latest record of `e` (none: no wait).
  static void wait(stream_ref stream, const event& e)
  {
    const std::uint64_t ticket = e.flag_->latest();
    if (ticket == 0) { return; }
    stream.queue().enqueue([flag = e.flag_, ticket] { flag->wait(ticket); });
  }

  /// @brief Whether the latest record of `e` has completed.
  [[nodiscard]] static bool ready(const event& e) { return e.flag_->reached(e.flag_->latest()); }

  /// @brief Blocks the calling thread until the latest record of `e` has completed.
  /// @throws error backend_error if a task enqueued before the record failed
  static void synchronize(const event& e)
  {
    e.flag_->wait(e.flag_->latest());
    detail::throw_if_failed(e.flag_->take_failure());
  }

  /// @brief Blocks the calling thread until `stream` has run everything enqueued so far.
  /// @throws error backend_error if one of those tasks failed
  static void synchronize(stream_ref stream) { stream.queue().synchronize(); }

  /// @brief Whether `stream` records work into a graph instead of running it: host streams never do.
  [[nodiscard]] static bool is_capturing(stream_ref) noexcept { return false; }
};

}  // namespace routing_replay
