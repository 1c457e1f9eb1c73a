/// @file
/// routing_replay._core: the module, the host backend's instantiations and types (Config,
/// HostStream, HostEvent), and NativeReplay, every Python-facing replay (the CUDA module,
/// _core_cuda, creates replays of this same class). Each part of the binding registers its calls
/// here (bindings.hpp lists them); the Python layer (routing_replay/_replay.py) turns arrays and
/// streams into the pointers and handles taken here.
#include "bindings.hpp"
#include "handle.hpp"
#include "instances/instance_registry.hpp"
#include "instances/jit_loader.hpp"
#include "replay_base.hpp"
#include "slot_rows/slot_rows_bindings.hpp"
#include "row_streams/stream_bindings.hpp"

#include <routing_replay/config.hpp>
#include <routing_replay/host_backend.hpp>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

using namespace nb::literals;

namespace routing_replay::python {
namespace {

/// The host instantiations: those compiled ahead, plus the units loaded on first use (_load_instances).
factory_table& host_factories()
{
  static factory_table table = [] {
    factory_table t;
    register_host_instances(t);
    return t;
  }();
  return table;
}

std::vector<std::string> keys_of(const factory_table& t)
{
  std::vector<std::string> keys;
  for (const auto& [key, factory] : t) { keys.push_back(key); }
  return keys;
}

std::uintptr_t host_stream_handle(host_stream& s) { return reinterpret_cast<std::uintptr_t>(&s); }  // NOLINT

}  // namespace

}  // namespace routing_replay::python

namespace rp = routing_replay::python;
namespace rr = routing_replay;

