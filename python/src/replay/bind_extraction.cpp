/// @file
/// The binding's extraction and wire formats: a request's routing as a numpy array (a zero-copy
/// view of per-request storage, leased so its request cannot move it, or an owned copy), as .npy
/// bytes, base64 of them, or a file; rows of whole KV blocks out and in; and the module's functions
/// for arrays the caller holds (to_npy, base64_encode, array_info).
#include "bindings.hpp"

#include <routing_replay/errors.hpp>
#include <routing_replay/npy.hpp>
#include <routing_replay/routed_experts.hpp>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

using namespace nb::literals;

namespace routing_replay::python {
namespace {

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

}  // namespace

void bind_extraction(nb::module_& m, nb::class_<replay_handle>& native)
{
  nb::class_<view_lease>(m, "_ViewLease", "Owner of a zero-copy extraction (internal).");

  native
    .def("extract", &extract_array)
    .def("extract_npy",
         [](replay_handle& h, nb::handle id, std::int64_t start, std::int64_t end, std::int64_t prompt, bool dense) {
           const std::string bytes = extraction_npy(h, id, options_of(start, end, prompt, dense));
           return nb::bytes(bytes.data(), bytes.size());
         })
    .def("extract_base64_npy",
         [](replay_handle& h, nb::handle id, std::int64_t start, std::int64_t end, std::int64_t prompt, bool dense) {
           return base64_encode(extraction_npy(h, id, options_of(start, end, prompt, dense)));
         })
    .def("write_npy",
         [](replay_handle& h, nb::handle id, const std::string& path, std::int64_t start, std::int64_t end,
            std::int64_t prompt, bool dense) {
           const std::string bytes = extraction_npy(h, id, options_of(start, end, prompt, dense));
           std::ofstream file{path, std::ios::binary | std::ios::trunc};
           file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
           if (!file) { throw error{errc::invalid_argument, "write_npy: cannot write " + path}; }
         })
    .def("export_blocks",
         [](nb::handle self, nb::handle blocks) {
           auto& h                              = nb::cast<replay_handle&>(self);
           const std::vector<std::int64_t> list = int64_list(blocks);
           const auto& c                        = h.impl->config();
           const auto rows                      = list.size() * static_cast<std::size_t>(c.block_size);
           const auto layers                    = static_cast<std::size_t>(h.impl->num_layers());
           const auto k                         = static_cast<std::size_t>(c.top_k);
           const dtype_code d                   = h.impl->index_dtype();
           auto bytes = std::make_shared<std::vector<std::byte>>(rows * layers * k * dtype_size(d));
           {
             nb::gil_scoped_release unlocked;
             h.impl->export_blocks(list, bytes->data(), rows * layers * k);
           }
           const void* data = bytes->data();
           return make_array<nb::ndarray<nb::numpy>>(data, {rows, layers, k}, owned_capsule(std::move(bytes)), d);
         })
    .def("import_blocks",
         [](replay_handle& h, nb::handle blocks, nb::ndarray<nb::ro, nb::device::cpu, nb::c_contig> rows) {
           if (dtype_from_dlpack(rows.dtype()) != h.impl->index_dtype()) {
             throw nb::type_error((std::string{"import_blocks: rows must be "} + dtype_name(h.impl->index_dtype()))
                                    .c_str());
           }
           const std::vector<std::int64_t> list = int64_list(blocks);
           nb::gil_scoped_release unlocked;
           h.impl->import_blocks(list, rows.data(), rows.size());
         })
    .def("copy_blocks",
         [](replay_handle& h, nb::handle source, nb::handle destination) {
           const std::vector<std::int64_t> s = int64_list(source);
           const std::vector<std::int64_t> d = int64_list(destination);
           nb::gil_scoped_release unlocked;
           h.impl->copy_blocks(s, d);
         });

  m.def("array_info",
        [](nb::ndarray<nb::ro> a) {
          nb::list shape;
          nb::list strides;
          for (std::size_t i = 0; i < a.ndim(); ++i) {
            shape.append(a.shape(i));
            strides.append(a.stride(i));
          }
          return nb::make_tuple(reinterpret_cast<std::uintptr_t>(a.data()),
                                static_cast<std::int32_t>(dtype_from_dlpack(a.dtype())), nb::tuple(shape),
                                nb::tuple(strides), a.device_type(), a.device_id());
        },
        "array"_a,
        "(pointer, dtype code, shape, strides in elements, DLPack device type, device id) of any DLPack or "
        "buffer-protocol integer array.");
  m.def("to_npy",
        [](nb::ndarray<nb::ro, nb::device::cpu, nb::c_contig> a) {
          std::vector<std::int64_t> shape(a.ndim());
          for (std::size_t i = 0; i < a.ndim(); ++i) { shape[i] = static_cast<std::int64_t>(a.shape(i)); }
          const std::string bytes = npy_of(dtype_from_dlpack(a.dtype()), a.data(), a.size(), shape);
          return nb::bytes(bytes.data(), bytes.size());
        },
        "array"_a, "The bytes of a .npy file holding a C-contiguous integer array (8, 16 or 32 bits).");
  m.def("base64_encode", [](nb::bytes b) { return base64_encode(std::string_view{b.c_str(), b.size()}); },
        "data"_a, "Standard base64 (RFC 4648, padded).");
}

}  // namespace routing_replay::python
