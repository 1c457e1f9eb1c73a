/// @file
/// The native half of routing_replay.vllm: the device side as Python holds it (_StreamDevice, shared
/// by the capturer and the connector), the connector's data plane (VllmStreams: row_streams, the
/// device side, the chunks of host copies, request ids) and one step in flight (PendingAuxOutput).
/// Each call reads vLLM's objects by their attributes, as vLLM itself does (so vLLM's own metadata,
/// hashes and input batches work as well as routing_replay.vllm's), and walks their dicts and lists
/// natively. Files: stream_metadata.cpp (begin_step), stream_step.cpp (a step's output),
/// stream_bindings.cpp (the classes).
#pragma once

#include "stream_chunks.hpp"
#include "stream_device.hpp"

#include <routing_replay/row_streams.hpp>

#include <nanobind/nanobind.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace routing_replay::python {

/// @brief The device side, as Python holds it.
struct stream_device_handle {
  std::unique_ptr<stream_device_base> impl;  ///< the instantiation
  std::int32_t num_layers  = 0;              ///< L
  std::int32_t top_k       = 0;              ///< K
  std::int32_t num_experts = 0;              ///< E
  std::int32_t max_rows    = 0;              ///< N_max
};

/// @brief Makes a host-backend device side (stream_device_host.cpp).
std::unique_ptr<stream_device_base> make_host_stream_device(std::int32_t layers, std::int32_t top_k, std::int32_t experts,
                                                            std::int32_t max_rows, std::int32_t depth);

/// @brief One step between prepare_output and process_output.
struct pending_output {
  nanobind::object connector;   ///< the VllmStreams it belongs to
  int step            = -1;     ///< row_streams' step number
  std::int32_t slot   = -1;     ///< ring slot of its snapshot
  std::int64_t rows   = 0;      ///< rows harvested
  nanobind::object request_ids; ///< a list: the batch's ids, as they were at prepare_output
  nanobind::object num_sampled;   ///< enqueue_cpu_copy's arguments, read in process_output
  nanobind::object num_rejected;  ///< (vLLM may fill them asynchronously until then)
  row_chunk* chunk    = nullptr;  ///< the host copy, held once
  bool copied         = false;    ///< enqueue_cpu_copy was called
  bool processed      = false;    ///< process_output ran

  pending_output() = default;
  pending_output(const pending_output&)            = delete;
  pending_output& operator=(const pending_output&) = delete;
  ~pending_output();
};

/// @brief The data plane of one output rank.
class vllm_streams {
 public:
  /// @brief Streams over `device` (a _StreamDevice); `current_stream` (no arguments) gives the CUDA
  /// stream handle calls enqueue on (None: the host backend's own streams).
  /// `kept_budget_bytes` (< 0: the default, output_pool_config()) is the output pool's budget.
  vllm_streams(nanobind::object device, std::int32_t block_size, std::int32_t max_num_seqs,
               std::int32_t max_num_batched_tokens, std::int32_t max_concurrent_batches, std::size_t max_bytes,
               nanobind::object current_stream, std::int64_t kept_budget_bytes);
  vllm_streams(const vllm_streams&)            = delete;
  vllm_streams& operator=(const vllm_streams&) = delete;
  ~vllm_streams();

  /// @brief begin_step(metadata): a metadata object with generation, requests, block_hashes,
  /// finished_requests and, optionally, retained_block_hashes and released_block_hashes.
  void begin_step(nanobind::handle metadata);
  /// @brief prepare_output(input_batch): its req_ids, query_start_loc_np and num_computed_tokens_np.
  nanobind::object prepare_output(nanobind::handle self, nanobind::handle input_batch);
  /// @brief PendingAuxOutput.enqueue_cpu_copy().
  void enqueue_cpu_copy(pending_output& p, nanobind::handle num_sampled, nanobind::handle num_rejected);
  /// @brief PendingAuxOutput.process_output(): {request id: AuxRequestOutput}.
  nanobind::object process_output(pending_output& p);
  /// @brief close().
  void close();
  /// @brief Reads the current stream as `read(argument)` (torch's raw-stream reader, a builtin)
  /// once `ready()` returned true, instead of the current_stream callable.
  void use_raw_stream_reader(nanobind::object read, nanobind::object argument, nanobind::object ready);

