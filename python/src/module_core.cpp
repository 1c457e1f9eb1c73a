/// @file
/// routing_replay._core: the host backend's instantiations and every Python-facing class (the
/// CUDA module, _core_cuda, creates replays of these same classes). The Python layer
/// (routing_replay/__init__.py) turns arrays and streams into the pointers and handles taken here.
#include "handle.hpp"
#include "instance_registry.hpp"
#include "replay_base.hpp"
#include "slot_rows_bindings.hpp"
#include "stream_bindings.hpp"

#include <routing_replay/errors.hpp>
#include <routing_replay/host_backend.hpp>
#include <routing_replay/npy.hpp>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace routing_replay::python {
namespace {

// ---- errors ----------------------------------------------------------------------------------

PyObject* error_type = nullptr;  // routing_replay._core.Error, a RuntimeError with a `code`

/// A zero-copy extraction is alive where the call would invalidate it: raised as BufferError.
struct view_conflict : std::runtime_error {
  using std::runtime_error::runtime_error;
};

const char* errc_name(errc code) noexcept
{
  switch (code) {
    case errc::invalid_config: return "invalid_config";
    case errc::index_type_too_narrow: return "index_type_too_narrow";
    case errc::unknown_layer: return "unknown_layer";
    case errc::too_many_tokens: return "too_many_tokens";
    case errc::unknown_request: return "unknown_request";
    case errc::duplicate_request: return "duplicate_request";
    case errc::position_out_of_range: return "position_out_of_range";
    case errc::slot_out_of_range: return "slot_out_of_range";
    case errc::invalid_plan: return "invalid_plan";
    case errc::invalid_expert_id: return "invalid_expert_id";
    case errc::missing_routing: return "missing_routing";
    case errc::host_memory_exhausted: return "host_memory_exhausted";
    case errc::invalid_state: return "invalid_state";
    case errc::draft_error: return "draft_error";
    case errc::invalid_argument: return "invalid_argument";
    case errc::backend_error: return "backend_error";
  }
  return "unknown";
}

void translate(const std::exception_ptr& p, void*)
{
  try {
    std::rethrow_exception(p);
  } catch (const view_conflict& e) {
    PyErr_SetString(PyExc_BufferError, e.what());
  } catch (const error& e) {
    PyObject* exc = PyObject_CallFunction(error_type, "s", e.what());
    if (exc == nullptr) { return; }  // the call set its own exception
    PyObject* code = PyUnicode_FromString(errc_name(e.code()));
    if (code == nullptr || PyObject_SetAttrString(exc, "code", code) != 0) {
      Py_XDECREF(code);
      Py_DECREF(exc);
      return;
    }
    Py_DECREF(code);
    PyErr_SetObject(error_type, exc);
    Py_DECREF(exc);
  }
}

// ---- request ids -------------------------------------------------------------------------------

/// An int or str id; a str key points into the Python string, valid while the call runs.
request_key key_of(nb::handle id)
{
  PyObject* o = id.ptr();
  if (PyUnicode_Check(o)) {
    Py_ssize_t size  = 0;
    const char* utf8 = PyUnicode_AsUTF8AndSize(o, &size);
    if (utf8 == nullptr) { throw nb::python_error(); }
    return request_key{std::string_view{utf8, static_cast<std::size_t>(size)}};
  }
  if (!PyBool_Check(o) && PyIndex_Check(o)) {
    nb::object index = nb::steal(PyNumber_Index(o));
    if (!index.is_valid()) { throw nb::python_error(); }
    int overflow        = 0;
    const long long v   = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
    if (overflow != 0) { throw nb::value_error("request id does not fit in 64 bits"); }
    if (v == -1 && PyErr_Occurred() != nullptr) { throw nb::python_error(); }
    return request_key{static_cast<std::int64_t>(v)};
  }
  throw nb::type_error("request ids are int or str");
}

dtype_code dtype_from_dlpack(nb::dlpack::dtype t);
void check_plan_views(const replay_handle& h, const step_plan& plan);

/// Reads a 1-D integer column (a numpy array of any integer dtype, or a sequence) into `out` as
/// int64, keeping out's capacity: one pass, no Python object per element for arrays.
void read_column(nb::handle column, std::vector<std::int64_t>& out, const char* what)
{
  nb::ndarray<nb::ro, nb::ndim<1>, nb::device::cpu> array;
  if (!nb::try_cast(column, array)) {
    try {
      out = nb::cast<std::vector<std::int64_t>>(column);
    } catch (const nb::cast_error&) {
      throw nb::type_error((std::string{what} + ": expected a 1-D integer array or sequence").c_str());
    }
    return;
  }
  const auto& t = array.dtype();
  if ((t.code != static_cast<std::uint8_t>(nb::dlpack::dtype_code::Int) &&
       t.code != static_cast<std::uint8_t>(nb::dlpack::dtype_code::UInt)) ||
      t.lanes != 1) {
    throw nb::type_error((std::string{what} + ": expected a 1-D integer array or sequence").c_str());
  }
  const dtype_code d = dtype_from_dlpack(t);
  out.resize(array.shape(0));
  // uint64 handles keep their bits through the int64 cast, and are cast back by from_bits()
  visit_dtype(d, [&](auto tag) {
    using T         = decltype(tag);
    const auto* in  = static_cast<const T*>(array.data());
    const auto step = array.stride(0);
    for (std::size_t i = 0; i < out.size(); ++i) { out[i] = static_cast<std::int64_t>(in[static_cast<std::int64_t>(i) * step]); }
  });
}

/// A 1-D integer array or a sequence (list, tuple) as int64, copied; None is empty.
std::vector<std::int64_t> int64_list(nb::handle seq)
{
  std::vector<std::int64_t> out;
  if (!seq.is_none()) { read_column(seq, out, "integers"); }
  return out;
}

// ---- plans --------------------------------------------------------------------------------------

void plan_schedule(plan_holder& p, nb::handle id, std::int64_t first_position, std::int32_t num_tokens,
                   std::int32_t num_draft_tokens, nb::handle slots)
{
  scheduled_request r{key_of(id), first_position, num_tokens, num_draft_tokens, {}};
  if (!r.id.is_integer()) {
    p.ids.emplace_back(r.id.string());
    r.id = request_key{std::string_view{p.ids.back()}};
  }
  if (!slots.is_none()) {
    p.slots.push_back(int64_list(slots));
    r.slots = p.slots.back();
  }
  p.plan.schedule(r);
}

/// The first position of request `id`'s `count` rows starting at `row` of a step's `positions`,
/// which must be there and consecutive (chunked prefill, decode, drafts).
/// @throws error invalid_plan naming the request, the row and the positions
std::int64_t run_first_position(nb::handle id, const std::int64_t* positions, std::size_t num_positions,
                                std::size_t row, std::int64_t count)
{
  if (count < 0 || count > std::numeric_limits<std::int32_t>::max() ||
      row + static_cast<std::size_t>(count) > num_positions) {
    throw error{errc::invalid_plan, "request " + key_of(id).to_string() + ": " + std::to_string(count) +
                                      " tokens at row " + std::to_string(row) + ", but the step has " +
                                      std::to_string(num_positions) + " positions"};
  }
  const std::int64_t first = positions[row];
  for (std::int64_t t = 1; t < count; ++t) {
    const std::size_t at = row + static_cast<std::size_t>(t);
    if (positions[at] != first + t) {
      throw error{errc::invalid_plan, "request " + key_of(id).to_string() +
                                        ": positions of one step must be consecutive, got " +
                                        std::to_string(positions[at - 1]) + " then " + std::to_string(positions[at]) +
                                        " at row " + std::to_string(at)};
    }
  }
  return first;
}

/// Schedules request i for counts[i] rows at the positions the engine gives, in batch order: each
/// request's positions must be consecutive within the step (chunked prefill, decode, drafts).
void plan_from_positions(plan_holder& p, nb::handle ids, nb::handle counts, nb::handle positions)
{
  const std::vector<std::int64_t> n   = int64_list(counts);
  const std::vector<std::int64_t> pos = int64_list(positions);
  const auto num_ids                  = static_cast<std::size_t>(nb::len(ids));
  if (num_ids != n.size()) {
    throw error{errc::invalid_plan, std::to_string(num_ids) + " request ids for " + std::to_string(n.size()) +
                                      " token counts"};
  }
  std::size_t row = 0;
  std::size_t i   = 0;
  for (nb::handle id : ids) {
    const std::int64_t count = n[i++];
    if (count == 0) { continue; }
    const std::int64_t first = run_first_position(id, pos.data(), pos.size(), row, count);
    plan_schedule(p, id, first, static_cast<std::int32_t>(count), 0, nb::none());
    row += static_cast<std::size_t>(count);
  }
}

/// Appends requests by handle, columnar: handles[i] (as add_request returned them) with
/// num_tokens[i] tokens from first_positions[i], and num_draft_tokens[i] trailing drafts. One native
/// pass over the arrays: no Python object and no id hashing per request.
/// A 1-D integer column as schedule_handles() reads it: in place when the array is contiguous and
/// holds 64-bit integers, or 32-bit signed ones where `int32_too` (what engines keep: 64-bit handles
/// and positions, 32- or 64-bit counts); otherwise converted into `scratch` as int64 (read_column).
struct int_column {
  const void* data   = nullptr;
  std::size_t size   = 0;
  std::size_t bytes  = sizeof(std::int64_t);  ///< width of an element: 8, or 4 (int32)
};

int_column column_in_place(nb::handle column, std::vector<std::int64_t>& scratch, const char* what, bool int32_too)
{
  nb::ndarray<nb::ro, nb::ndim<1>, nb::device::cpu> array;
  if (nb::try_cast(column, array) && (array.shape(0) <= 1 || array.stride(0) == 1)) {
    const auto& t      = array.dtype();
    const bool is_int  = t.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Int);
    const bool is_uint = t.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::UInt);
    if (t.lanes == 1 && (is_int || is_uint) && t.bits == 64) { return {array.data(), array.shape(0), 8}; }
    if (t.lanes == 1 && is_int && t.bits == 32 && int32_too) { return {array.data(), array.shape(0), 4}; }
  }
  read_column(column, scratch, what);
  return {scratch.data(), scratch.size(), sizeof(std::int64_t)};
}

