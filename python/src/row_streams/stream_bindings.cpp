/// @file
/// routing_replay.vllm's native classes in _core: _StreamDevice (the capturer's device side),
/// VllmStreams (the worker connector's data plane), PendingAuxOutput, AuxRequestOutput and
/// BlockObjectStoreError, with the translation of the row streams' exceptions.
#include "stream_bindings.hpp"

#include "stream_connector.hpp"
#include "stream_outputs.hpp"

#include <routing_replay/row_streams.hpp>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <string>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace routing_replay::python {
namespace {

PyObject* block_store_error_type = nullptr;  // routing_replay._core.BlockObjectStoreError

void translate_stream_errors(const std::exception_ptr& p, void*)
{
  try {
    std::rethrow_exception(p);
  } catch (const stream_input_error& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const block_store_error& e) {
    PyErr_SetString(block_store_error_type, e.what());
  }
}

void check_layer(const stream_device_handle& d, std::int32_t layer)
{
  if (layer < 0 || layer >= d.num_layers) {
    throw nb::index_error(("routed-experts layer " + std::to_string(layer) + " exceeds capture buffer layer count " +
                           std::to_string(d.num_layers))
                            .c_str());
  }
}

void capture_at(stream_device_handle& d, std::int32_t layer, std::uintptr_t ids, std::int32_t dtype, std::int64_t rows,
                std::int64_t row_stride, std::int64_t destination_row, std::uintptr_t stream)
{
  check_layer(d, layer);
  d.impl->capture(layer, reinterpret_cast<const void*>(ids), static_cast<dtype_code>(dtype), rows, row_stride,  // NOLINT
                  destination_row, stream);
}

/// The host backend's capture of a numpy array, read natively; false for anything else.
bool capture_array(stream_device_handle& d, std::int32_t layer, nb::handle array, std::int64_t destination_row)
{
  nb::ndarray<nb::ro, nb::ndim<2>, nb::device::cpu> ids;
  if (!d.impl->on_host() || !nb::try_cast(array, ids) || ids.dtype().code != static_cast<std::uint8_t>(nb::dlpack::dtype_code::Int) ||
      ids.stride(1) != 1 || ids.shape(1) < static_cast<std::size_t>(d.top_k)) {
    return false;
  }
  dtype_code code{};
  switch (ids.dtype().bits) {
    case 64: code = dtype_code::i64; break;
    case 32: code = dtype_code::i32; break;
    case 16: code = dtype_code::i16; break;
    default: return false;
  }
  check_layer(d, layer);
  const auto rows = static_cast<std::int64_t>(ids.shape(0));
  d.impl->capture(layer, ids.data(), code, rows, rows > 1 ? ids.stride(0) : static_cast<std::int64_t>(ids.shape(1)),
                  destination_row, 0);
  return true;
}

}  // namespace

vllm_streams::vllm_streams(nb::object device, std::int32_t block_size, std::int32_t max_num_seqs,
                           std::int32_t max_num_batched_tokens, std::int32_t max_concurrent_batches, std::size_t max_bytes,
                           nb::object current_stream, std::int64_t kept_budget_bytes)
  : device_object_(std::move(device)),
    device_handle_(&nb::cast<stream_device_handle&>(device_object_)),
    device_(device_handle_->impl.get()),
    row_elems_(device_handle_->num_layers * device_handle_->top_k),
    out_bytes_(device_->out_bytes()),
    current_stream_(std::move(current_stream)),
    chunks_(std::make_shared<chunk_pool>(
      function_kept_memory{device_->pinned_allocator(), device_->pinned_deallocator(), device_->helper_thread_entry()},
      output_pool_config(max_num_batched_tokens, row_elems_, out_bytes_, max_concurrent_batches, kept_budget_bytes,
                         device_->on_host())))
{
  if (max_num_batched_tokens > device_handle_->max_rows) {
    throw nb::value_error("max_num_batched_tokens exceeds the capture buffer's rows");
  }
  row_streams_config c;
  c.num_layers             = device_handle_->num_layers;
  c.top_k                  = device_handle_->top_k;
  c.element_bytes          = out_bytes_;
  c.block_size             = block_size;
  c.max_num_seqs           = max_num_seqs;
  c.max_num_batched_tokens = max_num_batched_tokens;
  c.max_concurrent_batches = max_concurrent_batches;
  c.max_bytes              = max_bytes;
  streams_ = std::make_unique<row_streams>(c, [this](row_streams::handle h) { return describe(h); });
  step_starts_.resize(static_cast<std::size_t>(max_concurrent_batches));
  step_offsets_.resize(static_cast<std::size_t>(max_concurrent_batches));
  // the budget faulted in before the first step (start-up, not a step)
  nb::gil_scoped_release unlocked;
  chunks_->memory().wait_until_filled();
}

