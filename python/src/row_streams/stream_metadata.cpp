/// @file
/// VllmStreams' begin_step: vLLM's AuxOutputConnectorMetadata read by attribute (its dicts walked
/// with PyDict_Next, request ids mapped to row_streams handles through a dict whose lookups reuse
/// the hashes Python keeps in its strings), then row_streams' begin-step calls in vLLM's order.
#include "stream_connector.hpp"

#include <nanobind/nanobind.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace nb = nanobind;

namespace routing_replay::python {
namespace {

/// Block hashes as row_streams takes them, from a PackedBlockHashes (its `data` read in place) or
/// any iterable of equal-length bytes (copied together).
class hash_view {
 public:
  hash_view() = default;
  hash_view(const hash_view&)            = delete;
  hash_view& operator=(const hash_view&) = delete;
  ~hash_view()
  {
    if (held_) { PyBuffer_Release(&buffer_); }
  }

  packed_hashes read(PyObject* hashes, const char* what)
  {
    if (hashes == nullptr || hashes == Py_None) { return {}; }
    nb::handle h{hashes};
    nb::object data = nb::steal(PyObject_GetAttr(hashes, interned_name("data")));
    nb::object size = data.is_valid() ? nb::steal(PyObject_GetAttr(hashes, interned_name("item_size"))) : nb::object{};
    if (!size.is_valid()) {
      if (PyErr_ExceptionMatches(PyExc_AttributeError) == 0) { throw nb::python_error(); }
      PyErr_Clear();  // not packed: an iterable of hashes
    } else {
      const auto item_size = nb::cast<std::int64_t>(size);
      if (PyObject_GetBuffer(data.ptr(), &buffer_, PyBUF_SIMPLE) != 0) { throw nb::python_error(); }
      held_ = true;
      const auto bytes = static_cast<std::size_t>(buffer_.len);
      if (item_size <= 0 || bytes % static_cast<std::size_t>(item_size) != 0) {
        throw nb::value_error((std::string{what} + ": " + std::to_string(bytes) + " bytes of hashes are not a whole number of " +
                               std::to_string(item_size) + "-byte hashes").c_str());
      }
      return {static_cast<const std::byte*>(buffer_.buf), bytes / static_cast<std::size_t>(item_size),
              static_cast<std::size_t>(item_size)};
    }
    std::size_t item_size = 0, count = 0;
    for (nb::handle item : h) {
      Py_buffer b;
      if (PyObject_GetBuffer(item.ptr(), &b, PyBUF_SIMPLE) != 0) { throw nb::python_error(); }
      const auto len = static_cast<std::size_t>(b.len);
      if (count > 0 && len != item_size) {
        PyBuffer_Release(&b);
        throw nb::value_error((std::string{what} + ": block hashes of different lengths (" + std::to_string(item_size) +
                               " and " + std::to_string(len) + " bytes)").c_str());
      }
      item_size = len;
      copy_.insert(copy_.end(), static_cast<const std::byte*>(b.buf), static_cast<const std::byte*>(b.buf) + len);
      PyBuffer_Release(&b);
      ++count;
    }
    return {copy_.data(), count, item_size};
  }

