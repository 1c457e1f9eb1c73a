/// @file
/// Host module: the double_buffered<2> instantiations (one translation unit per copy strategy, so that cores
/// build them at once).
#include "instances.hpp"

namespace routing_replay::python {

void register_host_double_buffered(factory_table& table)
{
  add_copy_strategy<host_backend, double_buffered<2>>(table, "host");
}

}  // namespace routing_replay::python
