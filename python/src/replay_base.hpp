/// @file
/// The type-erased face of one compiled RoutingReplay instantiation, as the Python bindings see
/// it: raw pointers, element-type codes and stream handles instead of template parameters.
#pragma once

#include <routing_replay/config.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/routed_experts.hpp>
#include <routing_replay/routing_replay.hpp>
#include <routing_replay/step_plan.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

namespace routing_replay::python {

/// @brief Element types that cross the binding, as numpy spells them.
enum class dtype_code : std::int32_t { i8, u8, i16, u16, i32, u32, i64, u64 };

/// @brief The numpy name of a dtype code ("int16", ...).
[[nodiscard]] constexpr const char* dtype_name(dtype_code d) noexcept
{
  switch (d) {
    case dtype_code::i8: return "int8";
    case dtype_code::u8: return "uint8";
    case dtype_code::i16: return "int16";
    case dtype_code::u16: return "uint16";
    case dtype_code::i32: return "int32";
    case dtype_code::u32: return "uint32";
    case dtype_code::i64: return "int64";
    case dtype_code::u64: return "uint64";
  }
  return "?";
}

/// @brief Bytes per element of a dtype code.
[[nodiscard]] constexpr std::size_t dtype_size(dtype_code d) noexcept
{
  switch (d) {
    case dtype_code::i8:
    case dtype_code::u8: return 1;
    case dtype_code::i16:
    case dtype_code::u16: return 2;
    case dtype_code::i32:
    case dtype_code::u32: return 4;
    case dtype_code::i64:
    case dtype_code::u64: return 8;
  }
  return 0;
}

/// @brief The dtype code of an integer type.
template <class T>
[[nodiscard]] constexpr dtype_code dtype_of() noexcept
{
  constexpr bool s = std::is_signed_v<T>;
  if constexpr (sizeof(T) == 1) { return s ? dtype_code::i8 : dtype_code::u8; }
  if constexpr (sizeof(T) == 2) { return s ? dtype_code::i16 : dtype_code::u16; }
  if constexpr (sizeof(T) == 4) { return s ? dtype_code::i32 : dtype_code::u32; }
  return s ? dtype_code::i64 : dtype_code::u64;
}

/// @brief Calls `f(T{})` with the integer type a dtype code names.
template <class F>
decltype(auto) visit_dtype(dtype_code d, F&& f)
{
  switch (d) {
    case dtype_code::i8: return f(std::int8_t{});
    case dtype_code::u8: return f(std::uint8_t{});
    case dtype_code::i16: return f(std::int16_t{});
    case dtype_code::u16: return f(std::uint16_t{});
    case dtype_code::i32: return f(std::int32_t{});
    case dtype_code::u32: return f(std::uint32_t{});
    case dtype_code::i64: return f(std::int64_t{});
    case dtype_code::u64: return f(std::uint64_t{});
  }
  throw error{errc::invalid_argument, "unknown dtype code"};
}

/// @brief Which compiled instantiation: the policy names the Python constructor takes.
struct policy_names {
  std::string backend;  ///< "host" or "cuda"
  std::string index;    ///< "uint8", "uint16", "int16", "int32"
  std::string layout;   ///< "layer_major", "token_major"
  std::string copy;     ///< "sync", "async_event", "double_buffered", "device_scatter"
  std::string storage;  ///< "per_request", "block_slot"
};

/// @brief A router output handed to capture: `num_tokens` rows of at least K ids, `row_stride`
/// elements apart, of element type `dtype`, in the backend's memory.
struct id_array {
  const void* data       = nullptr;  ///< first element of row 0
  dtype_code dtype       = dtype_code::i64;  ///< element type
  std::int64_t row_stride = 0;       ///< elements between rows (>= K)
};

/// @brief Takes rows handed over where they lie in storage (for_each_row_run, slot_rows::for_each_run),
/// with the element type erased: what the host compiler's code that writes a format from storage
/// (a route record) receives from instantiations nvcc may have compiled.
class row_run_sink {
 public:
  /// @brief n rows of the index type: id (t, l, k) at `first[t * token_stride + l * layer_stride + k]`.
  virtual void rows(const void* first, std::int64_t n, std::int64_t token_stride, std::int64_t layer_stride) = 0;
  /// @brief n positions without a row.
  virtual void missing(std::int64_t n) = 0;

