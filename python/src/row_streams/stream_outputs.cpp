/// @file
/// AuxRequestOutput and the holder of a step's rows as plain CPython types (a step makes one output
/// per request: PyObject_New and two slots, where a nanobind or dataclass instance costs several
/// times more), and the numpy arrays of rows, through numpy's C API (a view costs one
/// PyArray_NewFromDescr, where slicing an array through Python costs about three times as much).
#include "stream_outputs.hpp"

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <structmember.h>

#include <cstddef>

namespace routing_replay::python {
namespace {

// ---- AuxRequestOutput ---------------------------------------------------------------------------

struct aux_output {
  PyObject_HEAD
  long long token_start;
  PyObject* rows;
};

PyObject* aux_type = nullptr;

void aux_dealloc(PyObject* self)
{
  PyTypeObject* type = Py_TYPE(self);
  Py_CLEAR(reinterpret_cast<aux_output*>(self)->rows);
  type->tp_free(self);
  Py_DECREF(type);
}

int aux_init(PyObject* self, PyObject* args, PyObject* kwargs)
{
  static const char* names[] = {"token_start", "rows", nullptr};
  long long token_start      = 0;
  PyObject* rows             = nullptr;
  if (PyArg_ParseTupleAndKeywords(args, kwargs, "LO:AuxRequestOutput", const_cast<char**>(names), &token_start, &rows) == 0) {
    return -1;
  }
  auto* o        = reinterpret_cast<aux_output*>(self);
  o->token_start = token_start;
  Py_INCREF(rows);
  Py_XSETREF(o->rows, rows);
  return 0;
}

PyObject* aux_repr(PyObject* self)
{
  const auto* o = reinterpret_cast<aux_output*>(self);
  return PyUnicode_FromFormat("AuxRequestOutput(token_start=%lld, rows=%R)", o->token_start, o->rows != nullptr ? o->rows : Py_None);
}

PyObject* aux_reduce(PyObject* self, PyObject*)
{
  const auto* o = reinterpret_cast<aux_output*>(self);
  return Py_BuildValue("O(LO)", reinterpret_cast<PyObject*>(Py_TYPE(self)), o->token_start,
                       o->rows != nullptr ? o->rows : Py_None);
}

PyMemberDef aux_members[] = {
  {"token_start", T_LONGLONG, offsetof(aux_output, token_start), 0, "Position of the first row."},
  {"rows", T_OBJECT_EX, offsetof(aux_output, rows), 0, "numpy [n, L, K]: uint8 for E <= 256, else uint16."},
  {nullptr, 0, 0, 0, nullptr}};

PyMethodDef aux_methods[] = {{"__reduce__", aux_reduce, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};

PyType_Slot aux_slots[] = {
  {Py_tp_doc, const_cast<char*>("One request's routing rows of a step: positions [token_start, token_start + len(rows)). "
                                "rows is a read-only numpy view of the step's host copy where the rows came in the step; "
                                "keeping it keeps that copy.")},
  {Py_tp_dealloc, reinterpret_cast<void*>(aux_dealloc)},
  {Py_tp_init, reinterpret_cast<void*>(aux_init)},
  {Py_tp_new, reinterpret_cast<void*>(PyType_GenericNew)},
  {Py_tp_repr, reinterpret_cast<void*>(aux_repr)},
  {Py_tp_members, aux_members},
  {Py_tp_methods, aux_methods},
  {0, nullptr}};

PyType_Spec aux_spec = {"routing_replay._core.AuxRequestOutput", sizeof(aux_output), 0,
                        Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE, aux_slots};

// ---- the holder of a step's rows -----------------------------------------------------------------

struct chunk_holder {
  PyObject_HEAD
  row_chunk* chunk;
};

PyObject* holder_type = nullptr;

void holder_dealloc(PyObject* self)
{
  PyTypeObject* type = Py_TYPE(self);
  if (row_chunk* c = reinterpret_cast<chunk_holder*>(self)->chunk) { c->release_rows(); }
  type->tp_free(self);
  Py_DECREF(type);
}

PyType_Slot holder_slots[] = {
  {Py_tp_doc, const_cast<char*>("The host copy of one step's rows, kept while views of it live (internal).")},
  {Py_tp_dealloc, reinterpret_cast<void*>(holder_dealloc)},
  {0, nullptr}};

PyType_Spec holder_spec = {"routing_replay._core._StepRows", sizeof(chunk_holder), 0, Py_TPFLAGS_DEFAULT, holder_slots};

int npy_type(std::int32_t id_bytes) noexcept { return id_bytes == 1 ? NPY_UINT8 : (id_bytes == 2 ? NPY_UINT16 : NPY_UINT32); }

}  // namespace

bool init_stream_outputs(PyObject* module)
{
  if (PyArray_API == nullptr) { import_array1(false); }
  if (aux_type == nullptr) {
    aux_type    = PyType_FromSpec(&aux_spec);
    holder_type = PyType_FromSpec(&holder_spec);
    if (aux_type == nullptr || holder_type == nullptr) { return false; }
  }
  Py_INCREF(aux_type);
  if (PyModule_AddObject(module, "AuxRequestOutput", aux_type) < 0) {
    Py_DECREF(aux_type);
    return false;
  }
  return true;
}

PyObject* aux_output_type() noexcept { return aux_type; }

PyObject* make_aux_output(std::int64_t token_start, PyObject* rows) noexcept
{
  auto* o = PyObject_New(aux_output, reinterpret_cast<PyTypeObject*>(aux_type));
  if (o == nullptr) {
    Py_DECREF(rows);
    return nullptr;
  }
  o->token_start = token_start;
  o->rows        = rows;
  return reinterpret_cast<PyObject*>(o);
}

PyObject* make_chunk_holder(row_chunk* chunk) noexcept
{
  auto* h = PyObject_New(chunk_holder, reinterpret_cast<PyTypeObject*>(holder_type));
  if (h == nullptr) { return nullptr; }
  chunk->retain_rows();
  h->chunk = chunk;
  return reinterpret_cast<PyObject*>(h);
}

PyObject* make_rows_view(PyObject* holder, const void* data, std::int64_t rows, std::int64_t layers, std::int64_t top_k,
                         std::int32_t id_bytes, bool writeable) noexcept
{
  static unsigned char nothing = 0;  // numpy allocates where it is handed no pointer, even for no rows
  npy_intp dims[3] = {static_cast<npy_intp>(rows), static_cast<npy_intp>(layers), static_cast<npy_intp>(top_k)};
  PyObject* array = PyArray_NewFromDescr(&PyArray_Type, PyArray_DescrFromType(npy_type(id_bytes)), 3, dims, nullptr,
                                         const_cast<void*>(data != nullptr ? data : &nothing),
                                         NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED | (writeable ? NPY_ARRAY_WRITEABLE : 0),
                                         nullptr);
  if (array == nullptr) { return nullptr; }
  Py_INCREF(holder);
  if (PyArray_SetBaseObject(reinterpret_cast<PyArrayObject*>(array), holder) < 0) {  // steals the holder
    Py_DECREF(array);
    return nullptr;
  }
  return array;
}

bool numpy_int_column(PyObject* column, int_column& out) noexcept
{
  if (PyArray_API == nullptr || !PyArray_Check(column)) { return false; }
  auto* array = reinterpret_cast<PyArrayObject*>(column);
  PyArray_Descr* descr = PyArray_DESCR(array);
  if (PyArray_NDIM(array) != 1 || !PyArray_ISNBO(descr->byteorder)) { return false; }
  const int type = PyArray_TYPE(array);
  if (!PyTypeNum_ISINTEGER(type)) { return false; }
  out.data        = PyArray_BYTES(array);
  out.count       = static_cast<std::size_t>(PyArray_DIM(array, 0));
  out.byte_stride = static_cast<std::ptrdiff_t>(PyArray_STRIDE(array, 0));
  out.item_bytes  = static_cast<std::size_t>(PyArray_ITEMSIZE(array));
  out.is_signed   = PyTypeNum_ISSIGNED(type);
  return true;
}

PyObject* make_rows_array(std::int64_t rows, std::int64_t layers, std::int64_t top_k, std::int32_t id_bytes,
                          void** data) noexcept
{
  npy_intp dims[3] = {static_cast<npy_intp>(rows), static_cast<npy_intp>(layers), static_cast<npy_intp>(top_k)};
  PyObject* array  = PyArray_SimpleNew(3, dims, npy_type(id_bytes));
  if (array != nullptr) { *data = PyArray_DATA(reinterpret_cast<PyArrayObject*>(array)); }
  return array;
}

}  // namespace routing_replay::python
