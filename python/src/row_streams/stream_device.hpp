/// @file
/// The device side of routing_replay.vllm behind one virtual interface, as replay_base is for
/// replays: step_snapshots<Backend, Index, Out> taking raw pointers, dtype codes and integer stream
/// handles, compiled by g++ for the host backend (_core) and by nvcc for the CUDA backend
/// (_core_cuda). No nanobind here.
#pragma once

#include "replay_impl.hpp"

#include <routing_replay/data_path/step_snapshots.hpp>
#include <routing_replay/detail/step_status.hpp>
#include <routing_replay/host_backend.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>

namespace routing_replay::python {

/// @brief What routing_replay.vllm's native streams call on the device side.
class stream_device_base {
 public:
  virtual ~stream_device_base() = default;
  /// @brief Whether this is the host backend (stream handles 0 name its own streams).
  [[nodiscard]] virtual bool on_host() const noexcept = 0;
  /// @brief CUDA device of the buffers (0 on the host).
  [[nodiscard]] virtual std::int32_t device() const noexcept = 0;
  /// @brief Bytes of one output id (1 or 2).
  [[nodiscard]] virtual std::int32_t out_bytes() const noexcept = 0;
  /// @brief Bytes of D plus the snapshots.
  [[nodiscard]] virtual std::size_t device_bytes() const noexcept = 0;
  /// @brief The layers captured so far, as a mask (step_snapshots::captured()).
  [[nodiscard]] virtual detail::captured_layers captured() const noexcept = 0;
  /// @brief step_snapshots::capture(): rows of a router output of element type `dtype`, written
  /// from D's row `destination_row`. Host: the ids are read before the call returns.
  virtual void capture(std::int32_t layer, const void* ids, dtype_code dtype, std::int64_t rows, std::int64_t row_stride,
                       std::int64_t destination_row, std::uintptr_t stream) = 0;
  /// @brief step_snapshots::open_step().
  virtual void open_step(std::uintptr_t stream) = 0;
  /// @brief step_snapshots::open_step_enqueues(): whether open_step() needs its stream.
  [[nodiscard]] virtual bool open_step_enqueues() const noexcept = 0;
  /// @brief step_snapshots::harvest(): the ring slot; `host_rows` is where copy_to_host() will put
  /// the rows (the host backend's kernel writes them there at once).
  virtual std::int32_t harvest(std::int64_t rows, void* host_rows, std::uintptr_t stream) = 0;
  /// @brief step_snapshots::copy_to_host() into `host` (pinned memory of allocate_pinned()).
  virtual void copy_to_host(std::int32_t slot, void* host, std::uintptr_t stream) = 0;
  /// @brief step_snapshots::direct_write_bytes().
  [[nodiscard]] virtual std::size_t direct_write_bytes() const noexcept = 0;
  /// @brief step_snapshots::set_direct_write_bytes().
  virtual void set_direct_write_bytes(std::size_t bytes) noexcept = 0;
  /// @brief step_snapshots::wrote_host(): the harvest wrote the rows, copy_to_host() has nothing to do.
  [[nodiscard]] virtual bool wrote_host(std::int32_t slot) const noexcept = 0;
  /// @brief step_snapshots::ready(): whether wait() would return at once.
  [[nodiscard]] virtual bool ready(std::int32_t slot) const = 0;
  /// @brief step_snapshots::wait() (call without the GIL unless ready()).
  virtual void wait(std::int32_t slot) = 0;
  /// @brief step_snapshots::status().
  [[nodiscard]] virtual detail::step_status status(std::int32_t slot) const = 0;
  /// @brief Pinned host memory for step copies (Backend::allocate_pinned), its pages touched.
  [[nodiscard]] virtual void* (*pinned_allocator() const noexcept)(std::size_t) = 0;
  /// @brief How that memory is freed (Backend::free_pinned); callable after this object is gone.
  [[nodiscard]] virtual void (*pinned_deallocator() const noexcept)(void*, std::size_t) = 0;
  /// @brief What a helper thread that allocates pinned memory runs first (CUDA: adopt the calling
  /// thread's device, relaxed capture mode); read on the engine's thread.
  [[nodiscard]] virtual std::function<void()> helper_thread_entry() const = 0;
};

/// @brief Turns an integer stream handle into the backend's stream (stream_cast in replay_impl.hpp).
template <class Backend>
struct device_stream;

/// @brief Host backend: a handle is a host_stream*; 0 names the object's own stream.
template <>
struct device_stream<host_backend> {
  /// @brief The stream of `handle`, or `own`.
  static host_stream_ref from(std::uintptr_t handle, host_stream& own)
  {
    return handle == 0 ? own.ref() : host_stream_ref{*reinterpret_cast<host_stream*>(handle)};  // NOLINT: handle protocol
  }
};

/// @brief step_snapshots<Backend, Index, Out> behind stream_device_base.
template <class Backend, class Index, class Out>
class stream_device_impl final : public stream_device_base {
  static constexpr bool host = std::is_same_v<Backend, host_backend>;

