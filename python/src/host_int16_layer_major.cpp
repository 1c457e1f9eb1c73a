/// @file
/// Host module: the int16 layer major instantiations (instances.hpp lists the set).
#include "instances.hpp"

namespace routing_replay::python {

void register_host_int16_layer_major(factory_table& table) { add_int16<host_backend, layer_major>(table, "host"); }

}  // namespace routing_replay::python
