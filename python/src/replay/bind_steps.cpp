/// @file
/// The binding's requests and steps: NativeReplay's calls that add, release and abort requests and
/// begin, end and drain steps, the drop-in capturer's staging path (a step of {id: tokens} committed
/// in one native pass, ids cached per replay), and the guard that keeps a zero-copy extraction's
/// rows from moving under it.
#include "bindings.hpp"

#include <routing_replay/errors.hpp>
#include <routing_replay/step_plan.hpp>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

using namespace nb::literals;

namespace routing_replay::python {
namespace {

/// Raises view_conflict if request `id` has a zero-copy extraction alive, for `what` (a call that
/// would move or free its rows).
void check_views(const replay_handle& h, request_key id, const char* what)
{
  if (h.live_views == 0 || !h.impl->contains(id)) { return; }  // an unknown id: the call itself says so
  if (auto it = h.views.find(h.impl->handle(id).index); it != h.views.end()) {
    throw view_conflict{std::string{what} + ": request " + id.to_string() + " has " + std::to_string(it->second) +
                        " zero-copy extraction(s) alive (numpy arrays from extract(copy=False)); delete "
                        "them, or extract with copy=True, first"};
  }
}

/// check_views() of every request `plan` schedules (a step may grow or write their rows).
void check_plan_views(const replay_handle& h, const step_plan& plan)
{
  if (h.live_views == 0) { return; }
  for (const auto& e : plan.entries()) {
    if (!e.skipped) { check_views(h, e.request.id, "begin_step"); }
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

}  // namespace

void bind_steps(nb::class_<replay_handle>& native)
{
  native
    .def("add_request",
         [](replay_handle& h, nb::handle id, std::int64_t prompt_length, nb::handle cached_slots) {
           const std::vector<std::int64_t> slots = int64_list(cached_slots);
           return h.impl->add_request(key_of(id), request_options{prompt_length, slots}).bits();
         },
         "id"_a, "prompt_length"_a, "cached_slots"_a.none())
    .def("handle", [](const replay_handle& h, nb::handle id) { return h.impl->handle(key_of(id)).bits(); })
    .def("add_cached_prefix",
         [](replay_handle& h, nb::handle id, nb::handle cached_slots) {
           const std::vector<std::int64_t> slots = int64_list(cached_slots);
           h.impl->add_cached_prefix(key_of(id), slots);
         })
    .def("contains", [](const replay_handle& h, nb::handle id) { return h.impl->contains(key_of(id)); })
    .def("recorded_rows",
         [](replay_handle& h, nb::handle id) {
           const request_key key = key_of(id);
           nb::gil_scoped_release unlocked;
           return h.impl->recorded_rows(key);
         })
    .def("accept_draft",
         [](replay_handle& h, nb::handle id, std::int32_t n) { h.impl->accept_draft(key_of(id), n); })
    .def("release",
         [](replay_handle& h, nb::handle id) {
           const request_key key = key_of(id);
           check_views(h, key, "release");
           h.impl->release(key);
           forget_cached_id(h, id);
         })
    .def("abort",
         [](replay_handle& h, nb::handle id) {
           const request_key key = key_of(id);
           check_views(h, key, "abort");
           h.impl->abort(key);
           forget_cached_id(h, id);
         })
    .def("begin_step",
         [](replay_handle& h, const plan_holder& plan, std::uintptr_t stream) {
           check_plan_views(h, plan.plan);
           h.impl->begin_step(plan.plan, stream);
         })
    .def("end_step",
         [](replay_handle& h, std::uintptr_t stream) {
           nb::gil_scoped_release unlocked;
           h.impl->end_step(stream);
         })
    .def("drain",
         [](replay_handle& h) {
           nb::gil_scoped_release unlocked;
           h.impl->drain();
         })
    .def("reset_device_buffer", [](replay_handle& h, std::uintptr_t stream) { h.impl->reset_device_buffer(stream); })
    .def("commit_scheduled", &commit_scheduled, "num_scheduled_tokens"_a, "positions"_a, "stream"_a,
         "Staging path: files the forward just enqueued as one step of the requests of num_scheduled_tokens "
         "({id: tokens}, batch order) at `positions` (int64, one per token); new ids are added.")
    .def("reset_staging", [](replay_handle& h, std::uintptr_t stream) { h.impl->reset_staging(stream); });
}

}  // namespace routing_replay::python
