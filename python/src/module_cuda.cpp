/// @file
/// routing_replay._core_cuda: creates CUDA-backend replays. Every class they use (NativeReplay,
/// Config, StepPlan, Error) is bound by routing_replay._core, which this module imports first.
#include "instances/cuda_instances.hpp"
#include "handle.hpp"
#include "instances/jit_loader.hpp"
#include "slot_rows/slot_rows_bindings.hpp"
#include "row_streams/stream_bindings.hpp"

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;
namespace rp = routing_replay::python;
namespace rr = routing_replay;

namespace {

// the instantiations compiled ahead, plus the units loaded on first use (_load_instances)
rp::factory_table& cuda_factories()
{
  static rp::factory_table table = [] {
    rp::factory_table t;
    rp::register_cuda(t);
    return t;
  }();
  return table;
}

}  // namespace

/// @brief The Python module routing_replay._core_cuda.
NB_MODULE(_core_cuda, m)
{
  m.doc() = "routing_replay CUDA backend: creates replays whose buffers live on the current CUDA device";
  nb::module_::import_("routing_replay._core");  // binds the classes this module returns

  m.def("policies",
        [] {
          std::vector<std::string> keys;
          for (const auto& [key, factory] : cuda_factories()) { keys.push_back(key); }
          return keys;
        },
        "The compiled CUDA instantiations, as 'index/layout/copy/storage'.");
  m.def("available", &rp::cuda_available, "Whether a usable CUDA device is present.");
  m.def("device_count", &rp::cuda_device_count, "Visible CUDA devices.");
  m.def("current_device", &rp::cuda_current_device, "The calling thread's current CUDA device.");
  m.def("set_device", &rp::cuda_set_device, "device"_a, "Makes a CUDA device current for the calling thread.");
  m.def("runtime_version", &rp::cuda_runtime_version, "The CUDA runtime version the module was built with.");
  m.def("_cross_module_check",
        [] {
          rp::plan_holder plan;
          plan.plan.skip(3);
          return plan;
        },
        "Internal: a StepPlan (bound by _core) made in this module, for the tests.");
  m.def("create",
        [](const std::string& index, const std::string& layout, const std::string& copy, const std::string& storage,
           const rr::replay_config& config, std::optional<std::uintptr_t> copy_stream, bool staging) {
          const std::int32_t device = rp::cuda_current_device();
          return rp::create_replay(cuda_factories(), {"cuda", index, layout, copy, storage}, config, copy_stream,
                                   staging, rp::backend_kind::cuda, device);
        },
        "index"_a, "layout"_a, "copy"_a, "storage"_a, "config"_a, "copy_stream"_a = nb::none(), "staging"_a = false,
        "Creates a CUDA-backend replay on the current device (internal: use routing_replay.Replay).");
  m.def("_load_instances", [](const std::string& path) { rp::load_instances(cuda_factories(), path); }, "path"_a,
        "Internal (routing_replay._jit): loads a unit of CUDA instantiations compiled on first use.");
  rp::bind_cuda_slot_rows(m);
  rp::register_cuda_stream_device(m);  // routing_replay.vllm
}
