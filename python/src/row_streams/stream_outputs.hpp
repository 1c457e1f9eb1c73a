/// @file
/// What routing_replay.vllm hands out per request and step, made natively because a step makes one
/// per request: AuxRequestOutput (token_start, rows), a plain Python type of two slots, and its rows,
/// a read-only numpy view of the step's host copy whose base holds the chunk (stream_chunks.hpp).
/// stream_outputs.cpp is the one translation unit that uses numpy's C API.
#pragma once

#include "stream_chunks.hpp"

#include <Python.h>

#include <cstddef>
#include <cstdint>

namespace routing_replay::python {

/// @brief Readies numpy's C API and makes the types; adds AuxRequestOutput to `module`.
/// @return false with a Python error set
bool init_stream_outputs(PyObject* module);

/// @brief The type AuxRequestOutput (a new reference is not taken).
[[nodiscard]] PyObject* aux_output_type() noexcept;

/// @brief A new AuxRequestOutput(token_start, rows); steals `rows`. nullptr with a Python error set.
[[nodiscard]] PyObject* make_aux_output(std::int64_t token_start, PyObject* rows) noexcept;

/// @brief A Python object holding `chunk` once (retain_rows(); released when it goes): the base of
/// every view of a step's rows. nullptr with a Python error set.
[[nodiscard]] PyObject* make_chunk_holder(row_chunk* chunk) noexcept;

/// @brief A numpy view [rows, layers, top_k] of `data` (ids of `id_bytes` bytes, unsigned) whose
/// base is `holder`, read-only unless `writeable` (rows in a slice of their own). nullptr with a
/// Python error set.
[[nodiscard]] PyObject* make_rows_view(PyObject* holder, const void* data, std::int64_t rows, std::int64_t layers,
                                       std::int64_t top_k, std::int32_t id_bytes, bool writeable = false) noexcept;

/// @brief A 1-D column of integers in place: `count` items of `item_bytes` bytes, `byte_stride` apart.
struct int_column {
  const char* data          = nullptr;  ///< the first item
  std::size_t count         = 0;        ///< items
  std::ptrdiff_t byte_stride = 0;       ///< bytes from one item to the next
  std::size_t item_bytes    = 0;        ///< 1, 2, 4 or 8
  bool is_signed            = false;    ///< signed integers
};

/// @brief Where `column` is a 1-D numpy array of integers in native byte order, its items (the
/// engine's columns are: read in place with numpy's C API, about a tenth of the cost of the buffer
/// protocol, which builds a format string per new array). False for anything else (no error set).
[[nodiscard]] bool numpy_int_column(PyObject* column, int_column& out) noexcept;

/// @brief A new, owned numpy array [rows, layers, top_k] of unsigned ids of `id_bytes` bytes; its
/// data through *data. nullptr with a Python error set.
[[nodiscard]] PyObject* make_rows_array(std::int64_t rows, std::int64_t layers, std::int64_t top_k, std::int32_t id_bytes,
                                        void** data) noexcept;

}  // namespace routing_replay::python
