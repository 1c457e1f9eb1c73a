/// @file
/// What a store answers when a row is claimed: where it goes and where it comes from.
#pragma once

#include <cstdint>

namespace routing_replay::detail {

/// @brief Where a claimed row comes from: the step's own row (written to `dst`), a copy of an
/// earlier row of the same position (`copy_from`, after preemption into new blocks), or nothing
/// (`dst` null: the existing row stays).
template <class Index>
struct row_claim {
  Index* dst             = nullptr;  ///< where the row goes; nullptr: the existing row stays
  const Index* copy_from = nullptr;  ///< non-null: dst receives this row instead of the step's
  /// The step whose claim of a row already there this one takes over (the row is replaced:
  /// overwrite, or a tentative draft row yielding), or no_claim. A discarded step gives the claim
  /// back and leaves the row.
  std::uint64_t replaced = no_claim;
  /// @brief `replaced` when no row was replaced.
  static constexpr std::uint64_t no_claim = ~std::uint64_t{0};
};

}  // namespace routing_replay::detail