/// The entries of schedule_handles(), from columns of these element types (uint64 handles keep
/// their bits through an int64 array, and are cast back by from_bits()).
template <class Count>
void schedule_columns(step_plan& plan, const std::uint64_t* handles, const std::int64_t* first, const Count* count,
                      const std::int64_t* drafts, std::size_t n)
{
  constexpr std::int64_t int32_max = std::numeric_limits<std::int32_t>::max();
  for (std::size_t i = 0; i < n; ++i) {
    const auto tokens = static_cast<std::int64_t>(count[i]);
    const std::int64_t d = drafts != nullptr ? drafts[i] : 0;
    if (tokens < 0 || tokens > int32_max || d < 0 || d > int32_max) [[unlikely]] {
      throw error{errc::invalid_plan, "schedule_handles: entry " + std::to_string(i) + " has " + std::to_string(tokens) +
                                        " tokens and " + std::to_string(d) + " drafts"};
    }
    plan.schedule(request_handle::from_bits(handles[i]), first[i], static_cast<std::int32_t>(tokens),
                  static_cast<std::int32_t>(d));
  }
}

void plan_schedule_handles(plan_holder& p, nb::handle handles, nb::handle first_positions, nb::handle num_tokens,
                           nb::handle num_draft_tokens)
{
  // Read in place where the engine's arrays allow it: at decode batch 1024, copying the columns
  // first cost as much again as writing the plan's entries.
  auto& [h_scratch, first_scratch, count_scratch, draft_scratch] = p.columns;
  const int_column h     = column_in_place(handles, h_scratch, "schedule_handles: handles", false);
  const int_column first = column_in_place(first_positions, first_scratch, "schedule_handles: first_positions", false);
  const int_column count = column_in_place(num_tokens, count_scratch, "schedule_handles: num_tokens", true);
  const bool with_drafts = !num_draft_tokens.is_none();
  if (with_drafts) { read_column(num_draft_tokens, draft_scratch, "schedule_handles: num_draft_tokens"); }
  if (first.size != h.size || count.size != h.size || (with_drafts && draft_scratch.size() != h.size)) {
    throw error{errc::invalid_plan, "schedule_handles: " + std::to_string(h.size) + " handles, " +
                                      std::to_string(first.size) + " first positions, " + std::to_string(count.size) +
                                      " token counts" +
                                      (with_drafts ? ", " + std::to_string(draft_scratch.size()) + " draft counts" : "")};
  }
  const auto* hs     = static_cast<const std::uint64_t*>(h.data);
  const auto* firsts = static_cast<const std::int64_t*>(first.data);
  const std::int64_t* drafts = with_drafts ? draft_scratch.data() : nullptr;
  if (count.bytes == 4) {
    schedule_columns(p.plan, hs, firsts, static_cast<const std::int32_t*>(count.data), drafts, h.size);
  } else {
    schedule_columns(p.plan, hs, firsts, static_cast<const std::int64_t*>(count.data), drafts, h.size);
  }
}

