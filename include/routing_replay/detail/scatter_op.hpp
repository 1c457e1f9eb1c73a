/// @file
/// One row of a device-scatter step: where it goes in host storage and where it comes from.
#pragma once

#include <cstdint>

namespace routing_replay::detail {

/// @brief One row of a device-scatter step: where it goes in mapped pinned host storage and where
/// it comes from (the step's snapshot row, or an earlier row of the same position).
template <class Index>
struct scatter_op {
  Index* dst;               ///< the row's place in host storage
  const Index* copy_from;   ///< nullptr: snapshot row `row`; else copy this host row
  std::int64_t row;         ///< row of the step
};

}  // namespace routing_replay::detail
