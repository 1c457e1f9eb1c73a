/// @file
/// VllmStreams' step calls: prepare_output (the input batch read by attribute, the end-of-step
/// kernel enqueued), enqueue_cpu_copy (the copy into a chunk of host memory, on the current stream)
/// and process_output (wait for the copy, refuse a step whose routing the device found wrong, then
/// row_streams' commit, whose outputs become a dict of AuxRequestOutput made natively).
#include "stream_connector.hpp"
#include "stream_outputs.hpp"

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstring>
#include <string>

namespace nb = nanobind;

namespace routing_replay::python {
namespace {

/// The outputs of one step as a dict {request id: AuxRequestOutput}, in row_streams' order.
struct dict_sink {
  PyObject* dict;
  PyObject* ids;  // a list, by batch index
  row_chunk* chunk;
  chunk_pool* pool;  // rows that did not come in the step (prefix hits) get a slice of their own
  std::int64_t layers, top_k;
  std::int32_t id_bytes;
  PyObject* holder = nullptr;  // the chunk's holder, made with the first view

  dict_sink(PyObject* d, PyObject* i, row_chunk* c, chunk_pool* p, std::int64_t l, std::int64_t k, std::int32_t b) noexcept
    : dict(d), ids(i), chunk(c), pool(p), layers(l), top_k(k), id_bytes(b)
  {
  }
  dict_sink(const dict_sink&)            = delete;
  dict_sink& operator=(const dict_sink&) = delete;
  ~dict_sink() { Py_XDECREF(holder); }

  void view(std::size_t i, std::int64_t token_start, const std::byte* rows, std::int64_t count)
  {
    PyObject* array = nullptr;
    if (count == 0 || chunk == nullptr) {
      void* unused = nullptr;
      array        = make_rows_array(0, layers, top_k, id_bytes, &unused);
    } else {
      if (holder == nullptr && (holder = make_chunk_holder(chunk)) == nullptr) { throw nb::python_error(); }
      array = make_rows_view(holder, rows, count, layers, top_k, id_bytes);
    }
    add(i, token_start, array);
  }

  std::byte* materialize(std::size_t i, std::int64_t token_start, std::int64_t count)
  {
    if (count == 0) {
      void* data = nullptr;
      add(i, token_start, make_rows_array(0, layers, top_k, id_bytes, &data));
      return static_cast<std::byte*>(data);
    }
    // a slice of the output pool, as the step's own rows: a consumer may keep these too (an array
    // of its own, writeable as numpy's would be)
    row_chunk* c = pool->take(static_cast<std::size_t>(count * layers * top_k * id_bytes));
    PyObject* h  = make_chunk_holder(c);  // holds it once more
    c->release_rows();
    if (h == nullptr) { throw nb::python_error(); }
    PyObject* array = make_rows_view(h, c->data(), count, layers, top_k, id_bytes, true);
    Py_DECREF(h);
    add(i, token_start, array);
    return c->data();
  }