kept_pool_config output_pool_config(std::int32_t max_num_batched_tokens, std::int32_t row_elems, std::int32_t out_bytes,
                                    std::int32_t max_concurrent_batches, std::int64_t budget_bytes, bool give_back)
{
  const std::size_t step = static_cast<std::size_t>(std::max(max_num_batched_tokens, 1)) *
                           static_cast<std::size_t>(row_elems) * static_cast<std::size_t>(out_bytes);
  constexpr std::size_t granule = std::size_t{2} << 20;
  kept_pool_config c;
  // two full steps an extent, in 2 MiB units: a full step's slice never leaves most of one unused
  c.extent_bytes = (2 * step + granule - 1) / granule * granule;
  // two extents kept ahead (the default), and by default a budget of the steps in flight at once
  // and as many again, rounded up to extents
  const std::size_t in_flight = static_cast<std::size_t>(std::max(max_concurrent_batches, 1)) + 2;
  c.budget_bytes = budget_bytes >= 0 ? static_cast<std::size_t>(budget_bytes)
                                     : (in_flight * step + c.extent_bytes - 1) / c.extent_bytes * c.extent_bytes;
  c.give_back = give_back;
  return c;
}

vllm_streams::~vllm_streams()
{
  {
    nb::gil_scoped_release unlocked;  // filing may be releasing chunks
    streams_.reset();
  }
  for (PyObject*& id : names_) { Py_CLEAR(id); }
}

std::uintptr_t vllm_streams::stream()
{
  if (current_stream_.is_none()) { return 0; }
  if (!raw_stream_live_ && raw_stream_ready_.is_valid() && nb::cast<bool>(raw_stream_ready_())) { raw_stream_live_ = true; }
  if (raw_stream_live_) {  // one vectorcall of a builtin, where the Python reader would run a frame
    nb::object handle = nb::steal(PyObject_CallOneArg(raw_stream_.ptr(), raw_stream_arg_.ptr()));
    if (!handle.is_valid()) { throw nb::python_error(); }
    return nb::cast<std::uintptr_t>(handle);
  }
  return nb::cast<std::uintptr_t>(current_stream_());
}

void vllm_streams::use_raw_stream_reader(nb::object read, nb::object argument, nb::object ready)
{
  raw_stream_       = std::move(read);
  raw_stream_arg_   = std::move(argument);
  raw_stream_ready_ = std::move(ready);
  raw_stream_live_  = false;
}

void vllm_streams::close()
{
  nb::gil_scoped_release unlocked;
  streams_->close();
}