/// @brief The Python module routing_replay._core.
NB_MODULE(_core, m)
{
  m.doc() = "routing_replay host backend and the classes shared by every backend (see routing_replay)";

  rp::bind_errors(m);
  rp::bind_wire(m);

  nb::dict dtypes;
  for (int d = 0; d <= static_cast<int>(rp::dtype_code::u64); ++d) {
    dtypes[rp::dtype_name(static_cast<rp::dtype_code>(d))] = d;
  }
  m.attr("DTYPES") = dtypes;

  nb::class_<rr::replay_config>(m, "Config", "routing_replay::replay_config: sizes and the layer map")
    .def(nb::init<>())
    .def_rw("num_experts", &rr::replay_config::num_experts, "E: routed experts per MoE layer")
    .def_rw("top_k", &rr::replay_config::top_k, "K: experts per token and layer")
    .def_rw("num_fused_shared_experts", &rr::replay_config::num_fused_shared_experts,
            "extra router-output columns after the first K, skipped")
    .def_rw("max_tokens_per_step", &rr::replay_config::max_tokens_per_step, "N_max: most rows of one step")
    .def_rw("max_model_len", &rr::replay_config::max_model_len, "positions lie in [0, max_model_len)")
    .def_rw("num_model_layers", &rr::replay_config::num_model_layers, "model layers, 0: one past the last MoE layer")
    .def_rw("moe_layers", &rr::replay_config::moe_layers, "the layer map: model layer of each captured layer")
    .def_rw("block_size", &rr::replay_config::block_size, "block_slot storage: tokens per KV block")
    .def_rw("num_blocks", &rr::replay_config::num_blocks, "block_slot storage: KV blocks")
    .def_rw("host_memory_limit", &rr::replay_config::host_memory_limit, "cap on host bytes of stored rows")
    .def_rw("host_memory_ahead", &rr::replay_config::host_memory_ahead,
            "per-request storage: host bytes a worker thread keeps mapped ahead of need (-1: one step's rows; 0: none)")
    .def_rw("overwrite_recomputed_rows", &rr::replay_config::overwrite_recomputed_rows,
            "preemption: keep the latest routing of a position instead of the first");

  nb::class_<rr::host_stream>(m, "HostStream",
                              "A host-backend stream: an in-order worker thread (the host analogue of a CUDA "
                              "stream). Replays on the host backend run their kernels and copies on these.")
    .def(nb::init<>())
    .def("synchronize", &rr::host_stream::synchronize, nb::call_guard<nb::gil_scoped_release>(),
         "Waits for everything enqueued so far; raises Error(backend_error) if a task failed.")
    .def_prop_ro("handle", &rp::host_stream_handle, "The integer handle the native calls take.");

  nb::class_<rr::host_event>(m, "HostEvent", "A host-backend event: a completion flag with CUDA event semantics.")
    .def(nb::init<>())
    .def("record", [](rr::host_event& e, rr::host_stream& s) { rr::host_backend::record(e, s.ref()); },
         "stream"_a, "Marks the work enqueued on `stream` so far.")
    .def("ready", [](const rr::host_event& e) { return rr::host_backend::ready(e); },
         "Whether the work marked by the latest record has run.")
    .def("synchronize", [](const rr::host_event& e) { rr::host_backend::synchronize(e); },
         nb::call_guard<nb::gil_scoped_release>(), "Waits for the work marked by the latest record.");

  rp::bind_plans(m);

  nb::class_<rp::replay_handle> native(m, "NativeReplay",
                                       "One compiled RoutingReplay instantiation (internal: use Replay).");
  native
    .def_prop_ro("policies",
                 [](const rp::replay_handle& h) {
                   const auto& p = h.impl->policies();
                   nb::dict d;
                   d["backend"] = p.backend;
                   d["index"]   = p.index;
                   d["layout"]  = p.layout;
                   d["copy"]    = p.copy;
                   d["storage"] = p.storage;
                   return d;
                 })
    .def_prop_ro("index_dtype", [](const rp::replay_handle& h) { return rp::dtype_name(h.impl->index_dtype()); })
    .def_prop_ro("on_host", [](const rp::replay_handle& h) { return h.backend == rp::backend_kind::host; })
    .def_prop_ro("device", [](const rp::replay_handle& h) { return h.device_id; })
    .def_prop_ro("config", [](const rp::replay_handle& h) { return h.impl->config(); })
    .def_prop_ro("num_layers", [](const rp::replay_handle& h) { return h.impl->num_layers(); })
    .def_prop_ro("device_bytes", [](const rp::replay_handle& h) { return h.impl->device_bytes(); })
    .def_prop_ro("snapshot_bytes", [](const rp::replay_handle& h) { return h.impl->snapshot_bytes(); })
    .def_prop_ro("staging_bytes", [](const rp::replay_handle& h) { return h.impl->staging_bytes(); })
    .def_prop_ro("host_bytes", [](const rp::replay_handle& h) { return h.impl->host_bytes(); })
    .def_prop_ro("steps_in_flight", [](const rp::replay_handle& h) { return h.impl->steps_in_flight(); })
    .def_prop_ro("num_requests", [](const rp::replay_handle& h) { return h.impl->num_requests(); })
    .def("wait_for_host_memory_ahead", [](const rp::replay_handle& h) { h.impl->wait_for_host_memory_ahead(); },
         nb::call_guard<nb::gil_scoped_release>(),
         "Blocks until the host row memory kept ahead of need is mapped and registered.")
    .def_prop_ro("live_views", [](const rp::replay_handle& h) { return h.live_views; })
    .def_prop_ro("host_memory_growth",
                 [](const rp::replay_handle& h) {
                   const rr::host_memory_growth g = h.impl->host_memory_growth();
                   nb::dict d;
                   d["superblocks_ahead"]   = g.superblocks_ahead;
                   d["superblocks_in_step"] = g.superblocks_in_step;
                   d["superblock_bytes"]    = g.superblock_bytes;
                   return d;
                 },
                 "Per-request storage: superblocks of row memory taken ready from the background thread, and "
                 "mapped on the engine's thread in a step (none was ready).")
    .def("layer_slot", [](const rp::replay_handle& h, std::int32_t layer) { return h.impl->layer_slot(layer); })
    .def("hold_stream", [](rp::replay_handle& h, rr::host_stream& s) { h.hold_stream(nb::find(&s)); },
         "Host backend: keeps a stream alive with the replay, which waits for it before it is destroyed.");
  rp::bind_steps(native);
  rp::bind_capture(native);
  rp::bind_extraction(m, native);

  m.def("policies", [] { return rp::keys_of(rp::host_factories()); },
        "The compiled host-backend instantiations, as 'index/layout/copy/storage'.");
  m.def("create",
        [](const std::string& index, const std::string& layout, const std::string& copy, const std::string& storage,
           const rr::replay_config& config, rr::host_stream* copy_stream, bool staging) {
          std::optional<std::uintptr_t> cs;
          if (copy_stream != nullptr) { cs = rp::host_stream_handle(*copy_stream); }
          rp::replay_handle h = rp::create_replay(rp::host_factories(), {"host", index, layout, copy, storage}, config,
                                                  cs, staging, rp::backend_kind::host, 0);
          if (copy_stream != nullptr) { h.hold_stream(nb::find(copy_stream)); }
          return h;
        },
        "index"_a, "layout"_a, "copy"_a, "storage"_a, "config"_a, "copy_stream"_a.none() = nb::none(),
        "staging"_a = false, "Creates a host-backend replay (internal: use routing_replay.Replay).");
  m.def("_load_instances", [](const std::string& path) { rp::load_instances(rp::host_factories(), path); }, "path"_a,
        "Internal (routing_replay._jit): loads a unit of host instantiations compiled on first use.");
  rp::bind_kept(m);              // host memory faulted in ahead for copies a consumer keeps
  rp::bind_slot_rows(m);         // routing_replay.sglang
  rp::bind_records(native);      // route records from storage (after SlotRows, which it extends)
  rp::register_vllm_streams(m);  // routing_replay.vllm
}
