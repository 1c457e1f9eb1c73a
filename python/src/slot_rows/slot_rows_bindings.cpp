/// @file
/// routing_replay._core's bindings of slot_rows: SlotRowsConfig, SlotRows and create_slot_rows (the
/// host backend). The Python layer (routing_replay/sglang) turns tensors and streams into the
/// pointers and handles taken here; one native call per engine call.
#include "slot_rows_bindings.hpp"

#include "bindings.hpp"

#include <routing_replay/host_backend.hpp>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <limits>
#include <optional>
#include <string>

namespace nb = nanobind;
using namespace nb::literals;

namespace routing_replay::python {
namespace {

const slot_rows_factories& host_slot_rows()
{
  static const slot_rows_factories table = [] {
    slot_rows_factories t;
    register_host_slot_rows(t);
    return t;
  }();
  return table;
}

/// The dtype code of a 1-D or 2-D integer array's elements.
dtype_code integer_dtype(const nb::dlpack::dtype& t, const char* what)
{
  if (const auto code = integer_dtype_code(t)) { return *code; }
  throw nb::type_error((std::string{what} + ": expected an integer array").c_str());
}

host_stream& host_stream_of(std::uintptr_t handle)
{
  if (handle == 0) { throw error{errc::invalid_argument, "host backend: null stream handle"}; }
  return *reinterpret_cast<host_stream*>(handle);  // NOLINT: the handle protocol
}

/// A capture: at once on an idle host stream (the kernel reads the caller's array during the call),
/// else from a copy of the rows' first K ids that lives until the stream has run the kernel (Python
/// writes are not ordered with host streams). On CUDA, the pointers as they are.
void capture(slot_rows_handle& h, std::int32_t layer, std::uintptr_t data, std::int32_t dtype, std::int64_t rows,
             std::int64_t row_stride, std::uintptr_t stream)
{
  const auto d = static_cast<dtype_code>(dtype);
  const id_array ids{reinterpret_cast<const void*>(data), d, row_stride};  // NOLINT: the pointer protocol
  if (h.backend != backend_kind::host) {
    h.impl->capture(layer, ids, rows, stream);
    return;
  }
  host_stream& s = host_stream_of(stream);
  const host_inline_scope idle{s.ref()};
  if (idle.active() || rows <= 0) {
    h.impl->capture(layer, ids, rows, stream);
    return;
  }
  const auto k     = static_cast<std::size_t>(h.impl->config().top_k);
  const auto size  = dtype_size(d);
  auto copy        = h.copies->take(static_cast<std::size_t>(rows) * k * size);
  const auto* from = reinterpret_cast<const std::byte*>(data);  // NOLINT: the pointer protocol
  for (std::int64_t r = 0; r < rows; ++r) {
    std::memcpy(copy->data() + static_cast<std::size_t>(r) * k * size,
                from + static_cast<std::size_t>(r * row_stride) * size, k * size);
  }
  h.impl->capture(layer, id_array{copy->data(), d, static_cast<std::int64_t>(k)}, rows, stream);
  s.enqueue([copy] {});
}

/// Retires the steps already done and, if `serial` is not among them, waits for it without the GIL.
/// A done step costs no wait and no GIL hand-over: the common case, once a step a little older than
/// the newest (the synchronous path's) or its copy's event (the overlap path's) has been waited for
/// by the engine.
void retire_through(slot_rows_handle& h, std::uint64_t serial)
{
  if (h.impl->poll() >= serial) { return; }
  nb::gil_scoped_release unlocked;
  h.impl->wait(serial);
}

/// An end of step; on the host backend the step's slots are read at once (idle stream) or copied.
/// `check`: then retire the steps before it (waiting for their scatters) and those already done, and
/// raise the first failure among the steps before it.
std::uint64_t end_step(slot_rows_handle& h, std::uintptr_t slots, std::int32_t dtype, std::int64_t rows,
                       std::uintptr_t stream, bool graph_replayed, std::int64_t padded_rows, bool check)
{
  const slot_step_options options{graph_replayed, padded_rows};
  const auto d         = static_cast<dtype_code>(dtype);
  const void* pointer  = reinterpret_cast<const void*>(slots);  // NOLINT: the pointer protocol
  std::uint64_t serial = 0;
  if (h.backend != backend_kind::host) {
    serial = h.impl->end_step(pointer, d, rows, stream, options);
  } else {
    host_stream& s = host_stream_of(stream);
    nb::gil_scoped_release unlocked;  // an idle stream runs the end-of-step kernel here
    const host_inline_scope idle{s.ref()};
    if (idle.active() || rows <= 0) {
      serial = h.impl->end_step(pointer, d, rows, stream, options);
    } else {
      const std::size_t bytes = static_cast<std::size_t>(rows) * dtype_size(d);
      auto copy               = h.copies->take(bytes);
      std::memcpy(copy->data(), pointer, bytes);
      serial = h.impl->end_step(copy->data(), d, rows, stream, options);
      s.enqueue([copy] {});
    }
  }
  if (check) {
    // the synchronous path: the previous step's forward has run (the engine read its tokens), so its
    // scatter is done or nearly; a step's error is raised by the next end of step, every time (never
    // by its own, even where it is done by now: a host stream runs an idle step inline)
    retire_through(h, serial - 1);
    h.impl->throw_failure(serial - 1);
  }
  return serial;
}

/// A 1-D integer array of host slots: its pointer, element type and length (contiguous).
struct host_slots {
  const void* data = nullptr;
  dtype_code dtype = dtype_code::i64;
  std::size_t count = 0;
};

host_slots slots_of(const nb::ndarray<nb::ro, nb::ndim<1>, nb::device::cpu>& a)
{
  if (a.shape(0) > 1 && a.stride(0) != 1) { throw nb::value_error("KV slots: expected a contiguous 1-D array"); }
  return {a.data(), integer_dtype(a.dtype(), "KV slots"), a.shape(0)};
}

slot_read_options read_options(std::int64_t first_position, std::string request, std::int64_t uncaptured)
{
  slot_read_options o;
  o.first_position   = first_position;
  o.request          = std::move(request);
  o.uncaptured_value = uncaptured;
  return o;
}

}  // namespace

void bind_slot_rows(nb::module_& m)
{
  nb::class_<slot_rows_config>(m, "SlotRowsConfig", "routing_replay::slot_rows_config: sizes and choices of a SlotRows")
    .def(nb::init<>())
    .def_rw("num_experts", &slot_rows_config::num_experts, "E: routed experts; valid ids are [0, E)")
    .def_rw("top_k", &slot_rows_config::top_k, "K: ids kept per row and layer")
    .def_rw("num_fused_shared_experts", &slot_rows_config::num_fused_shared_experts,
            "router-output columns after the first K, skipped")
    .def_rw("max_tokens_per_step", &slot_rows_config::max_tokens_per_step, "N_max: most rows of one step, padding included")
    .def_rw("num_model_layers", &slot_rows_config::num_model_layers, "layers of the model; a read returns this many")
    .def_rw("layers", &slot_rows_config::layers, "model layers the pool keeps (empty: every layer)")
    .def_rw("num_slots", &slot_rows_config::num_slots, "slots of the KV pool: one row each")
    .def_rw("page_size", &slot_rows_config::page_size, "tokens per KV page")
    .def_rw("steps_in_flight", &slot_rows_config::steps_in_flight, "steps whose scatter may be in flight at once")
    .def_rw("scatter_on_compute_stream", &slot_rows_config::scatter_on_compute_stream,
            "run the scatter on the compute stream instead of a side stream")
    .def_rw("fused_scatter_max_rows", &slot_rows_config::fused_scatter_max_rows,
            "steps of at most this many rows are stored by the end-of-step kernel itself (0: never)");

  nb::class_<slot_rows_handle>(m, "SlotRows",
                               "Rows stored at KV slots the device holds (routing_replay::slot_rows); internal: use "
                               "routing_replay.sglang.RoutedExpertsCapturer.")
    .def_prop_ro("index_dtype", [](const slot_rows_handle& h) { return dtype_name(h.impl->index_dtype()); })
    .def_prop_ro("on_host", [](const slot_rows_handle& h) { return h.backend == backend_kind::host; })
    .def_prop_ro("device", [](const slot_rows_handle& h) { return h.device_id; })
    .def_prop_ro("config", [](const slot_rows_handle& h) { return h.impl->config(); })
    .def_prop_ro("pinned_bytes", [](const slot_rows_handle& h) { return h.impl->pinned_bytes(); })
    .def_prop_ro("device_bytes", [](const slot_rows_handle& h) { return h.impl->device_bytes(); })
    .def_prop_ro("steps_in_flight", [](const slot_rows_handle& h) { return h.impl->steps_in_flight(); })
    .def_prop_ro("last_step", [](const slot_rows_handle& h) { return h.impl->last_step(); })
    .def("layer_captured", [](const slot_rows_handle& h, std::int32_t layer) { return h.impl->layer_captured(layer); },
         "model_layer"_a, "Whether a capture path was ever handed the layer.")
    .def("capture", &capture, "layer"_a, "data"_a, "dtype"_a, "rows"_a, "row_stride"_a, "stream"_a,
         "Records a layer's router output (pointer, dtype code, rows, elements between rows) on `stream`.")
    .def("capture_array",
         [](slot_rows_handle& h, std::int32_t layer, nb::handle array, std::uintptr_t stream) {
           // the host backend's path for numpy arrays and CPU tensors; false: not one (described by Python)
           nb::ndarray<nb::ro, nb::ndim<2>, nb::device::cpu> ids;
           if (h.backend != backend_kind::host || !nb::try_cast(array, ids)) { return false; }
           const auto rows = static_cast<std::int64_t>(ids.shape(0));
           const auto cols = static_cast<std::int64_t>(ids.shape(1));
           if (cols > 1 && ids.stride(1) != 1) { return false; }
           const std::int64_t stride = rows <= 1 ? cols : ids.stride(0);
           capture(h, layer, reinterpret_cast<std::uintptr_t>(ids.data()),
                   static_cast<std::int32_t>(integer_dtype(ids.dtype(), "topk_indices")), rows, stride, stream);
           return true;
         },
         "layer"_a, "ids"_a, "stream"_a)
    .def("end_step", &end_step, "slots"_a, "dtype"_a, "rows"_a, "stream"_a, "graph_replayed"_a, "padded_rows"_a,
         "check"_a,
         "Ends the step on `stream`: its rows go to the KV slots at `slots` (device pointer of int32 or int64). "
         "check: then raise the first failure of the steps already done. Returns the step's serial.")
    .def("end_step_array",
         [](slot_rows_handle& h, nb::ndarray<nb::ro, nb::ndim<1>, nb::device::cpu> slots, std::uintptr_t stream,
            bool graph_replayed, std::int64_t padded_rows, bool check) {
           const host_slots s = slots_of(slots);
           return end_step(h, reinterpret_cast<std::uintptr_t>(s.data), static_cast<std::int32_t>(s.dtype),
                           static_cast<std::int64_t>(s.count), stream, graph_replayed, padded_rows, check);
         },
         "slots"_a, "stream"_a, "graph_replayed"_a, "padded_rows"_a, "check"_a,
         "end_step with the slots as a host array (host backend).")
    .def("poll", [](slot_rows_handle& h) { return h.impl->poll(); },
         "Retires the steps already done; returns the newest retired serial.")
    .def("wait",
         [](slot_rows_handle& h, std::uint64_t serial) {
           nb::gil_scoped_release unlocked;
           h.impl->wait(serial);
         },
         "serial"_a, "Waits for the steps up to `serial`.")
    .def("throw_failure", [](slot_rows_handle& h, std::uint64_t serial) { h.impl->throw_failure(serial); }, "serial"_a,
         "Raises, once, the first failure of the retired steps up to `serial`.")
    .def("finalize",
         [](slot_rows_handle& h, std::uint64_t serial) {
           retire_through(h, serial);
           h.impl->throw_failure(serial);
         },
         "serial"_a, "wait(serial), then throw_failure(serial).")
    .def("read_into",
         [](const slot_rows_handle& h, nb::ndarray<nb::ro, nb::ndim<1>, nb::device::cpu> slots,
            nb::ndarray<std::int32_t, nb::ndim<3>, nb::c_contig, nb::device::cpu> out, std::int64_t first_position,
            std::string request, std::int64_t uncaptured, std::uint64_t wait_through) {
           const host_slots s = slots_of(slots);
           const auto& c      = h.impl->config();
           if (out.shape(0) != s.count || out.shape(1) != static_cast<std::size_t>(c.num_model_layers) ||
               out.shape(2) != static_cast<std::size_t>(c.top_k)) {
             throw nb::value_error("read_into: the output must be int32 [len(slots), num_model_layers, top_k]");
           }
           const slot_read_options o = read_options(first_position, std::move(request), uncaptured);
           std::int32_t* data        = out.data();
           nb::gil_scoped_release unlocked;
           h.impl->wait(wait_through);
           h.impl->read_int32(s.data, s.dtype, s.count, data, o);
         },
         "slots"_a, "out"_a, "first_position"_a, "request"_a, "uncaptured"_a, "wait_through"_a,
         "Waits for the steps up to `wait_through`, then writes the rows at host `slots` into `out`, int32 "
         "[len(slots), num_model_layers, top_k].")
    .def("read_base64",
         [](const slot_rows_handle& h, nb::ndarray<nb::ro, nb::ndim<1>, nb::device::cpu> slots,
            std::int64_t first_position, std::string request, std::int64_t uncaptured, std::uint64_t wait_through) {
           const host_slots s        = slots_of(slots);
           const std::size_t chars   = h.impl->base64_chars_int32(static_cast<std::int64_t>(s.count));
           const slot_read_options o = read_options(first_position, std::move(request), uncaptured);
           // the str itself is the output: ASCII, written in place
           nb::object text = nb::steal(PyUnicode_New(static_cast<Py_ssize_t>(chars), 127));
           if (!text.is_valid()) { throw nb::python_error(); }
           char* into = reinterpret_cast<char*>(PyUnicode_1BYTE_DATA(text.ptr()));  // NOLINT: CPython's layout
           {
             nb::gil_scoped_release unlocked;
             h.impl->wait(wait_through);
             h.impl->read_base64_int32(s.data, s.dtype, s.count, into, o);
           }
           return text;
         },
         "slots"_a, "first_position"_a, "request"_a, "uncaptured"_a, "wait_through"_a,
         "As read_into, as base64 of the int32 bytes, in a str written in place.");

  m.def("create_slot_rows",
        [](const std::string& index, const slot_rows_config& config) {
          return create_slot_rows(host_slot_rows(), index, config, backend_kind::host, 0);
        },
        "index"_a, "config"_a, "Creates a host-backend SlotRows (internal).");
}

}  // namespace routing_replay::python
