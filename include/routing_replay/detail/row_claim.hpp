/// @file
/// What a store answers when a row is claimed: where it goes and where it comes from.
#pragma once

namespace routing_replay::detail {

/// @brief Where a claimed row comes from: the step's own row (written to `dst`), a copy of an
/// earlier row of the same position (`copy_from`, after preemption into new blocks), or nothing
/// (`dst` null: the existing row stays).
template <class Index>
struct row_claim {
  Index* dst             = nullptr;  ///< where the row goes; nullptr: the existing row stays
  const Index* copy_from = nullptr;  ///< non-null: dst receives this row instead of the step's
};

}  // namespace routing_replay::detail
