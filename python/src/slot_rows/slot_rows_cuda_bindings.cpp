/// @file
/// routing_replay._core_cuda's binding of slot_rows: create_slot_rows on the current CUDA device
/// (SlotRows and SlotRowsConfig are bound by routing_replay._core, which this module imports first).
#include "instances/cuda_instances.hpp"
#include "slot_rows_bindings.hpp"

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

namespace nb = nanobind;
using namespace nb::literals;

namespace routing_replay::python {

void bind_cuda_slot_rows(nb::module_& m)
{
  m.def("create_slot_rows",
        [](const std::string& index, const slot_rows_config& config) {
          static const slot_rows_factories table = [] {
            slot_rows_factories t;
            register_cuda_slot_rows(t);
            return t;
          }();
          return create_slot_rows(table, index, config, backend_kind::cuda, cuda_current_device());
        },
        "index"_a, "config"_a, "Creates a CUDA-backend SlotRows on the current device (internal).");
}

}  // namespace routing_replay::python