 public:
  /// @brief D for `max_rows` rows; a ring of `depth` snapshots.
  stream_device_impl(std::int32_t layers, std::int32_t top_k, std::int32_t experts, std::int32_t max_rows,
                     std::int32_t depth, std::int32_t device_index)
    : snapshots_(layers, top_k, experts, max_rows, depth), device_(device_index)
  {
  }

  [[nodiscard]] bool on_host() const noexcept override { return host; }
  [[nodiscard]] std::int32_t device() const noexcept override { return device_; }
  [[nodiscard]] std::int32_t out_bytes() const noexcept override { return static_cast<std::int32_t>(sizeof(Out)); }
  [[nodiscard]] std::size_t device_bytes() const noexcept override
  {
    return snapshots_.device_bytes() + snapshots_.snapshot_bytes();
  }
  [[nodiscard]] detail::captured_layers captured() const noexcept override { return snapshots_.captured(); }

  void capture(std::int32_t layer, const void* ids, dtype_code dtype, std::int64_t rows, std::int64_t row_stride,
               std::int64_t destination_row, std::uintptr_t stream) override
  {
    capture_options options;
    options.source_row_stride      = row_stride;
    options.destination_row_offset = destination_row;
    const auto s                   = stream_of(stream, compute_);
    auto run = [&](auto tag) {
      using source = decltype(tag);
      snapshots_.capture(layer, static_cast<const source*>(ids), rows, s, options);
    };
    std::optional<host_inline_scope> inline_run;
    if constexpr (host) { hold_idle(inline_run, s); }  // the ids are read now, on this thread
    switch (dtype) {
      case dtype_code::i64: run(std::int64_t{}); return;
      case dtype_code::i32: run(std::int32_t{}); return;
      case dtype_code::i16: run(std::int16_t{}); return;
      default:
        throw error{errc::invalid_argument, std::string{"capture: router outputs are int64, int32 or int16, got "} +
                                              dtype_name(dtype)};
    }
  }

  void open_step(std::uintptr_t stream) override
  {
    const auto s = stream_of(stream, compute_);
    std::optional<host_inline_scope> inline_run;
    if constexpr (host) { hold_idle(inline_run, s); }
    snapshots_.open_step(s);
  }

  [[nodiscard]] bool open_step_enqueues() const noexcept override { return snapshots_.open_step_enqueues(); }
  [[nodiscard]] bool wrote_host(std::int32_t slot) const noexcept override { return snapshots_.wrote_host(slot); }
  [[nodiscard]] std::size_t direct_write_bytes() const noexcept override { return snapshots_.direct_write_bytes(); }
  void set_direct_write_bytes(std::size_t bytes) noexcept override { snapshots_.set_direct_write_bytes(bytes); }

  std::int32_t harvest(std::int64_t rows, void* host_rows, std::uintptr_t stream) override
  {
    const auto s = stream_of(stream, compute_);
    std::optional<host_inline_scope> inline_run;
    if constexpr (host) { hold_idle(inline_run, s); }
    return snapshots_.harvest(rows, s, -1, static_cast<Out*>(host_rows));
  }

