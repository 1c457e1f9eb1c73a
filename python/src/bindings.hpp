/// @file
/// What the binding's parts share: the conversions every part makes (request ids, integer columns,
/// dtypes, numpy arrays over native memory), the error a zero-copy extraction in the way raises,
/// and the functions through which module_core.cpp registers each part on the module. The binding mirrors the
/// library's parts, one translation unit each: bind_errors.cpp (errors), bind_plans.cpp (request
/// ids and step plans), bind_steps.cpp (requests and steps), bind_capture.cpp (capture),
/// bind_extraction.cpp (extraction and the wire formats); module_core.cpp holds the module itself,
/// the host backend's types and its instantiations.
#pragma once

#include "handle.hpp"
#include "replay_base.hpp"

#include <routing_replay/errors.hpp>
#include <routing_replay/step_plan.hpp>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace nb = nanobind;

namespace routing_replay::python {

// ---- errors ----------------------------------------------------------------------------------

/// A zero-copy extraction is alive where the call would invalidate it: raised as BufferError.
struct view_conflict : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ---- request ids -------------------------------------------------------------------------------

/// An int or str id; a str key points into the Python string, valid while the call runs.
inline request_key key_of(nb::handle id)
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

/// Reads a 1-D integer column (a numpy array of any integer dtype, or a sequence) into `out` as
/// int64, keeping out's capacity: one pass, no Python object per element for arrays.
void read_column(nb::handle column, std::vector<std::int64_t>& out, const char* what);

/// A 1-D integer array or a sequence (list, tuple) as int64, copied; None is empty.
inline std::vector<std::int64_t> int64_list(nb::handle seq)
{
  std::vector<std::int64_t> out;
  if (!seq.is_none()) { read_column(seq, out, "integers"); }
  return out;
}

/// The first position of request `id`'s `count` rows starting at `row` of a step's `positions`,
/// which must be there and consecutive (chunked prefill, decode, drafts).
/// @throws error invalid_plan naming the request, the row and the positions
inline std::int64_t run_first_position(nb::handle id, const std::int64_t* positions, std::size_t num_positions,
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

// ---- dtypes and arrays ---------------------------------------------------------------------------

/// The dtype code of a DLPack integer dtype, or nothing for any other.
inline std::optional<dtype_code> integer_dtype_code(nb::dlpack::dtype t)
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
  return std::nullopt;
}

/// The dtype code of a DLPack integer dtype; raises TypeError for any other.
inline dtype_code dtype_from_dlpack(nb::dlpack::dtype t)
{
  if (const auto code = integer_dtype_code(t)) { return *code; }
  throw nb::type_error("routing ids must be integers (int8 to int64, uint8 to uint64)");
}

/// The DLPack dtype of a dtype code.
inline nb::dlpack::dtype dlpack_of(dtype_code d)
{
  const bool is_signed = d == dtype_code::i8 || d == dtype_code::i16 || d == dtype_code::i32 || d == dtype_code::i64;
  return nb::dlpack::dtype{static_cast<std::uint8_t>(is_signed ? nb::dlpack::dtype_code::Int : nb::dlpack::dtype_code::UInt),
                           static_cast<std::uint8_t>(dtype_size(d) * 8), 1};
}

/// An array (`Array`: a numpy or DLPack ndarray type) over `data`, kept alive by `owner`.
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

// ---- the parts -----------------------------------------------------------------------------------

/// Registers routing_replay._core.Error and the translation of the library's errors into it (and of
/// view_conflict into BufferError).
void bind_errors(nb::module_& m);
/// Registers StepPlan.
void bind_plans(nb::module_& m);
/// Registers NativeReplay's request and step calls: add, release and abort requests, begin and end
/// steps, the staging path's commit.
void bind_steps(nb::class_<replay_handle>& native);
/// Registers NativeReplay's capture calls and the layer view kernels write into.
void bind_capture(nb::class_<replay_handle>& native);
/// Registers NativeReplay's extractions and block transfers, and the module's wire-format functions
/// (to_npy, base64_encode, array_info).
void bind_extraction(nb::module_& m, nb::class_<replay_handle>& native);
/// Registers the route records written from storage: NativeReplay.extract_record and, on the class
/// bind_slot_rows() registered, SlotRows.read_record (bind_record.cpp).
void bind_records(nb::class_<replay_handle>& native);

/// routing_replay._core._wire: the route record's encoder, decoder and header (wire/bind_wire.cpp).
void bind_wire(nb::module_& m);

}  // namespace routing_replay::python
