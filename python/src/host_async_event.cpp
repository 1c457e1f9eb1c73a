/// @file
/// Host module: the async_event instantiations (one translation unit per copy strategy, so that cores
/// build them at once).
#include "instances.hpp"

namespace routing_replay::python {

void register_host_async_event(factory_table& table)
{
  add_copy_strategy<host_backend, async_event>(table, "host");
}

}  // namespace routing_replay::python