  /// @brief The streams (introspection).
  [[nodiscard]] row_streams& streams() noexcept { return *streams_; }
  /// @brief Chunk records made so far.
  [[nodiscard]] std::size_t host_chunks() const { return chunks_->chunks(); }
  /// @brief The pool the chunks' memory comes from.
  [[nodiscard]] output_pool& output_memory() noexcept { return chunks_->memory(); }
  /// @brief The largest step (bytes of rows) the end-of-step kernel writes straight into host memory.
  [[nodiscard]] std::size_t direct_write_bytes() const noexcept { return device_->direct_write_bytes(); }
  /// @brief Sets it (0: every step through the device snapshot and a copy on the output stream).
  void set_direct_write_bytes(std::size_t bytes) noexcept { device_->set_direct_write_bytes(bytes); }
  /// @brief Live requests the id map knows.
  [[nodiscard]] std::size_t known_ids() const noexcept { return static_cast<std::size_t>(PyDict_Size(ids_.ptr())); }
  /// @brief Drops a finished pending step's chunk (pending_output's destructor).
  void release_chunk(pending_output& p) noexcept;

 private:
  /// Request ids seen at each position of the last step's dict or list, with their handles: a
  /// batch that keeps its ids' objects and order (a persistent batch) maps them by a pointer
  /// compare. Each id is held (a strong reference), so its address cannot name another object.
  struct position_cache {
    std::vector<PyObject*> ids;
    std::vector<row_streams::handle> handles;
    std::vector<std::uint32_t> generations;
    position_cache() = default;
    position_cache(const position_cache&)            = delete;
    position_cache& operator=(const position_cache&) = delete;
    ~position_cache()
    {
      for (PyObject*& id : ids) { Py_CLEAR(id); }
    }
  };

  std::uintptr_t stream();
  [[nodiscard]] std::string describe(row_streams::handle h) const;
  row_streams::handle lookup(PyObject* id) const;
  row_streams::handle lookup_at(position_cache& cache, std::size_t at, PyObject* id);
  void cache_at(position_cache& cache, std::size_t at, PyObject* id, row_streams::handle h);
  void remember(PyObject* id, row_streams::handle h);
  void forget_torn_down();
  [[noreturn]] void raise_step_problem(const pending_output& p, const detail::step_status& status) const;

  nanobind::object device_object_;
  stream_device_handle* device_handle_;
  stream_device_base* device_;
  std::int32_t row_elems_;
  std::int32_t out_bytes_;
  nanobind::object current_stream_;
  nanobind::object raw_stream_, raw_stream_arg_, raw_stream_ready_;  // use_raw_stream_reader()
  bool raw_stream_live_ = false;
  std::shared_ptr<chunk_pool> chunks_;
  std::unique_ptr<row_streams> streams_;
  nanobind::dict ids_;                   // request id -> handle (int)
  std::vector<PyObject*> names_;         // handle -> request id (a strong reference while live)
  std::vector<row_streams::handle> handles_;  // scratch
  std::vector<std::int64_t> starts_, query_start_loc_, sampled_, rejected_;  // scratch
  std::vector<std::vector<std::int64_t>> step_starts_;  // per row_streams step: its token starts and rows (errors)
  std::vector<std::vector<std::int64_t>> step_offsets_;
  bool has_metadata_ = false;  // the last begin_step had metadata (vLLM: _step_metadata is not None)
  position_cache scheduled_ids_;  // metadata.requests, by position
  position_cache batch_ids_;      // input_batch.req_ids, by position
};

/// @brief The output pool's sizes for steps of `max_num_batched_tokens` rows of `row_elems` ids of
/// `out_bytes` bytes: extents of two full steps, and a budget of `budget_bytes` (< 0: the steps in
/// flight at once plus two, in whole extents); extents past it given back where `give_back` (the
/// host backend: pinned memory of CUDA is kept, kept_pool_config::give_back).
kept_pool_config output_pool_config(std::int32_t max_num_batched_tokens, std::int32_t row_elems, std::int32_t out_bytes,
                                    std::int32_t max_concurrent_batches, std::int64_t budget_bytes, bool give_back);

/// @brief A kept pool's stats as a dict (the names of kept_pool_stats' fields).
nanobind::dict kept_pool_dict(const kept_pool_stats& stats);

/// @brief str(id) for an error message ("?" where str() fails; its error is cleared).
std::string id_text(PyObject* id);

/// @brief The interned Python string of a name literal (made once; looked up by the literal's address),
/// for attribute reads that make no string per call.
PyObject* interned_name(const char* name);

/// @brief Reads the first `limit` entries (or fewer) of a 1-D integer column (a numpy array of any
/// integer dtype, a sequence) as int64.
/// @throws nanobind::type_error
void read_int64_column(nanobind::handle column, std::vector<std::int64_t>& out, const char* what, std::size_t limit);

}  // namespace routing_replay::python