  void copy_to_host(std::int32_t slot, void* out, std::uintptr_t stream) override
  {
    const auto s = stream_of(stream, copy_);
    std::optional<host_inline_scope> inline_run;
    if constexpr (host) { hold_idle(inline_run, s); }
    snapshots_.copy_to_host(slot, static_cast<Out*>(out), s);
  }

  [[nodiscard]] bool ready(std::int32_t slot) const override { return snapshots_.ready(slot); }
  void wait(std::int32_t slot) override { snapshots_.wait(slot); }
  [[nodiscard]] detail::step_status status(std::int32_t slot) const override { return snapshots_.status(slot); }

  /// @brief Backend::allocate_pinned, its pages touched.
  [[nodiscard]] void* (*pinned_allocator() const noexcept)(std::size_t) override { return &allocate; }
  /// @brief Backend::free_pinned.
  [[nodiscard]] void (*pinned_deallocator() const noexcept)(void*, std::size_t) override { return &Backend::free_pinned; }
  /// @brief Backend::adopt_host_thread_context of the calling thread's context, on this side's
  /// device (CUDA: not whichever device is current on the calling thread).
  [[nodiscard]] std::function<void()> helper_thread_entry() const override
  {
    auto state = Backend::host_thread_context();
    if constexpr (!host) { state.device = device_; }
    return [state] { Backend::adopt_host_thread_context(state); };
  }

 private:
  struct no_streams {};
  using own_stream = std::conditional_t<host, host_stream, no_streams>;

  static auto stream_of(std::uintptr_t handle, own_stream& own)
  {
    if constexpr (host) {
      return device_stream<host_backend>::from(handle, own);
    } else {
      return stream_cast<Backend>::from(handle);
    }
  }

  // Host: runs this thread's work on `s` at once, on this thread (the stream is the caller's own,
  // idle unless another thread's work is still on it, which is waited for first).
  static void hold_idle(std::optional<host_inline_scope>& scope, host_stream_ref s)
  {
    scope.emplace(s);
    if (scope->active()) { return; }
    scope.reset();
    s.queue().synchronize();
    scope.emplace(s);
  }

  static void* allocate(std::size_t bytes)
  {
    void* p = Backend::allocate_pinned(bytes);
    std::memset(p, 0, bytes);  // its pages, touched now rather than in a step
    return p;
  }

  own_stream compute_;  // host: the default compute stream
  own_stream copy_;     // host: the default output copy stream
  step_snapshots<Backend, Index, Out> snapshots_;
  std::int32_t device_;
};

/// @brief A device side for E experts: uint8 ids for E <= 255; uint16 inside and uint8 out for
/// E = 256; uint16 for E <= 65535; int32 inside and uint16 out for E = 65536.
template <class Backend>
std::unique_ptr<stream_device_base> make_stream_device(std::int32_t layers, std::int32_t top_k, std::int32_t experts,
                                                       std::int32_t max_rows, std::int32_t depth, std::int32_t device)
{
  if (experts <= 255) {
    return std::make_unique<stream_device_impl<Backend, std::uint8_t, std::uint8_t>>(layers, top_k, experts, max_rows, depth, device);
  }
  if (experts == 256) {
    return std::make_unique<stream_device_impl<Backend, std::uint16_t, std::uint8_t>>(layers, top_k, experts, max_rows, depth, device);
  }
  if (experts <= 65535) {
    return std::make_unique<stream_device_impl<Backend, std::uint16_t, std::uint16_t>>(layers, top_k, experts, max_rows, depth, device);
  }
  if (experts == 65536) {
    return std::make_unique<stream_device_impl<Backend, std::int32_t, std::uint16_t>>(layers, top_k, experts, max_rows, depth, device);
  }
  throw error{errc::invalid_config, "routed-experts output ids are uint16: " + std::to_string(experts) +
                                      " experts do not fit (at most 65536)"};
}

}  // namespace routing_replay::python