/// The handle of request id object `id` on the staging path: from the replay's id cache (one dict
/// probe with the hash Python keeps in the str), else the live request's, else a new request's.
request_handle cached_handle(replay_handle& h, PyObject* id)
{
  if (PyBool_Check(id)) { throw nb::type_error("request ids are int or str"); }  // True would find 1
  if (PyObject* bits = PyDict_GetItemWithError(h.id_cache.ptr(), id); bits != nullptr) {
    return request_handle::from_bits(PyLong_AsUnsignedLongLong(bits));
  }
  if (PyErr_Occurred() != nullptr) { throw nb::python_error(); }  // an unhashable id
  const request_key key = key_of(id);
  const request_handle handle = h.impl->contains(key) ? h.impl->handle(key) : h.impl->add_request(key, {});
  h.id_cache[nb::handle{id}] = handle.bits();
  return handle;
}

/// Forgets a released or aborted request's id in the staging path's cache.
void forget_cached_id(replay_handle& h, nb::handle id)
{
  if (PyDict_DelItem(h.id_cache.ptr(), id.ptr()) != 0) { PyErr_Clear(); }  // never cached
}

/// Staging path, one step: the requests of `scheduled` ({id: tokens}, in batch order) at the
/// positions the engine gives (one per token, consecutive within a request), new ids added, in one
/// native pass over the dict; then the staged rows are committed as that step.
void commit_scheduled(replay_handle& h, nb::handle scheduled, nb::handle positions, std::uintptr_t stream)
{
  plan_holder& p = h.staged_plan;
  p.clear();
  try {
    if (!PyDict_Check(scheduled.ptr())) { throw nb::type_error("num_scheduled_tokens must be a dict {request id: tokens}"); }
    nb::ndarray<const std::int64_t, nb::ndim<1>, nb::device::cpu> array;
    std::vector<std::int64_t>& copy = p.columns[0];
    const std::int64_t* pos         = nullptr;
    std::size_t num_positions       = 0;
    if (nb::try_cast(positions, array) && array.stride(0) == 1) {
      pos           = array.data();
      num_positions = array.shape(0);
    } else {
      read_column(positions, copy, "positions");
      pos           = copy.data();
      num_positions = copy.size();
    }
    Py_ssize_t at   = 0;
    PyObject* id    = nullptr;
    PyObject* value = nullptr;
    std::size_t row = 0;
    while (PyDict_Next(scheduled.ptr(), &at, &id, &value)) {
      const long long count = PyLong_AsLongLong(value);
      if (count == -1 && PyErr_Occurred() != nullptr) { throw nb::python_error(); }
      if (count == 0) { continue; }
      const std::int64_t first = run_first_position(id, pos, num_positions, row, count);
      p.plan.schedule(cached_handle(h, id), first, static_cast<std::int32_t>(count));
      row += static_cast<std::size_t>(count);
    }
    check_plan_views(h, p.plan);
  } catch (...) {
    h.impl->reset_staging(stream);  // a refused step must not leave its rows for the next one
    throw;
  }
  if (p.plan.num_rows() == 0) {  // no request has tokens: no step, and what the forward staged goes
    h.impl->reset_staging(stream);
    return;
  }
  nb::gil_scoped_release unlocked;
  h.impl->commit_staged_step(p.plan, stream);
}

