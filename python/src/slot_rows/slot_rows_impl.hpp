/// @file
/// slot_rows_impl: one slot_rows instantiation behind slot_rows_base. Included by the host
/// translation unit (g++) and the CUDA one (nvcc); stream handles are converted by
/// stream_cast<Backend> (replay_impl.hpp, cuda_stream_cast.cuh).
#pragma once

#include "replay_impl.hpp"
#include "slot_rows_base.hpp"

#include <routing_replay/slot_rows.hpp>

#include <cstdint>
#include <memory>
#include <span>
#include <string>

namespace routing_replay::python {

/// @brief One compiled slot_rows<Backend, Index, layer_major> behind slot_rows_base.
template <class Backend, class Index>
class slot_rows_impl final : public slot_rows_base {
  using streams = stream_cast<Backend>;

 public:
  /// @brief Builds the instance.
  explicit slot_rows_impl(const slot_rows_config& config) : rows_(config) {}

  /// @brief The factory of this instantiation.
  [[nodiscard]] static std::unique_ptr<slot_rows_base> make(const slot_rows_config& config)
  {
    return std::make_unique<slot_rows_impl>(config);
  }

  [[nodiscard]] dtype_code index_dtype() const noexcept override { return dtype_of<Index>(); }
  [[nodiscard]] const slot_rows_config& config() const noexcept override { return rows_.config(); }
  [[nodiscard]] std::size_t pinned_bytes() const noexcept override { return rows_.pinned_bytes(); }
  [[nodiscard]] std::size_t device_bytes() const noexcept override { return rows_.device_bytes(); }
  [[nodiscard]] std::size_t steps_in_flight() const noexcept override { return rows_.steps_in_flight(); }
  [[nodiscard]] std::uint64_t last_step() const noexcept override { return rows_.last_step(); }
  [[nodiscard]] bool layer_captured(std::int32_t model_layer) const noexcept override
  {
    return rows_.layer_captured(model_layer);
  }

  void capture(std::int32_t model_layer, const id_array& ids, std::int64_t rows, std::uintptr_t stream) override
  {
    visit_dtype(ids.dtype, [&](auto tag) {
      using T = decltype(tag);
      rows_.capture(model_layer, static_cast<const T*>(ids.data), rows, streams::from(stream), ids.row_stride);
    });
  }

  std::uint64_t end_step(const void* slots, dtype_code slot_dtype, std::int64_t rows, std::uintptr_t stream,
                         const slot_step_options& options) override
  {
    if (slot_dtype == dtype_code::i32) {
      return rows_.end_step(static_cast<const std::int32_t*>(slots), rows, streams::from(stream), options);
    }
    if (slot_dtype == dtype_code::i64) {
      return rows_.end_step(static_cast<const std::int64_t*>(slots), rows, streams::from(stream), options);
    }
    throw error{errc::invalid_argument,
                std::string{"end_step: KV slots must be int32 or int64, got "} + dtype_name(slot_dtype)};
  }

  std::uint64_t poll() override { return rows_.poll(); }
  void wait(std::uint64_t serial) override { rows_.wait(serial); }
  void throw_failure(std::uint64_t serial) override { rows_.throw_failure(serial); }

  void read_int32(const void* slots, dtype_code slot_dtype, std::size_t count, std::int32_t* out,
                  const slot_read_options& options) const override
  {
    visit_dtype(slot_dtype, [&](auto tag) {
      using T = decltype(tag);
      rows_.template read<std::int32_t>(std::span<const T>{static_cast<const T*>(slots), count}, out, options);
    });
  }

  [[nodiscard]] std::size_t base64_chars_int32(std::int64_t rows) const noexcept override
  {
    return rows_.template base64_chars<std::int32_t>(rows);
  }

  void read_base64_int32(const void* slots, dtype_code slot_dtype, std::size_t count, char* chars,
                         const slot_read_options& options) const override
  {
    visit_dtype(slot_dtype, [&](auto tag) {
      using T = decltype(tag);
      rows_.template read_base64<std::int32_t>(std::span<const T>{static_cast<const T*>(slots), count}, chars, options);
    });
  }

  [[nodiscard]] std::vector<std::int32_t> run_layers() const override { return rows_.run_layers(); }

  void for_each_run(const void* slots, dtype_code slot_dtype, std::size_t count, row_run_sink& sink,
                    const slot_read_options& options) const override
  {
    visit_dtype(slot_dtype, [&](auto tag) {
      using T = decltype(tag);
      rows_.for_each_run(
        std::span<const T>{static_cast<const T*>(slots), count},
        [&](const Index* rows, std::int64_t n, std::int64_t token_stride, std::int64_t layer_stride) {
          sink.rows(rows, n, token_stride, layer_stride);
        },
        [&](std::int64_t n) { sink.missing(n); }, options);
    });
  }

 private:
  slot_rows<Backend, Index, layer_major> rows_;
};

/// @brief Registers the uint8, uint16 and int32 instantiations of a backend.
template <class Backend>
void add_slot_rows(slot_rows_factories& table)
{
  table["uint8"]  = &slot_rows_impl<Backend, std::uint8_t>::make;
  table["uint16"] = &slot_rows_impl<Backend, std::uint16_t>::make;
  table["int32"]  = &slot_rows_impl<Backend, std::int32_t>::make;
}

}  // namespace routing_replay::python
