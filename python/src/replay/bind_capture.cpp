/// @file
/// The binding's capture: NativeReplay's capture calls (from a pointer, from a plain 2-D integer
/// array read natively, and the drop-in's staged capture) and the view of a layer that kernels
/// write routing into. On the host backend the ids are snapshot in the call, so Python may reuse
/// its array at once.
#include "bindings.hpp"

#include <routing_replay/host_backend.hpp>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

using namespace nb::literals;

namespace routing_replay::python {
namespace {

/// What a capture kernel reads. On the host backend the ids are snapshot during the call, so the
/// caller may reuse or free its array at once (Python writes are not ordered with host streams);
/// the snapshot lives until the stream has run the kernel. A capture that reads its int64 ids
/// before the call returns (`read_in_call`: staged on an idle stream, host_inline_scope) takes
/// no snapshot.
struct capture_source {
  id_array ids;
  capture_options options;
  std::shared_ptr<snapshot_pool::buffer> ids_copy;
  std::shared_ptr<std::vector<std::int32_t>> map_copy;
};

capture_source capture_source_of(const replay_handle& h, std::uintptr_t data, std::int32_t dtype,
                                 std::int64_t num_tokens, std::int64_t row_stride, std::int64_t row_offset,
                                 std::uintptr_t physical_to_logical, std::int64_t num_physical,
                                 bool read_in_call = false)
{
  if (dtype < 0 || dtype > static_cast<std::int32_t>(dtype_code::u64)) { throw nb::value_error("bad dtype code"); }
  if (row_offset < 0) { throw nb::value_error("row_offset must be >= 0"); }
  capture_source s;
  const auto d                   = static_cast<dtype_code>(dtype);
  s.ids.dtype                    = d;
  s.ids.row_stride               = row_stride;
  s.options.num_physical_experts = num_physical;
  const auto* base               = reinterpret_cast<const std::byte*>(data);  // NOLINT: the pointer protocol
  if (h.backend == backend_kind::cuda) {
    s.ids.data                    = base;
    s.options.source_row_offset   = row_offset;
    s.options.physical_to_logical = reinterpret_cast<const std::int32_t*>(physical_to_logical);  // NOLINT
    return s;
  }
  // Host: the first K ids of rows [row_offset, row_offset + num_tokens), as compact int64.
  const std::int64_t k = h.impl->config().top_k;
  s.ids.dtype          = dtype_code::i64;
  s.ids.data           = base;  // a null pointer or a short stride: the library refuses it
  if (read_in_call && d == dtype_code::i64) {
    if (base != nullptr) { s.ids.data = base + row_offset * row_stride * std::int64_t{sizeof(std::int64_t)}; }  // NOLINT
  } else if (base != nullptr && num_tokens > 0 && row_stride >= k) {
    s.ids_copy = h.snapshots->take(static_cast<std::size_t>(num_tokens * k));
    auto* out  = s.ids_copy->data();
    visit_dtype(d, [&](auto tag) {
      using source   = decltype(tag);
      const auto* in = reinterpret_cast<const source*>(base) + row_offset * row_stride;  // NOLINT
      if constexpr (std::is_same_v<source, std::int64_t>) {
        // the common case (a router's int64 top-k, K columns): one copy, not a loop the module's -O2
        // leaves scalar (8192 ids at B1024: about 6 us as a loop on the CPU machine)
        if (row_stride == k) {
          std::memcpy(out, in, static_cast<std::size_t>(num_tokens * k) * sizeof(std::int64_t));
          return;
        }
      }
      for (std::int64_t r = 0; r < num_tokens; ++r) {
        for (std::int64_t c = 0; c < k; ++c) { out[r * k + c] = static_cast<std::int64_t>(in[r * row_stride + c]); }
      }
    });
    s.ids.data       = out;
    s.ids.row_stride = k;
  }
  if (physical_to_logical != 0 && num_physical > 0) {
    const auto* map = reinterpret_cast<const std::int32_t*>(physical_to_logical);  // NOLINT
    s.map_copy      = std::make_shared<std::vector<std::int32_t>>(map, map + num_physical);
    s.options.physical_to_logical = s.map_copy->data();
  } else {
    s.options.physical_to_logical = reinterpret_cast<const std::int32_t*>(physical_to_logical);  // NOLINT
  }
  return s;
}

/// Keeps a host snapshot alive until `stream` has run what was enqueued before.
void hold_until_done(const replay_handle& h, std::uintptr_t stream, capture_source& s)
{
  if (h.backend == backend_kind::host && (s.ids_copy || s.map_copy)) {
    reinterpret_cast<host_stream*>(stream)->enqueue([ids = std::move(s.ids_copy), map = std::move(s.map_copy)] {});  // NOLINT
  }
}

/// The drop-in's capture: stages `rows` rows of a router output on `stream`. On the host backend an
/// int64 output staged on an idle stream is copied in the call, on this thread
/// (host_inline_scope): no snapshot, and no task for the stream's worker, which a forward's layers
/// would otherwise wake one by one.
void stage_capture(replay_handle& h, std::int32_t layer, std::uintptr_t data, std::int32_t dtype, std::int64_t rows,
                   std::int64_t row_stride, std::uintptr_t stream)
{
  std::optional<host_inline_scope> idle_stream;
  if (h.backend == backend_kind::host && dtype == static_cast<std::int32_t>(dtype_code::i64) && stream != 0) {
    idle_stream.emplace(host_stream_ref{*reinterpret_cast<host_stream*>(stream)});  // NOLINT: the handle protocol
  }
  capture_source s = capture_source_of(h, data, dtype, rows, row_stride, 0, 0, 0, idle_stream && idle_stream->active());
  h.impl->stage_capture(layer, s.ids, rows, stream);
  hold_until_done(h, stream, s);
}

}  // namespace

void bind_capture(nb::class_<replay_handle>& native)
{
  native
    .def("capture",
         [](replay_handle& h, std::int32_t layer, std::uintptr_t data, std::int32_t dtype, std::int64_t num_tokens,
            std::int64_t row_stride, std::uintptr_t stream, std::int64_t row_offset, std::uintptr_t physical_to_logical,
            std::int64_t num_physical) {
           capture_source s = capture_source_of(h, data, dtype, num_tokens, row_stride, row_offset,
                                                physical_to_logical, num_physical);
           h.impl->capture(layer, s.ids, num_tokens, stream, s.options);
           hold_until_done(h, stream, s);
         },
         "layer"_a, "data"_a, "dtype"_a, "num_tokens"_a, "row_stride"_a, "stream"_a, "row_offset"_a = 0,
         "physical_to_logical"_a = 0, "num_physical"_a = 0)
    .def("stage_capture", &stage_capture)
    .def("capture_array",
         [](replay_handle& h, std::int32_t layer, nb::handle array, std::uintptr_t stream, bool staged) {
           // the host backend's hot path: a plain 2-D integer array read through the buffer protocol,
           // no Python-side description of it; anything else (false) takes the general path, which
           // describes and reports it
           nb::ndarray<nb::ro, nb::ndim<2>, nb::device::cpu> ids;
           if (h.backend != backend_kind::host || !nb::try_cast(array, ids)) { return false; }
           const auto rows = static_cast<std::int64_t>(ids.shape(0));
           const auto cols = static_cast<std::int64_t>(ids.shape(1));
           const auto& t   = ids.dtype();
           const bool integer = (t.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Int) ||
                                 t.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::UInt)) &&
                                t.lanes == 1;
           if (!integer || rows < 1 || ids.stride(1) != 1 || cols < h.impl->config().top_k ||
               (rows > 1 && ids.stride(0) < cols)) {
             return false;
           }
           const std::int64_t row_stride = rows == 1 ? std::max<std::int64_t>(ids.stride(0), cols) : ids.stride(0);
           const auto data               = reinterpret_cast<std::uintptr_t>(ids.data());
           const auto dtype              = static_cast<std::int32_t>(dtype_from_dlpack(t));
           if (staged) {
             stage_capture(h, layer, data, dtype, rows, row_stride, stream);
             return true;
           }
           capture_source s = capture_source_of(h, data, dtype, rows, row_stride, 0, 0, 0);
           h.impl->capture(layer, s.ids, rows, stream, s.options);
           hold_until_done(h, stream, s);
           return true;
         },
         "layer"_a, "ids"_a, "stream"_a, "staged"_a)
    .def("layer_view", [](nb::handle self, std::int32_t layer, std::int64_t rows) {
      auto& h              = nb::cast<replay_handle&>(self);
      const layer_window w = h.impl->layer_view(layer, rows);
      const auto r         = static_cast<std::size_t>(w.rows);
      const auto k         = static_cast<std::size_t>(w.cols);
      const dtype_code d   = h.impl->index_dtype();
      if (h.backend == backend_kind::host) {
        return make_array<nb::ndarray<nb::numpy>>(w.data, {r, k}, self, d, {w.row_stride, 1});
      }
      return make_array<nb::ndarray<>>(w.data, {r, k}, self, d, {w.row_stride, 1}, nb::device::cuda::value,
                                        h.device_id);
    });
}

}  // namespace routing_replay::python