void register_vllm_streams(nb::module_& m)
{
  if (!init_stream_outputs(m.ptr())) { throw nb::python_error(); }
  block_store_error_type = PyErr_NewExceptionWithDoc(
    "routing_replay._core.BlockObjectStoreError",
    "Rows a request needs are not in the block tier (evicted, or never stored), or an update of the tier failed "
    "earlier (vLLM's BlockObjectStoreError). The message names the request, the rows and the block.",
    PyExc_RuntimeError, nullptr);
  m.attr("BlockObjectStoreError") = nb::borrow(block_store_error_type);
  nb::register_exception_translator(translate_stream_errors);

  nb::class_<stream_device_handle>(m, "_StreamDevice", "The device side of routing_replay.vllm (internal).")
    .def("capture", [](stream_device_handle& d, std::int32_t layer, std::uintptr_t ids, std::int32_t dtype, std::int64_t rows,
                       std::int64_t stride, std::uintptr_t stream) { capture_at(d, layer, ids, dtype, rows, stride, 0, stream); },
         "layer"_a, "ids"_a, "dtype"_a, "rows"_a, "row_stride"_a, "stream"_a)
    .def("capture_at", &capture_at, "layer"_a, "ids"_a, "dtype"_a, "rows"_a, "row_stride"_a, "destination_row"_a, "stream"_a)
    .def("capture_array", &capture_array, "layer"_a, "array"_a, "destination_row"_a = 0)
    .def_prop_ro("on_host", [](const stream_device_handle& d) { return d.impl->on_host(); })
    .def_prop_ro("device", [](const stream_device_handle& d) { return d.impl->device(); })
    .def_prop_ro("output_dtype", [](const stream_device_handle& d) { return d.impl->out_bytes() == 1 ? "uint8" : "uint16"; })
    .def_prop_ro("device_bytes", [](const stream_device_handle& d) { return d.impl->device_bytes(); })
    .def_prop_ro("num_layers", [](const stream_device_handle& d) { return d.num_layers; })
    .def_prop_ro("top_k", [](const stream_device_handle& d) { return d.top_k; })
    .def_prop_ro("num_experts", [](const stream_device_handle& d) { return d.num_experts; })
    .def_prop_ro("max_rows", [](const stream_device_handle& d) { return d.max_rows; })
    .def_prop_ro("captured_layers", [](const stream_device_handle& d) {
      std::vector<std::int32_t> layers;
      const auto mask = d.impl->captured();
      for (std::int32_t l = 0; l < d.num_layers; ++l) {
        if (mask.has(l)) { layers.push_back(l); }
      }
      return layers;
    });

  m.def("create_stream_device",
        [](std::int32_t layers, std::int32_t top_k, std::int32_t experts, std::int32_t max_rows, std::int32_t depth) {
          return stream_device_handle{make_host_stream_device(layers, top_k, experts, max_rows, depth), layers, top_k, experts,
                                      max_rows};
        },
        "num_layers"_a, "top_k"_a, "num_experts"_a, "max_rows"_a, "ring_depth"_a,
        "A host-backend device side for routing_replay.vllm (internal).");

  nb::class_<pending_output>(m, "PendingAuxOutput",
                             "One step between prepare_output and process_output: its snapshot on the device, then its "
                             "copy in host memory.")
    .def("enqueue_cpu_copy",
         [](pending_output& p, nb::handle sampled, nb::handle rejected) {
           nb::cast<vllm_streams&>(p.connector).enqueue_cpu_copy(p, sampled, rejected);
         },
         "num_sampled"_a, "num_rejected"_a,
         "Enqueues the copy of the step's rows to host memory on the current stream (vLLM: the output copy stream). "
         "num_sampled and num_rejected (one entry per request) are read in process_output.")
    .def("process_output", [](pending_output& p) { return nb::cast<vllm_streams&>(p.connector).process_output(p); },
         "Waits for the copy, then files the step and returns {request id: AuxRequestOutput}.")
    .def_prop_ro("request_ids", [](const pending_output& p) { return p.request_ids; })
    .def_prop_ro("num_rows", [](const pending_output& p) { return p.rows; });

  nb::class_<vllm_streams>(m, "VllmStreams", "The routed-experts data plane of one output rank (internal: use "
                                             "routing_replay.vllm.AuxOutputWorkerConnector).")
    .def(nb::init<nb::object, std::int32_t, std::int32_t, std::int32_t, std::int32_t, std::size_t, nb::object, std::int64_t>(),
         "device"_a,
         "block_size"_a, "max_num_seqs"_a, "max_num_batched_tokens"_a, "max_concurrent_batches"_a, "max_bytes"_a,
         "current_stream"_a.none(), "kept_budget_bytes"_a = -1)
    .def("use_raw_stream_reader", &vllm_streams::use_raw_stream_reader, "read"_a, "argument"_a, "ready"_a,
         "Reads the current stream as read(argument) once ready() is true (torch's raw-stream reader), "
         "instead of the current_stream callable.")
    .def("begin_step", &vllm_streams::begin_step, "metadata"_a.none())
    .def("prepare_output", [](nb::handle self, nb::handle batch) { return nb::cast<vllm_streams&>(self).prepare_output(self, batch); },
         "input_batch"_a)
    .def("process_output", [](vllm_streams& s, pending_output& p) { return s.process_output(p); }, "pending"_a)
    .def("close", &vllm_streams::close)
    .def("drain", [](vllm_streams& s) {
      nb::gil_scoped_release unlocked;
      s.streams().drain();
    })
    .def_prop_ro("generation", [](vllm_streams& s) { return s.streams().generation(); })
    .def_prop_ro("num_requests", [](vllm_streams& s) { return s.streams().num_requests(); })
    .def_prop_ro("known_ids", &vllm_streams::known_ids)
    .def_prop_ro("steps_in_flight", [](vllm_streams& s) { return s.streams().steps_in_flight(); })
    .def_prop_ro("pool_slots", [](vllm_streams& s) { return s.streams().pool_slots(); })
    .def_prop_ro("free_pool_slots", [](vllm_streams& s) { return s.streams().free_pool_slots(); })
    .def_prop_ro("host_chunks", &vllm_streams::host_chunks)
    .def_prop_ro("kept_pool", [](vllm_streams& s) { return kept_pool_dict(s.output_memory().stats()); },
                 "The pool of output memory: size_bytes, size_high_water_bytes, in_use_bytes, high_water_bytes, "
                 "budget_bytes, ahead_bytes, extent_bytes, slices, extents_made, extents_over_budget, "
                 "extents_in_step (made on the engine's thread: nothing was ready), extents_freed, filling_failed.")
    .def_prop_rw("kept_budget_bytes", [](vllm_streams& s) { return s.output_memory().stats().budget_bytes; },
                 [](vllm_streams& s, std::size_t bytes) { s.output_memory().set_budget(bytes); },
                 "Bytes of output memory the pool faults in ahead and keeps (its filling thread grows it past them "
                 "while consumers keep more).")
    .def_prop_rw("direct_write_bytes", &vllm_streams::direct_write_bytes, &vllm_streams::set_direct_write_bytes,
                 "The largest step, in bytes of rows, whose rows the end-of-step kernel writes straight into pinned "
                 "host memory (no copy on the output stream); 0: none. The host backend writes every step so.")
    .def("tier_stats",
         [](vllm_streams& s) {
           {
             nb::gil_scoped_release unlocked;
             s.streams().drain();
           }
           const block_tier& t = s.streams().tier();
           nb::dict d;
           d["stored_blocks"]    = t.stored_blocks();
           d["limit_blocks"]     = t.limit_blocks();
           d["evictable_blocks"] = t.evictable_blocks();
           d["known_keys"]       = t.known_keys();
           d["arena_bytes"]      = t.arena_bytes();
           d["block_bytes"]      = t.block_bytes();
           d["growths"]          = t.growths();
           return d;
         },
         "The block tier's figures, once filing has caught up.");
}

}  // namespace routing_replay::python
