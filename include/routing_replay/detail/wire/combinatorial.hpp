/// @file
/// The order-free form: one (token, layer) entry's K distinct ids as a set, stored as its rank in
/// the colexicographic combinatorial number system. A set {c_1 < ... < c_K} of [0, E) has rank
/// sum_i C(c_i, i), a bijection onto [0, C(E, K)); ceil(log2 C(E, K)) bits hold it, fewer than
/// K * ceil(log2 E) (41 instead of 56 bits for 8 of 128). Colex rather than lex order: the rank
/// does not depend on E, and unranking needs no table column per remaining span.
#pragma once

#include <routing_replay/detail/wire/abi.hpp>
#include <routing_replay/detail/wire/bit_pack.hpp>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <optional>
#include <vector>

namespace routing_replay::detail::wire {
ROUTING_REPLAY_WIRE_ABI_BEGIN

/// @brief C(n, k) where it is below 2^127, std::nullopt past that.
[[nodiscard]] inline std::optional<uint128> binomial(std::uint32_t n, std::uint32_t k) noexcept
{
  if (k > n) { return uint128{0}; }
  k = std::min(k, n - k);
  uint128 c = 1;
  constexpr uint128 limit = uint128{1} << 127;
  for (std::uint32_t i = 1; i <= k; ++i) {
    // c * (n - k + i) / i stays exact: the product of i consecutive integers divides by i!
    const uint128 factor = n - k + i;
    if (c > (limit - 1) / factor) { return std::nullopt; }
    c = c * factor / i;
  }
  return c;
}

/// @brief Bits of an order-free entry for K of E: ceil(log2 C(E, K)), at least 1; 0 where the
/// rank would not fit 127 bits or the table would pass its limit (the form is refused then).
[[nodiscard]] inline std::uint32_t rank_bits(std::uint32_t num_experts, std::uint32_t top_k,
                                             std::uint64_t table_limit) noexcept
{
  if (top_k == 0 || top_k > num_experts) { return 0; }
  if (std::uint64_t{num_experts} * (top_k + 1) > table_limit) { return 0; }
  const auto c = binomial(num_experts, top_k);
  if (!c) { return 0; }
  if (*c <= 1) { return 1; }
  const uint128 top = *c - 1;
  const auto hi     = static_cast<std::uint64_t>(top >> 64);
  const auto lo     = static_cast<std::uint64_t>(top);
  return hi != 0 ? 64 + static_cast<std::uint32_t>(std::bit_width(hi)) : static_cast<std::uint32_t>(std::bit_width(lo));
}

/// @brief C(n, i) for n in [0, E), i in [0, K], and the ranks of sets of K of E.
class combinatorial_table {
 public:
  combinatorial_table() = default;

  /// @pre rank_bits(num_experts, top_k, ...) != 0
  combinatorial_table(std::uint32_t num_experts, std::uint32_t top_k)
    : experts_(num_experts), k_(top_k), table_(std::size_t{num_experts} * (top_k + 1))
  {
    // Pascal's rule: additions only (a reader builds this table every time it opens an order-free
    // record). Within the limits every entry fits: C(n, i) <= C(E - 1, K) < C(E, K) < 2^127 for
    // K <= E / 2, and K > E / 2 means E <= 128, where C(127, 63) < 2^127 too.
    for (std::uint32_t n = 0; n < num_experts; ++n) {
      at(n, 0) = 1;
      for (std::uint32_t i = 1; i <= top_k; ++i) { at(n, i) = n == 0 ? 0 : at(n - 1, i - 1) + at(n - 1, i); }
    }
    count_ = *binomial(num_experts, top_k);
  }

  /// @brief C(E, K): every rank is below it.
  [[nodiscard]] uint128 count() const noexcept { return count_; }

  /// @brief The rank of K ids; std::nullopt where two are equal (not a set). Ids are < E.
  [[nodiscard]] std::optional<uint128> rank(const std::uint16_t* ids) const noexcept
  {
    std::uint16_t sorted[64] = {};  // K <= 64; zeroed for the compiler, which cannot see that bound
    std::copy(ids, ids + k_, sorted);
    std::sort(sorted, sorted + k_);
    uint128 r = 0;
    for (std::uint32_t i = 0; i < k_; ++i) {
      if (i > 0 && sorted[i] == sorted[i - 1]) { return std::nullopt; }
      r += at(sorted[i], i + 1);
    }
    return r;
  }

  /// @brief The K ids, ascending, of rank `r` < count().
  void unrank(uint128 r, std::uint16_t* out) const noexcept
  {
    std::uint32_t hi = experts_;  // c_i < hi: the ids are distinct and descending from the top
    for (std::uint32_t i = k_; i >= 1; --i) {
      // the largest c in [i - 1, hi) with C(c, i) <= r (C(i - 1, i) = 0 always qualifies)
      std::uint32_t lo = i - 1, top = hi - 1;
      while (lo < top) {
        const std::uint32_t mid = lo + (top - lo + 1) / 2;
        if (at(mid, i) <= r) {
          lo = mid;
        } else {
          top = mid - 1;
        }
      }
      out[i - 1] = static_cast<std::uint16_t>(lo);
      r -= at(lo, i);
      hi = lo;
    }
  }

 private:
  [[nodiscard]] uint128& at(std::uint32_t n, std::uint32_t i) noexcept { return table_[std::size_t{n} * (k_ + 1) + i]; }
  [[nodiscard]] const uint128& at(std::uint32_t n, std::uint32_t i) const noexcept
  {
    return table_[std::size_t{n} * (k_ + 1) + i];
  }

  std::uint32_t experts_ = 0;
  std::uint32_t k_       = 0;
  std::vector<uint128> table_;
  uint128 count_ = 0;
};

ROUTING_REPLAY_WIRE_ABI_END
}  // namespace routing_replay::detail::wire
