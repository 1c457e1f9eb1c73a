/// @file
/// One piece of a step's rows on its way to host storage: where it goes and where it comes from.
#pragma once

#include <cstdint>

namespace routing_replay::detail {

/// @brief A run of ids to place: consecutive rows of the step going to consecutive ids of storage
/// (a request's positions, or consecutive KV slots), or copied from an earlier row of the same
/// position (a row following its position to a new slot). The host files these from the staging;
/// a device scatter's kernel writes them straight into mapped host memory, one block per piece.
template <class Index>
struct scatter_op {
  Index* dst;              ///< where the ids go (an address kernels reach, for a device scatter)
  const Index* copy_from;  ///< nullptr: the step's ids from `src` on; else these host ids
  std::int64_t src;        ///< first id in the step's token-major [N, L, K] rows
  std::int64_t elems;      ///< ids in the piece
  bool replaces = false;   ///< dst holds rows this step replaces: a discarded step leaves them
};

/// @brief The most ids one piece holds, so that a large run spreads over many blocks.
inline constexpr std::int64_t max_piece_elems = 16384;

}  // namespace routing_replay::detail