  void add(std::size_t i, std::int64_t token_start, PyObject* array)
  {
    if (array == nullptr) { throw nb::python_error(); }
    PyObject* output = make_aux_output(token_start, array);  // steals the array
    if (output == nullptr) { throw nb::python_error(); }
    const int status = PyDict_SetItem(dict, PyList_GET_ITEM(ids, static_cast<Py_ssize_t>(i)), output);
    Py_DECREF(output);
    if (status != 0) { throw nb::python_error(); }
  }
};

/// A dict that takes `n` items without growing (a step's outputs: about one per request; grown from
/// empty, a dict of a thousand items is rehashed eight times).
PyObject* new_dict_for(std::size_t n)
{
#if PY_VERSION_HEX < 0x030D0000
  return _PyDict_NewPresized(static_cast<Py_ssize_t>(n));
#else
  static_cast<void>(n);  // no public way to presize
  return PyDict_New();
#endif
}

/// `n` integers of `bytes` bytes each, `byte_stride` apart from `base`, widened into `out`; false for
/// a width other than 1, 2, 4 or 8 bytes.
bool widen_ints(const char* base, std::ptrdiff_t byte_stride, std::size_t n, std::size_t bytes, bool is_signed,
                std::vector<std::int64_t>& out)
{
  auto copy = [&](auto tag) {
    using T = decltype(tag);
    out.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      T v;
      std::memcpy(&v, base + static_cast<std::ptrdiff_t>(i) * byte_stride, sizeof v);
      out[i] = static_cast<std::int64_t>(v);
    }
  };
  switch (bytes) {
    case 1: is_signed ? copy(std::int8_t{}) : copy(std::uint8_t{}); return true;
    case 2: is_signed ? copy(std::int16_t{}) : copy(std::uint16_t{}); return true;
    case 4: is_signed ? copy(std::int32_t{}) : copy(std::uint32_t{}); return true;
    case 8: is_signed ? copy(std::int64_t{}) : copy(std::uint64_t{}); return true;
    default: return false;
  }
}

/// A 1-D column of native integers: a numpy array read in place, else through the buffer protocol
/// (bytes, array.array); one call either way, where a nanobind ndarray cast builds a DLPack tensor
/// first. False where the object offers neither (the caller then goes the general way, which names
/// what is wrong).
bool read_native_int_buffer(nb::handle column, std::vector<std::int64_t>& out, std::size_t limit)
{
  if (int_column items; numpy_int_column(column.ptr(), items)) {
    return widen_ints(items.data, items.byte_stride, std::min(items.count, limit), items.item_bytes, items.is_signed, out);
  }
  if (PyObject_CheckBuffer(column.ptr()) == 0) { return false; }
  Py_buffer view;
  if (PyObject_GetBuffer(column.ptr(), &view, PyBUF_RECORDS_RO) != 0) {
    PyErr_Clear();
    return false;
  }
  const char* format = view.format != nullptr ? view.format : "B";
  if (*format == '@' || *format == '=' || (*format == '<' && std::endian::native == std::endian::little)) { ++format; }
  const char code = format[0];
  const bool one  = code != '\0' && format[1] == '\0' && view.ndim == 1;
  bool is_signed = false;
  switch (one ? code : '\0') {
    case 'b': case 'h': case 'i': case 'l': case 'q': case 'n': is_signed = true; break;
    case 'B': case 'H': case 'I': case 'L': case 'Q': case 'N': break;
    default: PyBuffer_Release(&view); return false;
  }
  const auto n   = std::min<std::size_t>(static_cast<std::size_t>(view.shape[0]), limit);
  const bool read = widen_ints(static_cast<const char*>(view.buf), view.strides[0], n,
                               static_cast<std::size_t>(view.itemsize), is_signed, out);
  PyBuffer_Release(&view);
  return read;
}

}  // namespace

void read_int64_column(nb::handle column, std::vector<std::int64_t>& out, const char* what, std::size_t limit)
{
  if (read_native_int_buffer(column, out, limit)) { return; }
  nb::ndarray<nb::ro, nb::ndim<1>, nb::device::cpu> array;
  if (nb::try_cast(column, array)) {
    const auto& t = array.dtype();
    if ((t.code != static_cast<std::uint8_t>(nb::dlpack::dtype_code::Int) &&
         t.code != static_cast<std::uint8_t>(nb::dlpack::dtype_code::UInt)) ||
        t.lanes != 1) {
      throw nb::type_error((std::string{what} + ": expected a 1-D integer array").c_str());
    }
    const std::size_t n     = std::min<std::size_t>(array.shape(0), limit);
    const std::size_t bytes = t.bits / 8;
    const bool is_signed    = t.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Int);
    if (t.bits % 8 != 0 || !widen_ints(static_cast<const char*>(array.data()),
                                       static_cast<std::ptrdiff_t>(array.stride(0)) * static_cast<std::ptrdiff_t>(bytes),
                                       n, bytes, is_signed, out)) {
      throw nb::type_error((std::string{what} + ": expected a 1-D integer array").c_str());
    }
    return;
  }
  out.clear();
  for (nb::handle v : column) {
    if (out.size() == limit) { break; }
    out.push_back(nb::cast<std::int64_t>(v));
  }
}

