/// @file
/// The binding's errors: routing_replay._core.Error (a RuntimeError whose `code` names the
/// library's errc value) and the translation of the library's exceptions into it; a zero-copy
/// extraction in the way of a call (view_conflict, bindings.hpp) becomes BufferError.
#include "bindings.hpp"

#include <routing_replay/errors.hpp>

#include <nanobind/nanobind.h>

#include <exception>

namespace routing_replay::python {
namespace {

PyObject* error_type = nullptr;  // routing_replay._core.Error, a RuntimeError with a `code`

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
    case errc::invalid_packet: return "invalid_packet";
    case errc::invalid_record: return "invalid_record";
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

}  // namespace

void bind_errors(nb::module_& m)
{
  error_type = PyErr_NewExceptionWithDoc(
    "routing_replay._core.Error",
    "An error the library detected. `code` names its routing_replay::errc value (e.g. 'invalid_expert_id'); "
    "the message names the offending value, request and limit.",
    PyExc_RuntimeError, nullptr);
  m.attr("Error") = nb::borrow(error_type);
  nb::register_exception_translator(translate);
}

}  // namespace routing_replay::python
