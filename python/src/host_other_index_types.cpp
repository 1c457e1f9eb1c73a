/// @file
/// Host module: the other index types instantiations (instances.hpp lists the set).
#include "instances.hpp"

namespace routing_replay::python {

void register_host_other_index_types(factory_table& table) { add_other_index_types<host_backend>(table, "host"); }

}  // namespace routing_replay::python