nb::object vllm_streams::prepare_output(nb::handle self, nb::handle input_batch)
{
  if (!has_metadata_) { return nb::none(); }
  auto field = [&](const char* name) {
    nb::object value = nb::steal(PyObject_GetAttr(input_batch.ptr(), interned_name(name)));
    if (!value.is_valid()) { throw nb::python_error(); }
    return value;
  };
  nb::object ids = nb::steal(PySequence_List(field("req_ids").ptr()));  // the batch changes later
  if (!ids.is_valid()) { throw nb::python_error(); }
  const auto n = static_cast<std::size_t>(PyList_GET_SIZE(ids.ptr()));
  read_int64_column(field("query_start_loc_np"), query_start_loc_, "query_start_loc_np", n + 1);
  read_int64_column(field("num_computed_tokens_np"), starts_, "num_computed_tokens_np", n + 1);
  if (query_start_loc_.size() < n + 1) {
    throw nb::value_error(("query_start_loc_np has " + std::to_string(query_start_loc_.size()) + " entries for " +
                           std::to_string(n) + " requests (needs n + 1)").c_str());
  }
  if (starts_.size() != n) {
    throw nb::value_error(("num_computed_tokens_np has " + std::to_string(starts_.size()) + " entries for " +
                           std::to_string(n) + " requests").c_str());
  }
  handles_.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    PyObject* id = PyList_GET_ITEM(ids.ptr(), static_cast<Py_ssize_t>(i));
    handles_[i]  = lookup_at(batch_ids_, i, id);
    if (handles_[i] == row_streams::new_request) {
      throw nb::value_error(("request " + id_text(id) + " is in the batch, but no step's metadata scheduled it").c_str());
    }
  }
  const int step = streams_->prepare(handles_, starts_.data(), query_start_loc_.data());
  std::int32_t slot = -1;
  row_chunk* chunk  = nullptr;  // where the rows land: taken now, so a host-backend harvest writes it directly
  try {
    const std::size_t bytes = static_cast<std::size_t>(query_start_loc_[n]) * static_cast<std::size_t>(row_elems_) *
                              static_cast<std::size_t>(out_bytes_);
    if (bytes > 0) { chunk = chunks_->take(bytes); }
    slot = device_->harvest(query_start_loc_[n], chunk != nullptr ? chunk->data() : nullptr, stream());
  } catch (...) {
    if (chunk != nullptr) { chunk->release_rows(); }
    streams_->retire(step);
    forget_torn_down();
    throw;
  }
  step_starts_[static_cast<std::size_t>(step)].assign(starts_.begin(), starts_.end());
  step_offsets_[static_cast<std::size_t>(step)].assign(query_start_loc_.begin(), query_start_loc_.end());
  nb::object obj  = nb::inst_alloc(nb::type<pending_output>());
  auto* p         = new (nb::inst_ptr<pending_output>(obj)) pending_output();
  nb::inst_mark_ready(obj);
  p->connector    = nb::borrow(self);
  p->step         = step;
  p->slot         = slot;
  p->rows         = query_start_loc_[n];
  p->chunk        = chunk;
  p->request_ids  = std::move(ids);
  return obj;
}

void vllm_streams::enqueue_cpu_copy(pending_output& p, nb::handle num_sampled, nb::handle num_rejected)
{
  if (p.processed) { throw nb::value_error("enqueue_cpu_copy after process_output"); }
  p.num_sampled  = nb::borrow(num_sampled);
  p.num_rejected = nb::borrow(num_rejected);
  if (!device_->wrote_host(p.slot)) {  // a small step's kernel wrote the rows already: no call on the stream
    device_->copy_to_host(p.slot, p.chunk != nullptr ? p.chunk->data() : nullptr, stream());
  }
  p.copied = true;
}

void vllm_streams::release_chunk(pending_output& p) noexcept
{
  if (p.chunk != nullptr) {
    p.chunk->release_rows();
    p.chunk = nullptr;
  }
}

