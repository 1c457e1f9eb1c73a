/// @file
/// KeptPool: numpy arrays whose memory is a slice of a kept_rows_pool of host memory, faulted in
/// ahead of need by the pool's filling thread and given back when the array, and every array or
/// tensor made from it, has gone (a capsule owns the slice). For copies a consumer keeps: Replay's
/// extraction copies (the drop-in's get_routed_experts), routing_replay.sglang's reads.
#include "row_streams/stream_bindings.hpp"

#include <routing_replay/kept_rows_pool.hpp>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace routing_replay::python {

/// A kept pool's stats as a dict (declared in stream_connector.hpp, which routing_replay.vllm's
/// pool shares).
nb::dict kept_pool_dict(const kept_pool_stats& s);

namespace {

using host_pool = kept_rows_pool<host_kept_memory>;

/// What Python holds: the pool, shared with every slice out (it outlives them).
struct kept_pool_handle {
  std::shared_ptr<host_pool> pool;
};

/// A slice, owned by the capsule of the arrays over it.
struct kept_slice {
  kept_slice(std::shared_ptr<host_pool> p, std::size_t bytes) : pool(std::move(p)), slice(pool->take(bytes)) {}
  kept_slice(const kept_slice&)            = delete;  // one owner lets the slice go, once
  kept_slice& operator=(const kept_slice&) = delete;
  ~kept_slice() { pool->release(slice); }

  std::shared_ptr<host_pool> pool;
  host_pool::slice slice;
};

nb::dlpack::dtype dtype_named(const std::string& name)
{
  auto of = [](nb::dlpack::dtype_code code, int bits) {
    return nb::dlpack::dtype{static_cast<std::uint8_t>(code), static_cast<std::uint8_t>(bits), 1};
  };
  using c = nb::dlpack::dtype_code;
  if (name == "uint8") { return of(c::UInt, 8); }
  if (name == "int8") { return of(c::Int, 8); }
  if (name == "uint16") { return of(c::UInt, 16); }
  if (name == "int16") { return of(c::Int, 16); }
  if (name == "uint32") { return of(c::UInt, 32); }
  if (name == "int32") { return of(c::Int, 32); }
  if (name == "int64") { return of(c::Int, 64); }
  throw nb::type_error(("KeptPool.array: an integer dtype name (uint8 to int64), got " + name).c_str());
}

nb::object kept_array(kept_pool_handle& h, const std::vector<std::size_t>& shape, const std::string& dtype)
{
  const nb::dlpack::dtype t = dtype_named(dtype);
  std::size_t bytes         = t.bits / 8;
  for (std::size_t n : shape) { bytes *= n; }
  auto owned   = std::make_unique<kept_slice>(h.pool, bytes);
  static std::int64_t empty = 0;  // numpy wants a pointer even for zero elements
  void* data   = owned->slice.data != nullptr ? static_cast<void*>(owned->slice.data) : &empty;
  nb::capsule owner(owned.get(), [](void* p) noexcept { delete static_cast<kept_slice*>(p); });
  owned.release();
  return nb::ndarray<nb::numpy>(data, shape.size(), shape.data(), owner, nullptr, t).cast();
}

}  // namespace

nb::dict kept_pool_dict(const kept_pool_stats& s)
{
  nb::dict d;
  d["size_bytes"]            = s.size_bytes;
  d["size_high_water_bytes"] = s.size_high_water_bytes;
  d["in_use_bytes"]          = s.in_use_bytes;
  d["high_water_bytes"]      = s.high_water_bytes;
  d["budget_bytes"]          = s.budget_bytes;
  d["ahead_bytes"]           = s.ahead_bytes;
  d["extent_bytes"]          = s.extent_bytes;
  d["slices"]                = s.slices;
  d["extents_made"]          = s.extents_made;
  d["extents_over_budget"]   = s.extents_over_budget;
  d["extents_in_step"]       = s.extents_in_step;
  d["extents_freed"]         = s.extents_freed;
  d["filling_failed"]        = s.filling_failed;
  return d;
}

/// Registers KeptPool.
void bind_kept(nb::module_& m)
{
  nb::class_<kept_pool_handle>(m, "KeptPool",
                               "Host memory faulted in ahead of need by a thread of its own, for arrays a consumer keeps "
                               "(internal: Replay's extraction copies, routing_replay.sglang's reads).")
    .def(
      "__init__",
      [](kept_pool_handle* self, std::size_t extent_bytes, std::size_t budget_bytes, std::size_t ahead_bytes) {
        kept_pool_config c;
        c.extent_bytes = extent_bytes;
        c.budget_bytes = budget_bytes;
        c.ahead_bytes  = ahead_bytes;
        new (self) kept_pool_handle{std::make_shared<host_pool>(c)};
      },
      "extent_bytes"_a, "budget_bytes"_a, "ahead_bytes"_a = 0)
    .def("array", &kept_array, "shape"_a, "dtype"_a,
         "A new, writable numpy array of `shape` and integer `dtype` (a name) in a slice of the pool; the slice goes "
         "back when the array and everything made from it have gone. Its contents are not cleared.")
    .def("wait_until_filled", [](kept_pool_handle& h) { h.pool->wait_until_filled(); },
         nb::call_guard<nb::gil_scoped_release>(), "Blocks until the budget and the memory kept ahead are faulted in.")
    .def_prop_ro("stats", [](const kept_pool_handle& h) { return kept_pool_dict(h.pool->stats()); },
                 "size_bytes, size_high_water_bytes, in_use_bytes, high_water_bytes, budget_bytes, ahead_bytes, "
                 "extent_bytes, slices, extents_made, extents_over_budget, extents_in_step, extents_freed, "
                 "filling_failed.")
    .def_prop_rw("budget_bytes", [](const kept_pool_handle& h) { return h.pool->stats().budget_bytes; },
                 [](kept_pool_handle& h, std::size_t bytes) { h.pool->set_budget(bytes); });
}

}  // namespace routing_replay::python
