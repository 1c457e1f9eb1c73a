/// @file
/// Host module: the slot_rows instantiations (slot_rows_impl.hpp).
#include "slot_rows_impl.hpp"

namespace routing_replay::python {

void register_host_slot_rows(slot_rows_factories& table) { add_slot_rows<host_backend>(table); }

}  // namespace routing_replay::python