// ---- zero-copy extractions ---------------------------------------------------------------------

/// Owner of a numpy array that views per-request storage: while it lives, its request may not be
/// released, aborted or scheduled (the rows would move or vanish under the array).
struct view_lease {
  view_lease(nb::object owner, replay_handle* h, std::uint32_t index, std::shared_ptr<void> r)
    : replay(std::move(owner)), handle(h), request(index), rows(std::move(r))
  {
    ++handle->views[request];
    ++handle->live_views;
  }
  view_lease(const view_lease&)            = delete;
  view_lease& operator=(const view_lease&) = delete;
  ~view_lease()
  {
    auto it = handle->views.find(request);
    if (it != handle->views.end() && --it->second == 0) { handle->views.erase(it); }
    --handle->live_views;
  }

  nb::object replay;  // keeps the replay (and so the storage) alive
  replay_handle* handle;
  std::uint32_t request;  // the request's handle index: it cannot go while the lease lives
  std::shared_ptr<void> rows;
};

void check_views(const replay_handle& h, request_key id, const char* what)
{
  if (h.live_views == 0 || !h.impl->contains(id)) { return; }  // an unknown id: the call itself says so
  if (auto it = h.views.find(h.impl->handle(id).index); it != h.views.end()) {
    throw view_conflict{std::string{what} + ": request " + id.to_string() + " has " + std::to_string(it->second) +
                        " zero-copy extraction(s) alive (numpy arrays from extract(copy=False)); delete "
                        "them, or extract with copy=True, first"};
  }
}

void check_plan_views(const replay_handle& h, const step_plan& plan)
{
  if (h.live_views == 0) { return; }
  for (const auto& e : plan.entries()) {
    if (!e.skipped) { check_views(h, e.request.id, "begin_step"); }
  }
}

nb::dlpack::dtype dlpack_of(dtype_code d)
{
  const bool is_signed = d == dtype_code::i8 || d == dtype_code::i16 || d == dtype_code::i32 || d == dtype_code::i64;
  return nb::dlpack::dtype{static_cast<std::uint8_t>(is_signed ? nb::dlpack::dtype_code::Int : nb::dlpack::dtype_code::UInt),
                           static_cast<std::uint8_t>(dtype_size(d) * 8), 1};
}

template <class Array>
nb::object make_array(const void* data, std::initializer_list<std::size_t> shape, nb::handle owner, dtype_code d,
                      std::initializer_list<std::int64_t> strides = {}, int device_type = nb::device::cpu::value,
                      int device_id = 0)
{
  static const std::int64_t empty = 0;  // numpy wants a pointer even for zero elements
  return Array(data != nullptr ? const_cast<void*>(data) : const_cast<std::int64_t*>(&empty), shape, owner, strides,
               dlpack_of(d), device_type, device_id)
    .cast();
}

nb::object owned_capsule(std::shared_ptr<void> rows)
{
  return nb::capsule(new std::shared_ptr<void>(std::move(rows)),
                     [](void* p) noexcept { delete static_cast<std::shared_ptr<void>*>(p); });
}

extract_options options_of(std::int64_t start, std::int64_t end, std::int64_t prompt_length, bool dense)
{
  extract_options o;
  o.start_position       = start;
  o.end_position         = end;
  o.prompt_length        = prompt_length;
  o.include_dense_layers = dense;
  return o;
}

extraction do_extract(replay_handle& h, request_key id, const extract_options& o)
{
  nb::gil_scoped_release unlocked;  // may wait for copies in flight
  return h.impl->extract(id, o);
}

nb::object extract_array(nb::handle self, nb::handle id, std::int64_t start, std::int64_t end,
                         std::int64_t prompt_length, bool dense, bool copy)
{
  auto& h                = nb::cast<replay_handle&>(self);
  const request_key key  = key_of(id);
  extraction e           = do_extract(h, key, options_of(start, end, prompt_length, dense));
  const dtype_code d     = h.impl->index_dtype();
  const auto rows        = static_cast<std::size_t>(e.rows);
  const auto layers      = static_cast<std::size_t>(e.layers);
  const auto k           = static_cast<std::size_t>(e.top_k);
  if (e.is_view && !copy) {
    nb::object lease = nb::cast(new view_lease(nb::borrow(self), &h, h.impl->handle(key).index, e.owner),
                                nb::rv_policy::take_ownership);
    return make_array<nb::ndarray<nb::numpy, nb::ro>>(e.data, {rows, layers, k}, lease, d);
  }
  if (e.is_view) {  // an independent copy of the view
    auto bytes = std::make_shared<std::vector<std::byte>>(rows * layers * k * dtype_size(d));
    std::memcpy(bytes->data(), e.data, bytes->size());
    const void* data = bytes->data();
    return make_array<nb::ndarray<nb::numpy>>(data, {rows, layers, k}, owned_capsule(std::move(bytes)), d);
  }
  return make_array<nb::ndarray<nb::numpy>>(e.data, {rows, layers, k}, owned_capsule(std::move(e.owner)), d);
}

// ---- .npy ---------------------------------------------------------------------------------------

std::string npy_of(dtype_code d, const void* data, std::size_t elems, std::span<const std::int64_t> shape)
{
  auto write = [&](auto tag) -> std::string {
    using T = decltype(tag);
    if constexpr (sizeof(T) <= 4) {
      return to_npy<T>(std::span<const T>{static_cast<const T*>(data), elems}, shape);
    } else {
      throw error{errc::invalid_argument, std::string{"to_npy: "} + dtype_name(d) +
                                            " is not an expert index type (8, 16 or 32 bits)"};
    }
  };
  return visit_dtype(d, write);
}

