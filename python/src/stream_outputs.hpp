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

/// @brief A read-only numpy view [rows, layers, top_k] of `data` (ids of `id_bytes` bytes, unsigned)
/// whose base is `holder`. nullptr with a Python error set.
[[nodiscard]] PyObject* make_rows_view(PyObject* holder, const void* data, std::int64_t rows, std::int64_t layers,
                                       std::int64_t top_k, std::int32_t id_bytes) noexcept;

/// @brief A new, owned numpy array [rows, layers, top_k] of unsigned ids of `id_bytes` bytes; its
/// data through *data. nullptr with a Python error set.
[[nodiscard]] PyObject* make_rows_array(std::int64_t rows, std::int64_t layers, std::int64_t top_k, std::int32_t id_bytes,
                                        void** data) noexcept;

}  // namespace routing_replay::python
