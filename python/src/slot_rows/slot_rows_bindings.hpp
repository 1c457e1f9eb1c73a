/// @file
/// The object Python holds for one slot_rows instantiation (routing_replay._core.SlotRows), shared
/// by the host module, which binds it, and the CUDA module, which only creates it.
#pragma once

#include "handle.hpp"
#include "slot_rows_base.hpp"

#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace routing_replay::python {

/// @brief Host backend: buffers that keep what a kernel reads later (a router output, a step's
/// slots) while the caller may change its own array at once, recycled so that steady-state steps
/// allocate nothing. A buffer returns to the pool when the last holder lets it go (the stream's task).
class host_copies : public std::enable_shared_from_this<host_copies> {
 public:
  /// @brief A buffer of at least `bytes` bytes (contents unspecified), returned when destroyed.
  [[nodiscard]] std::shared_ptr<std::vector<std::byte>> take(std::size_t bytes)
  {
    std::vector<std::byte> b;
    {
      const std::lock_guard lock{mutex_};
      if (!free_.empty()) {
        b = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (b.size() < bytes) { b.resize(bytes); }
    auto self = shared_from_this();
    return std::shared_ptr<std::vector<std::byte>>(new std::vector<std::byte>(std::move(b)),
                                                   [self](std::vector<std::byte>* p) {
                                                     self->give(std::move(*p));
                                                     delete p;
                                                   });
  }

 private:
  void give(std::vector<std::byte> b) noexcept
  {
    try {
      const std::lock_guard lock{mutex_};
      free_.push_back(std::move(b));
    } catch (...) {  // no room to keep it: freed instead
    }
  }

  std::mutex mutex_;  // buffers come back on the stream's worker thread
  std::vector<std::vector<std::byte>> free_;
};

/// @brief One slot_rows as Python sees it.
struct slot_rows_handle {
  /// @brief Takes over an instantiation running on `kind`, on CUDA device `device`.
  slot_rows_handle(std::unique_ptr<slot_rows_base> rows, backend_kind kind, std::int32_t device)
    : impl(std::move(rows)), backend(kind), device_id(device)
  {
  }
  /// @brief Takes over another handle (nanobind moves a returned handle into its Python object).
  slot_rows_handle(slot_rows_handle&&) noexcept            = default;
  slot_rows_handle& operator=(slot_rows_handle&&) noexcept = delete;
  slot_rows_handle(const slot_rows_handle&)                = delete;
  slot_rows_handle& operator=(const slot_rows_handle&)     = delete;

  std::unique_ptr<slot_rows_base> impl;  ///< the instantiation
  backend_kind backend;                  ///< host or CUDA
  std::int32_t device_id;                ///< CUDA device of the buffers (0 on the host)
  /// @brief Host backend: copies of what queued kernels read.
  std::shared_ptr<host_copies> copies = std::make_shared<host_copies>();
};

/// @brief Creates the instantiation `table` holds for an index type.
/// @throws error invalid_argument when it is not compiled; as the constructor
inline slot_rows_handle create_slot_rows(const slot_rows_factories& table, const std::string& index,
                                         const slot_rows_config& config, backend_kind kind, std::int32_t device)
{
  const auto it = table.find(index);
  if (it == table.end()) {
    throw error{errc::invalid_argument, "no compiled slot_rows for index type '" + index +
                                          "' (compiled: uint8, uint16, int32)"};
  }
  return slot_rows_handle{it->second(config), kind, device};
}

/// @brief Binds SlotRows, SlotRowsConfig and create_slot_rows into routing_replay._core.
void bind_slot_rows(nanobind::module_& m);
/// @brief Binds create_slot_rows into routing_replay._core_cuda (the classes come from _core).
void bind_cuda_slot_rows(nanobind::module_& m);

}  // namespace routing_replay::python