 protected:
  ~row_run_sink() = default;
};

/// @brief A request's routing as extracted: a view into host storage or an owned copy.
struct extraction {
  const void* data          = nullptr;  ///< row-major [rows, layers, top_k] of the index type
  std::int64_t rows         = 0;        ///< T
  std::int64_t layers       = 0;        ///< captured layers, or all model layers
  std::int64_t top_k        = 0;        ///< K
  std::int64_t first_position = 0;      ///< position of row 0
  std::int64_t prompt_length = -1;      ///< prompt/generation split, -1 if unknown
  bool is_view              = false;    ///< a zero-copy view of per-request storage
  std::shared_ptr<void> owner;          ///< keeps the rows (view or copy) object alive
};

/// @brief A 2-D window of the device buffer D handed to kernels that write routing themselves.
struct layer_window {
  void* data              = nullptr;  ///< element (row 0, column 0)
  std::int64_t rows       = 0;        ///< rows of the view
  std::int64_t cols       = 0;        ///< K
  std::int64_t row_stride = 0;        ///< elements between rows (K for layer_major, L * K otherwise)
};

/// @brief One RoutingReplay instantiation behind virtual calls. Stream handles are integers: a
/// cudaStream_t for the CUDA backend, a host_stream* for the host backend.
///
/// Besides RoutingReplay's own calls it offers a staging path for engines that state a step's
/// positions only after its forward (the drop-in capturer): stage_capture() writes a private
/// device buffer during the forward, and commit_staged_step() opens the step and closes it, the
/// end-of-step kernel moving the staged rows into D before it checks them (no kernel of their own).
class replay_base {
 public:
  virtual ~replay_base() = default;

  /// @brief The instantiation's policy names.
  [[nodiscard]] virtual const policy_names& policies() const noexcept = 0;
  /// @brief The stored index type.
  [[nodiscard]] virtual dtype_code index_dtype() const noexcept = 0;
  /// @brief The validated configuration.
  [[nodiscard]] virtual const replay_config& config() const noexcept = 0;
  /// @brief Whether the instantiation stores rows at KV slots (block_slot storage).
  [[nodiscard]] virtual bool slot_indexed() const noexcept = 0;

  /// @brief RoutingReplay::num_layers().
  [[nodiscard]] virtual std::int32_t num_layers() const noexcept = 0;
  /// @brief RoutingReplay::device_bytes().
  [[nodiscard]] virtual std::size_t device_bytes() const noexcept = 0;
  /// @brief RoutingReplay::snapshot_bytes().
  [[nodiscard]] virtual std::size_t snapshot_bytes() const noexcept = 0;
  /// @brief Bytes of the staging buffer of the staging path (0 without it).
  [[nodiscard]] virtual std::size_t staging_bytes() const noexcept = 0;
  /// @brief RoutingReplay::host_bytes().
  [[nodiscard]] virtual std::size_t host_bytes() const noexcept = 0;
  /// @brief RoutingReplay::steps_in_flight().
  [[nodiscard]] virtual std::size_t steps_in_flight() const noexcept = 0;
  /// @brief RoutingReplay::num_requests().
  [[nodiscard]] virtual std::size_t num_requests() const noexcept = 0;
  /// @brief RoutingReplay::wait_for_host_memory_ahead().
  virtual void wait_for_host_memory_ahead() const = 0;
  /// @brief RoutingReplay::host_memory_growth().
  [[nodiscard]] virtual routing_replay::host_memory_growth host_memory_growth() const noexcept = 0;
  /// @brief RoutingReplay::layer_slot().
  [[nodiscard]] virtual std::int32_t layer_slot(std::int32_t model_layer) const = 0;