 private:
  Py_buffer buffer_{};
  bool held_ = false;
  std::vector<std::byte> copy_;  // only for hashes that are not packed
};

nb::object attribute(nb::handle o, const char* name, bool required)
{
  PyObject* value = PyObject_GetAttr(o.ptr(), interned_name(name));  // one lookup, no string made
  if (value != nullptr) { return nb::steal(value); }
  if (PyErr_ExceptionMatches(PyExc_AttributeError) == 0) { throw nb::python_error(); }
  PyErr_Clear();
  if (required) { throw nb::attribute_error((std::string{"metadata has no attribute '"} + name + "'").c_str()); }
  return nb::none();
}

}  // namespace

std::string id_text(PyObject* id)
{
  nb::object s = nb::steal(PyObject_Str(id));
  Py_ssize_t size  = 0;
  const char* utf8 = s.is_valid() ? PyUnicode_AsUTF8AndSize(s.ptr(), &size) : nullptr;
  if (utf8 == nullptr) {
    PyErr_Clear();
    return "?";
  }
  return {utf8, static_cast<std::size_t>(size)};
}

PyObject* interned_name(const char* name)
{
  // a handful of literals, compared by address; the strings live as long as the interpreter
  static std::vector<std::pair<const char*, PyObject*>> names;
  for (const auto& [literal, object] : names) {
    if (literal == name) { return object; }
  }
  PyObject* object = PyUnicode_InternFromString(name);
  if (object == nullptr) { throw nb::python_error(); }
  names.emplace_back(name, object);
  return object;
}

row_streams::handle vllm_streams::lookup(PyObject* id) const
{
  PyObject* value = PyDict_GetItemWithError(ids_.ptr(), id);  // borrowed
  if (value == nullptr) {
    if (PyErr_Occurred() != nullptr) { throw nb::python_error(); }
    return row_streams::new_request;
  }
  return static_cast<row_streams::handle>(PyLong_AsLong(value));
}

row_streams::handle vllm_streams::lookup_at(position_cache& cache, std::size_t at, PyObject* id)
{
  if (at < cache.ids.size() && cache.ids[at] == id) {
    const row_streams::handle h = cache.handles[at];
    if (streams_->live(h) && streams_->request(h).generation == cache.generations[at]) { return h; }
  }
  const row_streams::handle h = lookup(id);
  if (h != row_streams::new_request) { cache_at(cache, at, id, h); }
  return h;
}

void vllm_streams::cache_at(position_cache& cache, std::size_t at, PyObject* id, row_streams::handle h)
{
  if (at >= cache.ids.size()) {
    cache.ids.resize(at + 1, nullptr);
    cache.handles.resize(at + 1, row_streams::new_request);
    cache.generations.resize(at + 1, 0);
  }
  Py_INCREF(id);
  Py_XSETREF(cache.ids[at], id);
  cache.handles[at]     = h;
  cache.generations[at] = streams_->request(h).generation;
}

void vllm_streams::remember(PyObject* id, row_streams::handle h)
{
  nb::object value = nb::steal(PyLong_FromLong(h));
  if (!value.is_valid() || PyDict_SetItem(ids_.ptr(), id, value.ptr()) != 0) { throw nb::python_error(); }
  if (static_cast<std::size_t>(h) >= names_.size()) { names_.resize(static_cast<std::size_t>(h) + 1, nullptr); }
  Py_INCREF(id);
  Py_XSETREF(names_[static_cast<std::size_t>(h)], id);
}

void vllm_streams::forget_torn_down()
{
  for (const row_streams::handle h : streams_->forgotten()) {
    PyObject*& id = names_[static_cast<std::size_t>(h)];
    if (id == nullptr) { continue; }
    if (PyDict_DelItem(ids_.ptr(), id) != 0) { PyErr_Clear(); }
    Py_CLEAR(id);
  }
}

std::string vllm_streams::describe(row_streams::handle h) const
{
  if (h >= 0 && static_cast<std::size_t>(h) < names_.size() && names_[static_cast<std::size_t>(h)] != nullptr) {
    return "request " + id_text(names_[static_cast<std::size_t>(h)]);
  }
  return "request #" + std::to_string(h);
}

void vllm_streams::begin_step(nb::handle metadata)
{
  has_metadata_ = !metadata.is_none();
  if (!has_metadata_) { return; }
  const auto generation = nb::cast<std::int64_t>(attribute(metadata, "generation", true));
  nb::object requests   = attribute(metadata, "requests", true);
  nb::object block      = attribute(metadata, "block_hashes", true);
  nb::object finished   = nb::steal(PySequence_Fast(attribute(metadata, "finished_requests", true).ptr(),
                                                    "metadata.finished_requests must be a sequence"));
  if (!finished.is_valid()) { throw nb::python_error(); }
  if (!PyDict_Check(requests.ptr()) || !PyDict_Check(block.ptr())) {
    throw nb::type_error("metadata.requests and metadata.block_hashes must be dicts");
  }
  const Py_ssize_t num_finished = PySequence_Fast_GET_SIZE(finished.ptr());
  PyObject** finished_ids       = PySequence_Fast_ITEMS(finished.ptr());
  for (Py_ssize_t i = 0; i < num_finished; ++i) {
    const int both = PyDict_Contains(requests.ptr(), finished_ids[i]);
    if (both < 0) { throw nb::python_error(); }
    if (both == 1) {
      throw nb::value_error(("request " + id_text(finished_ids[i]) + " cannot run and finish in one step").c_str());
    }
  }
  if (generation < 0) { throw nb::value_error("metadata.generation must be non-negative"); }
  // the step opens in any case (captures then count as the step's); the current stream is read only
  // where opening enqueues work on it
  device_->open_step(device_->open_step_enqueues() ? stream() : 0);
  {
    hash_view retained, released;
    streams_->open_step(static_cast<std::uint64_t>(generation),
                        retained.read(attribute(metadata, "retained_block_hashes", false).ptr(), "retained_block_hashes"),
                        released.read(attribute(metadata, "released_block_hashes", false).ptr(), "released_block_hashes"));
  }
  forget_torn_down();
  try {
    Py_ssize_t at = 0;
    PyObject *id = nullptr, *value = nullptr;
    for (std::size_t position = 0; PyDict_Next(requests.ptr(), &at, &id, &value) != 0; ++position) {
      const long long emit_start = PyLong_AsLongLong(value);
      if (emit_start == -1 && PyErr_Occurred() != nullptr) { throw nb::python_error(); }
      const row_streams::handle known = lookup_at(scheduled_ids_, position, id);
      const row_streams::handle h     = streams_->schedule(known, emit_start);
      if (known == row_streams::new_request) {
        remember(id, h);
        cache_at(scheduled_ids_, position, id, h);
      }
    }
    at = 0;
    while (PyDict_Next(block.ptr(), &at, &id, &value) != 0) {
      const row_streams::handle h = lookup(id);
      if (h == row_streams::new_request) {
        throw nb::value_error(("block hashes for request " + id_text(id) + ", which is neither scheduled nor known").c_str());
      }
      hash_view hashes;
      streams_->add_block_hashes(h, hashes.read(value, "block_hashes"));
    }
    for (Py_ssize_t i = 0; i < num_finished; ++i) {
      const row_streams::handle h = lookup(finished_ids[i]);
      if (h == row_streams::new_request) {
        throw nb::value_error(("finished request " + id_text(finished_ids[i]) + " is not known").c_str());
      }
      streams_->finish(h);
    }
  } catch (...) {
    streams_->abandon_step();
    forget_torn_down();
    throw;
  }
  try {
    streams_->close_step();
  } catch (...) {
    forget_torn_down();
    throw;
  }
  forget_torn_down();
}

}  // namespace routing_replay::python