std::string extraction_npy(replay_handle& h, nb::handle id, const extract_options& o)
{
  const extraction e          = do_extract(h, key_of(id), o);
  const std::int64_t shape[3] = {e.rows, e.layers, e.top_k};
  return npy_of(h.impl->index_dtype(), e.data, static_cast<std::size_t>(e.rows * e.layers * e.top_k), shape);
}

dtype_code dtype_from_dlpack(nb::dlpack::dtype t)
{
  const bool is_int  = t.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Int);
  const bool is_uint = t.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::UInt);
  if ((is_int || is_uint) && t.lanes == 1) {
    switch (t.bits) {
      case 8: return is_int ? dtype_code::i8 : dtype_code::u8;
      case 16: return is_int ? dtype_code::i16 : dtype_code::u16;
      case 32: return is_int ? dtype_code::i32 : dtype_code::u32;
      case 64: return is_int ? dtype_code::i64 : dtype_code::u64;
      default: break;
    }
  }
  throw nb::type_error("routing ids must be integers (int8 to int64, uint8 to uint64)");
}

// ---- capture -----------------------------------------------------------------------------------

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

// ---- factories ----------------------------------------------------------------------------------

const factory_table& host_factories()
{
  static const factory_table table = [] {
    factory_table t;
    register_host_instances(t);
    return t;
  }();
  return table;
}

std::vector<std::string> keys_of(const factory_table& t)
{
  std::vector<std::string> keys;
  for (const auto& [key, factory] : t) { keys.push_back(key); }
  return keys;
}

std::uintptr_t host_stream_handle(host_stream& s) { return reinterpret_cast<std::uintptr_t>(&s); }  // NOLINT

}  // namespace

}  // namespace routing_replay::python

namespace rp = routing_replay::python;
namespace rr = routing_replay;

