/// @file
/// The type-erased face of one compiled slot_rows instantiation (rows stored at KV slots the device
/// holds, include/routing_replay/slot_rows.hpp), as the Python bindings see it: raw pointers,
/// element-type codes and stream handles instead of template parameters.
#pragma once

#include "replay_base.hpp"

#include <routing_replay/slot_rows.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace routing_replay::python {

/// @brief One slot_rows instantiation behind virtual calls. Stream handles are integers: a
/// cudaStream_t for the CUDA backend, a host_stream* for the host backend.
class slot_rows_base {
 public:
  virtual ~slot_rows_base() = default;

  /// @brief The stored index type.
  [[nodiscard]] virtual dtype_code index_dtype() const noexcept = 0;
  /// @brief The validated configuration.
  [[nodiscard]] virtual const slot_rows_config& config() const noexcept = 0;
  /// @brief slot_rows::pinned_bytes().
  [[nodiscard]] virtual std::size_t pinned_bytes() const noexcept = 0;
  /// @brief slot_rows::device_bytes().
  [[nodiscard]] virtual std::size_t device_bytes() const noexcept = 0;
  /// @brief slot_rows::steps_in_flight().
  [[nodiscard]] virtual std::size_t steps_in_flight() const noexcept = 0;
  /// @brief slot_rows::last_step().
  [[nodiscard]] virtual std::uint64_t last_step() const noexcept = 0;
  /// @brief slot_rows::layer_captured().
  [[nodiscard]] virtual bool layer_captured(std::int32_t model_layer) const noexcept = 0;

  /// @brief slot_rows::capture() with the element type chosen at run time.
  virtual void capture(std::int32_t model_layer, const id_array& ids, std::int64_t rows, std::uintptr_t stream) = 0;
  /// @brief slot_rows::end_step() with the slots' element type (int32 or int64) chosen at run time.
  virtual std::uint64_t end_step(const void* slots, dtype_code slot_dtype, std::int64_t rows, std::uintptr_t stream,
                                 const slot_step_options& options) = 0;
  /// @brief slot_rows::poll().
  virtual std::uint64_t poll() = 0;
  /// @brief slot_rows::wait().
  virtual void wait(std::uint64_t serial) = 0;
  /// @brief slot_rows::throw_failure().
  virtual void throw_failure(std::uint64_t serial) = 0;
  /// @brief slot_rows::read() as int32 from host slots of an integer type.
  virtual void read_int32(const void* slots, dtype_code slot_dtype, std::size_t count, std::int32_t* out,
                          const slot_read_options& options) const = 0;
  /// @brief slot_rows::base64_chars() of int32 rows.
  [[nodiscard]] virtual std::size_t base64_chars_int32(std::int64_t rows) const noexcept = 0;
  /// @brief slot_rows::read_base64() of int32 rows.
  virtual void read_base64_int32(const void* slots, dtype_code slot_dtype, std::size_t count, char* chars,
                                 const slot_read_options& options) const = 0;
  /// @brief slot_rows::run_layers(): the model layers for_each_run() hands over.
  [[nodiscard]] virtual std::vector<std::int32_t> run_layers() const = 0;
  /// @brief slot_rows::for_each_run() from host slots of an integer type, runs handed to `sink`.
  virtual void for_each_run(const void* slots, dtype_code slot_dtype, std::size_t count, row_run_sink& sink,
                            const slot_read_options& options) const = 0;
};

/// @brief Makes one instantiation for a configuration.
using slot_rows_factory = std::unique_ptr<slot_rows_base> (*)(const slot_rows_config&);
/// @brief The compiled instantiations of one backend, by index type name ("uint8", ...).
using slot_rows_factories = std::map<std::string, slot_rows_factory>;

/// @brief Registers the host backend's instantiations (slot_rows_host.cpp).
void register_host_slot_rows(slot_rows_factories& table);
/// @brief Registers the CUDA backend's instantiations (slot_rows_cuda.cu).
void register_cuda_slot_rows(slot_rows_factories& table);

}  // namespace routing_replay::python
