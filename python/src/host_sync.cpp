/// @file
/// Host module: the sync_copy instantiations (one translation unit per copy strategy, so that cores
/// build them at once).
#include "instances.hpp"

namespace routing_replay::python {

void register_host_sync(factory_table& table)
{
  add_copy_strategy<host_backend, sync_copy>(table, "host");
}

}  // namespace routing_replay::python