/// @brief The Python module routing_replay._core.
NB_MODULE(_core, m)
{
  m.doc() = "routing_replay host backend and the classes shared by every backend (see routing_replay)";

  rp::error_type = PyErr_NewExceptionWithDoc(
    "routing_replay._core.Error",
    "An error the library detected. `code` names its routing_replay::errc value (e.g. 'invalid_expert_id'); "
    "the message names the offending value, request and limit.",
    PyExc_RuntimeError, nullptr);
  m.attr("Error") = nb::borrow(rp::error_type);
  nb::register_exception_translator(rp::translate);

  nb::dict dtypes;
  for (int d = 0; d <= static_cast<int>(rp::dtype_code::u64); ++d) {
    dtypes[rp::dtype_name(static_cast<rp::dtype_code>(d))] = d;
  }
  m.attr("DTYPES") = dtypes;

  nb::class_<rr::replay_config>(m, "Config", "routing_replay::replay_config: sizes and the layer map")
    .def(nb::init<>())
    .def_rw("num_experts", &rr::replay_config::num_experts, "E: routed experts per MoE layer")
    .def_rw("top_k", &rr::replay_config::top_k, "K: experts per token and layer")
    .def_rw("num_fused_shared_experts", &rr::replay_config::num_fused_shared_experts,
            "extra router-output columns after the first K, skipped")
    .def_rw("max_tokens_per_step", &rr::replay_config::max_tokens_per_step, "N_max: most rows of one step")
    .def_rw("max_model_len", &rr::replay_config::max_model_len, "positions lie in [0, max_model_len)")
    .def_rw("num_model_layers", &rr::replay_config::num_model_layers, "model layers, 0: one past the last MoE layer")
    .def_rw("moe_layers", &rr::replay_config::moe_layers, "the layer map: model layer of each captured layer")
    .def_rw("block_size", &rr::replay_config::block_size, "block_slot storage: tokens per KV block")
    .def_rw("num_blocks", &rr::replay_config::num_blocks, "block_slot storage: KV blocks")
    .def_rw("host_memory_limit", &rr::replay_config::host_memory_limit, "cap on host bytes of stored rows")
    .def_rw("host_memory_ahead", &rr::replay_config::host_memory_ahead,
            "per-request storage: host bytes a worker thread keeps mapped ahead of need (-1: one step's rows; 0: none)")
    .def_rw("overwrite_recomputed_rows", &rr::replay_config::overwrite_recomputed_rows,
            "preemption: keep the latest routing of a position instead of the first");

  nb::class_<rr::host_stream>(m, "HostStream",
                              "A host-backend stream: an in-order worker thread (the host analogue of a CUDA "
                              "stream). Replays on the host backend run their kernels and copies on these.")
    .def(nb::init<>())
    .def("synchronize", &rr::host_stream::synchronize, nb::call_guard<nb::gil_scoped_release>(),
         "Waits for everything enqueued so far; raises Error(backend_error) if a task failed.")
    .def_prop_ro("handle", &rp::host_stream_handle, "The integer handle the native calls take.");

  nb::class_<rr::host_event>(m, "HostEvent", "A host-backend event: a completion flag with CUDA event semantics.")
    .def(nb::init<>())
    .def("record", [](rr::host_event& e, rr::host_stream& s) { rr::host_backend::record(e, s.ref()); },
         "stream"_a, "Marks the work enqueued on `stream` so far.")
    .def("ready", [](const rr::host_event& e) { return rr::host_backend::ready(e); },
         "Whether the work marked by the latest record has run.")
    .def("synchronize", [](const rr::host_event& e) { rr::host_backend::synchronize(e); },
         nb::call_guard<nb::gil_scoped_release>(), "Waits for the work marked by the latest record.");

  nb::class_<rp::plan_holder>(m, "StepPlan",
                              "The plan of one engine step (routing_replay::step_plan): requests in batch order, "
                              "with the positions of their tokens. Build one and clear() it every step.")
    .def(nb::init<>())
    .def("schedule", &rp::plan_schedule, "id"_a, "first_position"_a, "num_tokens"_a, "num_draft_tokens"_a = 0,
         "slots"_a.none() = nb::none(),
         "Appends a request's tokens: rows first..first+num_tokens-1 of the step are positions "
         "first_position... of the request; the last num_draft_tokens are speculative drafts; slots (block_slot "
         "storage) gives one KV slot per token.")
    .def("skip", [](rp::plan_holder& p, std::int32_t n) { p.plan.skip(n); }, "num_tokens"_a,
         "Appends tokens of requests that did not ask for routing.")
    .def("schedule_handles", &rp::plan_schedule_handles, "handles"_a, "first_positions"_a, "num_tokens"_a,
         "num_draft_tokens"_a.none() = nb::none(),
         "Appends requests by handle, in batch order, from columns (numpy arrays of any integer dtype, or "
         "sequences): handles[i] as add_request returned it, with num_tokens[i] tokens at positions "
         "first_positions[i]..., the last num_draft_tokens[i] of them speculative drafts. One native pass: no "
         "Python object and no id lookup per request.")
    .def("schedule_positions", &rp::plan_from_positions, "ids"_a, "num_tokens"_a, "positions"_a,
         "Appends requests ids[i] with num_tokens[i] tokens each, in batch order, at the positions the engine "
         "gives (one per token, consecutive within a request).")
    .def("add_fresh_blocks",
         [](rp::plan_holder& p, nb::handle blocks) { p.plan.add_fresh_blocks(rp::int64_list(blocks)); },
         "block_ids"_a, "Block-slot storage: KV blocks newly allocated for this step.")
    .def("set_padded_rows", [](rp::plan_holder& p, std::int64_t rows) { p.plan.set_padded_rows(rows); }, "rows"_a,
         "Rows the forward writes including padding (a CUDA graph recorded for a padded batch).")
    .def("clear", &rp::plan_holder::clear, "Empties the plan.")
    .def_prop_ro("num_rows", [](const rp::plan_holder& p) { return p.plan.num_rows(); }, "N: rows of the step.")
    .def("__len__", [](const rp::plan_holder& p) { return p.plan.entries().size(); }, "Runs in the plan.");

  nb::class_<rp::view_lease>(m, "_ViewLease", "Owner of a zero-copy extraction (internal).");

  nb::class_<rp::replay_handle>(m, "NativeReplay", "One compiled RoutingReplay instantiation (internal: use Replay).")
    .def_prop_ro("policies",
                 [](const rp::replay_handle& h) {
                   const auto& p = h.impl->policies();
                   nb::dict d;
                   d["backend"] = p.backend;
                   d["index"]   = p.index;
                   d["layout"]  = p.layout;
                   d["copy"]    = p.copy;
                   d["storage"] = p.storage;
                   return d;
                 })
    .def_prop_ro("index_dtype", [](const rp::replay_handle& h) { return rp::dtype_name(h.impl->index_dtype()); })
    .def_prop_ro("on_host", [](const rp::replay_handle& h) { return h.backend == rp::backend_kind::host; })
    .def_prop_ro("device", [](const rp::replay_handle& h) { return h.device_id; })
    .def_prop_ro("config", [](const rp::replay_handle& h) { return h.impl->config(); })
    .def_prop_ro("num_layers", [](const rp::replay_handle& h) { return h.impl->num_layers(); })
    .def_prop_ro("device_bytes", [](const rp::replay_handle& h) { return h.impl->device_bytes(); })
    .def_prop_ro("snapshot_bytes", [](const rp::replay_handle& h) { return h.impl->snapshot_bytes(); })
    .def_prop_ro("staging_bytes", [](const rp::replay_handle& h) { return h.impl->staging_bytes(); })
    .def_prop_ro("host_bytes", [](const rp::replay_handle& h) { return h.impl->host_bytes(); })
    .def_prop_ro("steps_in_flight", [](const rp::replay_handle& h) { return h.impl->steps_in_flight(); })
    .def_prop_ro("num_requests", [](const rp::replay_handle& h) { return h.impl->num_requests(); })
    .def("wait_for_host_memory_ahead", [](const rp::replay_handle& h) { h.impl->wait_for_host_memory_ahead(); },
         nb::call_guard<nb::gil_scoped_release>(),
         "Blocks until the host row memory kept ahead of need is mapped and registered.")
    .def_prop_ro("live_views", [](const rp::replay_handle& h) { return h.live_views; })
    .def("layer_slot", [](const rp::replay_handle& h, std::int32_t layer) { return h.impl->layer_slot(layer); })
    .def("hold_stream", [](rp::replay_handle& h, rr::host_stream& s) { h.hold_stream(nb::find(&s)); },
         "Host backend: keeps a stream alive with the replay, which waits for it before it is destroyed.")
    .def("add_request",
         [](rp::replay_handle& h, nb::handle id, std::int64_t prompt_length, nb::handle cached_slots) {
           const std::vector<std::int64_t> slots = rp::int64_list(cached_slots);
           return h.impl->add_request(rp::key_of(id), rr::request_options{prompt_length, slots}).bits();
         },
         "id"_a, "prompt_length"_a, "cached_slots"_a.none())
    .def("handle", [](const rp::replay_handle& h, nb::handle id) { return h.impl->handle(rp::key_of(id)).bits(); })
    .def("add_cached_prefix",
         [](rp::replay_handle& h, nb::handle id, nb::handle cached_slots) {
           const std::vector<std::int64_t> slots = rp::int64_list(cached_slots);
           h.impl->add_cached_prefix(rp::key_of(id), slots);
         })
    .def("contains", [](const rp::replay_handle& h, nb::handle id) { return h.impl->contains(rp::key_of(id)); })
    .def("recorded_rows",
         [](rp::replay_handle& h, nb::handle id) {
           const rr::request_key key = rp::key_of(id);
           nb::gil_scoped_release unlocked;
           return h.impl->recorded_rows(key);
         })
    .def("accept_draft",
         [](rp::replay_handle& h, nb::handle id, std::int32_t n) { h.impl->accept_draft(rp::key_of(id), n); })
    .def("extract", &rp::extract_array)
    .def("extract_npy",
         [](rp::replay_handle& h, nb::handle id, std::int64_t start, std::int64_t end, std::int64_t prompt, bool dense) {
           const std::string bytes = rp::extraction_npy(h, id, rp::options_of(start, end, prompt, dense));
           return nb::bytes(bytes.data(), bytes.size());
         })
    .def("extract_base64_npy",
         [](rp::replay_handle& h, nb::handle id, std::int64_t start, std::int64_t end, std::int64_t prompt, bool dense) {
           return rr::base64_encode(rp::extraction_npy(h, id, rp::options_of(start, end, prompt, dense)));
         })
    .def("write_npy",
         [](rp::replay_handle& h, nb::handle id, const std::string& path, std::int64_t start, std::int64_t end,
            std::int64_t prompt, bool dense) {
           const std::string bytes = rp::extraction_npy(h, id, rp::options_of(start, end, prompt, dense));
           std::ofstream file{path, std::ios::binary | std::ios::trunc};
           file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
           if (!file) { throw rr::error{rr::errc::invalid_argument, "write_npy: cannot write " + path}; }
         })
    .def("release",
         [](rp::replay_handle& h, nb::handle id) {
           const rr::request_key key = rp::key_of(id);
           rp::check_views(h, key, "release");
           h.impl->release(key);
           rp::forget_cached_id(h, id);
         })
    .def("abort",
         [](rp::replay_handle& h, nb::handle id) {
           const rr::request_key key = rp::key_of(id);
           rp::check_views(h, key, "abort");
           h.impl->abort(key);
           rp::forget_cached_id(h, id);
         })
    .def("export_blocks",
         [](nb::handle self, nb::handle blocks) {
           auto& h                               = nb::cast<rp::replay_handle&>(self);
           const std::vector<std::int64_t> list  = rp::int64_list(blocks);
           const auto& c                         = h.impl->config();
           const auto rows                       = list.size() * static_cast<std::size_t>(c.block_size);
           const auto layers                     = static_cast<std::size_t>(h.impl->num_layers());
           const auto k                          = static_cast<std::size_t>(c.top_k);
           const rp::dtype_code d                = h.impl->index_dtype();
           auto bytes = std::make_shared<std::vector<std::byte>>(rows * layers * k * rp::dtype_size(d));
           {
             nb::gil_scoped_release unlocked;
             h.impl->export_blocks(list, bytes->data(), rows * layers * k);
           }
           const void* data = bytes->data();
           return rp::make_array<nb::ndarray<nb::numpy>>(data, {rows, layers, k}, rp::owned_capsule(std::move(bytes)), d);
         })
    .def("import_blocks",
         [](rp::replay_handle& h, nb::handle blocks, nb::ndarray<nb::ro, nb::device::cpu, nb::c_contig> rows) {
           if (rp::dtype_from_dlpack(rows.dtype()) != h.impl->index_dtype()) {
             throw nb::type_error((std::string{"import_blocks: rows must be "} + rp::dtype_name(h.impl->index_dtype()))
                                    .c_str());
           }
           const std::vector<std::int64_t> list = rp::int64_list(blocks);
           nb::gil_scoped_release unlocked;
           h.impl->import_blocks(list, rows.data(), rows.size());
         })
    .def("copy_blocks",
         [](rp::replay_handle& h, nb::handle source, nb::handle destination) {
           const std::vector<std::int64_t> s = rp::int64_list(source);
           const std::vector<std::int64_t> d = rp::int64_list(destination);
           nb::gil_scoped_release unlocked;
           h.impl->copy_blocks(s, d);
         })
    .def("begin_step",
         [](rp::replay_handle& h, const rp::plan_holder& plan, std::uintptr_t stream) {
           rp::check_plan_views(h, plan.plan);
           h.impl->begin_step(plan.plan, stream);
         })
    .def("end_step",
         [](rp::replay_handle& h, std::uintptr_t stream) {
           nb::gil_scoped_release unlocked;
           h.impl->end_step(stream);
         })
    .def("drain",
         [](rp::replay_handle& h) {
           nb::gil_scoped_release unlocked;
           h.impl->drain();
         })
    .def("reset_device_buffer", [](rp::replay_handle& h, std::uintptr_t stream) { h.impl->reset_device_buffer(stream); })
    .def("capture",
         [](rp::replay_handle& h, std::int32_t layer, std::uintptr_t data, std::int32_t dtype, std::int64_t num_tokens,
            std::int64_t row_stride, std::uintptr_t stream, std::int64_t row_offset, std::uintptr_t physical_to_logical,
            std::int64_t num_physical) {
           rp::capture_source s = rp::capture_source_of(h, data, dtype, num_tokens, row_stride, row_offset,
                                                        physical_to_logical, num_physical);
           h.impl->capture(layer, s.ids, num_tokens, stream, s.options);
           rp::hold_until_done(h, stream, s);
         },
         "layer"_a, "data"_a, "dtype"_a, "num_tokens"_a, "row_stride"_a, "stream"_a, "row_offset"_a = 0,
         "physical_to_logical"_a = 0, "num_physical"_a = 0)
    .def("stage_capture", &rp::stage_capture)
    .def("capture_array",
         [](rp::replay_handle& h, std::int32_t layer, nb::handle array, std::uintptr_t stream, bool staged) {
           // the host backend's hot path: a plain 2-D integer array read through the buffer protocol,
           // no Python-side description of it; anything else (false) takes the general path, which
           // describes and reports it
           nb::ndarray<nb::ro, nb::ndim<2>, nb::device::cpu> ids;
           if (h.backend != rp::backend_kind::host || !nb::try_cast(array, ids)) { return false; }
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
           const auto dtype              = static_cast<std::int32_t>(rp::dtype_from_dlpack(t));
           if (staged) {
             rp::stage_capture(h, layer, data, dtype, rows, row_stride, stream);
             return true;
           }
           rp::capture_source s = rp::capture_source_of(h, data, dtype, rows, row_stride, 0, 0, 0);
           h.impl->capture(layer, s.ids, rows, stream, s.options);
           rp::hold_until_done(h, stream, s);
           return true;
         },
         "layer"_a, "ids"_a, "stream"_a, "staged"_a)
    .def("commit_scheduled", &rp::commit_scheduled, "num_scheduled_tokens"_a, "positions"_a, "stream"_a,
         "Staging path: files the forward just enqueued as one step of the requests of num_scheduled_tokens "
         "({id: tokens}, batch order) at `positions` (int64, one per token); new ids are added.")
    .def("reset_staging", [](rp::replay_handle& h, std::uintptr_t stream) { h.impl->reset_staging(stream); })
    .def("layer_view", [](nb::handle self, std::int32_t layer, std::int64_t rows) {
      auto& h                 = nb::cast<rp::replay_handle&>(self);
      const rp::layer_window w = h.impl->layer_view(layer, rows);
      const auto r            = static_cast<std::size_t>(w.rows);
      const auto k            = static_cast<std::size_t>(w.cols);
      const rp::dtype_code d  = h.impl->index_dtype();
      if (h.backend == rp::backend_kind::host) {
        return rp::make_array<nb::ndarray<nb::numpy>>(w.data, {r, k}, self, d, {w.row_stride, 1});
      }
      return rp::make_array<nb::ndarray<>>(w.data, {r, k}, self, d, {w.row_stride, 1}, nb::device::cuda::value,
                                            h.device_id);
    });

  m.def("policies", [] { return rp::keys_of(rp::host_factories()); },
        "The compiled host-backend instantiations, as 'index/layout/copy/storage'.");
  m.def("create",
        [](const std::string& index, const std::string& layout, const std::string& copy, const std::string& storage,
           const rr::replay_config& config, rr::host_stream* copy_stream, bool staging) {
          std::optional<std::uintptr_t> cs;
          if (copy_stream != nullptr) { cs = rp::host_stream_handle(*copy_stream); }
          rp::replay_handle h = rp::create_replay(rp::host_factories(), {"host", index, layout, copy, storage}, config,
                                                  cs, staging, rp::backend_kind::host, 0);
          if (copy_stream != nullptr) { h.hold_stream(nb::find(copy_stream)); }
          return h;
        },
        "index"_a, "layout"_a, "copy"_a, "storage"_a, "config"_a, "copy_stream"_a.none() = nb::none(),
        "staging"_a = false, "Creates a host-backend replay (internal: use routing_replay.Replay).");
  m.def("array_info",
        [](nb::ndarray<nb::ro> a) {
          nb::list shape;
          nb::list strides;
          for (std::size_t i = 0; i < a.ndim(); ++i) {
            shape.append(a.shape(i));
            strides.append(a.stride(i));
          }
          return nb::make_tuple(reinterpret_cast<std::uintptr_t>(a.data()),
                                static_cast<std::int32_t>(rp::dtype_from_dlpack(a.dtype())), nb::tuple(shape),
                                nb::tuple(strides), a.device_type(), a.device_id());
        },
        "array"_a,
        "(pointer, dtype code, shape, strides in elements, DLPack device type, device id) of any DLPack or "
        "buffer-protocol integer array.");
  m.def("to_npy",
        [](nb::ndarray<nb::ro, nb::device::cpu, nb::c_contig> a) {
          std::vector<std::int64_t> shape(a.ndim());
          for (std::size_t i = 0; i < a.ndim(); ++i) { shape[i] = static_cast<std::int64_t>(a.shape(i)); }
          const std::string bytes = rp::npy_of(rp::dtype_from_dlpack(a.dtype()), a.data(), a.size(), shape);
          return nb::bytes(bytes.data(), bytes.size());
        },
        "array"_a, "The bytes of a .npy file holding a C-contiguous integer array (8, 16 or 32 bits).");
  m.def("base64_encode", [](nb::bytes b) { return rr::base64_encode(std::string_view{b.c_str(), b.size()}); },
        "data"_a, "Standard base64 (RFC 4648, padded).");
  rp::bind_slot_rows(m);
  rp::register_vllm_streams(m);  // routing_replay.vllm
}