nb::object vllm_streams::process_output(pending_output& p)
{
  if (p.processed) { throw nb::value_error("process_output was already called for this step"); }
  p.processed = true;
  auto retire = [&] {
    streams_->retire(p.step);
    forget_torn_down();
    release_chunk(p);
  };
  if (!p.copied) {
    retire();
    throw error{errc::invalid_state, "auxiliary output CPU copy was not enqueued (enqueue_cpu_copy before process_output)"};
  }
  try {
    if (device_->ready(p.slot)) {  // the engine waited for its copy already: no GIL hand-over
      device_->wait(p.slot);
    } else {
      nb::gil_scoped_release unlocked;
      device_->wait(p.slot);
    }
  } catch (...) {
    retire();
    throw;
  }
  const detail::step_status status = device_->status(p.slot);
  if (!status.clean()) {
    retire();
    raise_step_problem(p, status);
  }
  const auto n = static_cast<std::size_t>(PyList_GET_SIZE(p.request_ids.ptr()));
  try {
    read_int64_column(p.num_sampled, sampled_, "num_sampled", n + 1);
    read_int64_column(p.num_rejected, rejected_, "num_rejected", n + 1);
    if (sampled_.size() != n || rejected_.size() != n) {
      throw nb::value_error(("num_sampled and num_rejected need one entry per request: " + std::to_string(sampled_.size()) +
                             " and " + std::to_string(rejected_.size()) + " for " + std::to_string(n)).c_str());
    }
  } catch (...) {
    retire();
    throw;
  }
  nb::object outputs = nb::steal(new_dict_for(n));
  if (!outputs.is_valid()) {
    retire();
    throw nb::python_error();
  }
  try {
    dict_sink sink{outputs.ptr(),        p.request_ids.ptr(),     p.chunk,   chunks_.get(),
                   device_handle_->num_layers, device_handle_->top_k, out_bytes_};
    streams_->commit(p.step, p.chunk != nullptr ? p.chunk->data() : nullptr, sampled_.data(), rejected_.data(), p.chunk, sink);
  } catch (...) {  // commit retired the step
    forget_torn_down();
    release_chunk(p);
    throw;
  }
  forget_torn_down();
  release_chunk(p);  // views hold it on their own
  return outputs;
}

void vllm_streams::raise_step_problem(const pending_output& p, const detail::step_status& status) const
{
  const detail::problem_report* r = nullptr;
  std::string what;
  errc code = errc::invalid_expert_id;
  if (status.invalid_id.count > 0) {
    r    = &status.invalid_id;
    what = "expert id " + std::to_string(r->value) + " outside [0, " + std::to_string(device_handle_->num_experts) + ")";
  } else if (status.out_of_range.count > 0) {
    r    = &status.out_of_range;
    what = "expert id " + std::to_string(r->value) + " outside [0, " + std::to_string(device_handle_->num_experts) + ")";
  } else {
    r    = &status.unwritten;
    what = "no routing (the layer's capture did not cover this row)";
    code = errc::missing_routing;
  }
  const auto& offsets = step_offsets_[static_cast<std::size_t>(p.step)];
  const auto& starts  = step_starts_[static_cast<std::size_t>(p.step)];
  std::string where   = "a padding row";
  if (r->row < p.rows) {
    const auto at = static_cast<std::size_t>(std::upper_bound(offsets.begin(), offsets.end(), r->row) - offsets.begin()) - 1;
    where         = "request " + id_text(PyList_GET_ITEM(p.request_ids.ptr(), static_cast<Py_ssize_t>(at))) + ", position " +
            std::to_string(starts[at] + r->row - offsets[at]);
  }
  throw error{code, "step output refused: layer " + std::to_string(r->layer) + ", row " + std::to_string(r->row) + " (" +
                      where + "), column " + std::to_string(r->column) + ": " + what + "; " + std::to_string(r->count) +
                      " such id(s) in the step"};
}

pending_output::~pending_output()
{
  if (chunk != nullptr) { chunk->release_rows(); }
}

}  // namespace routing_replay::python