  /// @brief RoutingReplay::add_request(): the request's handle.
  virtual request_handle add_request(request_key id, const request_options& options) = 0;
  /// @brief RoutingReplay::handle(): the handle of a live request.
  [[nodiscard]] virtual request_handle handle(request_key id) const = 0;
  /// @brief RoutingReplay::add_cached_prefix().
  virtual void add_cached_prefix(request_key id, std::span<const std::int64_t> slots) = 0;
  /// @brief RoutingReplay::contains().
  [[nodiscard]] virtual bool contains(request_key id) const = 0;
  /// @brief RoutingReplay::recorded_rows().
  [[nodiscard]] virtual std::int64_t recorded_rows(request_key id) = 0;
  /// @brief RoutingReplay::accept_draft().
  virtual void accept_draft(request_key id, std::int32_t num_accepted) = 0;
  /// @brief RoutingReplay::extract().
  [[nodiscard]] virtual extraction extract(request_key id, const extract_options& options) = 0;
  /// @brief RoutingReplay::for_each_row_run(), runs handed to `sink` (row_size() ids a row, K a layer).
  virtual row_range for_each_row_run(request_key id, const extract_options& options, row_run_sink& sink) = 0;
  /// @brief RoutingReplay::release().
  virtual void release(request_key id) = 0;
  /// @brief RoutingReplay::abort().
  virtual void abort(request_key id) = 0;

  /// @brief RoutingReplay::export_blocks() into `out` (index-type elements).
  virtual void export_blocks(std::span<const std::int64_t> blocks, void* out, std::size_t elems) = 0;
  /// @brief RoutingReplay::import_blocks() from `rows` (index-type elements).
  virtual void import_blocks(std::span<const std::int64_t> blocks, const void* rows, std::size_t elems) = 0;
  /// @brief RoutingReplay::copy_blocks().
  virtual void copy_blocks(std::span<const std::int64_t> source, std::span<const std::int64_t> destination) = 0;

  /// @brief RoutingReplay::begin_step().
  virtual void begin_step(const step_plan& plan, std::uintptr_t stream) = 0;
  /// @brief RoutingReplay::end_step().
  virtual void end_step(std::uintptr_t stream) = 0;
  /// @brief RoutingReplay::drain().
  virtual void drain() = 0;
  /// @brief RoutingReplay::reset_device_buffer().
  virtual void reset_device_buffer(std::uintptr_t stream) = 0;

  /// @brief RoutingReplay::capture() with the element type chosen at run time.
  virtual void capture(std::int32_t model_layer,
                       const id_array& ids,
                       std::int64_t num_tokens,
                       std::uintptr_t stream,
                       const capture_options& options) = 0;
  /// @brief RoutingReplay::layer_view() as a raw window.
  [[nodiscard]] virtual layer_window layer_view(std::int32_t model_layer, std::int64_t num_rows) = 0;

  /// @brief Staging path: records a layer's router output into the staging buffer (one kernel,
  /// graph safe), to be moved into D by commit_staged_step().
  /// @throws error invalid_state without a staging buffer; as capture()
  virtual void stage_capture(std::int32_t model_layer,
                             const id_array& ids,
                             std::int64_t num_tokens,
                             std::uintptr_t stream) = 0;
  /// @brief Staging path: begin_step(plan), then end_step() whose end-of-step kernel first records
  /// staged rows [0, N) into D as ref(N).record() would (invalid ids are reported with their value;
  /// unstaged ones stay unwritten) and resets every staged row. The staging buffer is reset even
  /// when begin_step throws.
  virtual void commit_staged_step(const step_plan& plan, std::uintptr_t stream) = 0;
  /// @brief Staging path: resets every staged row a forward may have written without a step
  /// (warm-up or empty forwards).
  virtual void reset_staging(std::uintptr_t stream) = 0;
};

}  // namespace routing_replay::python
