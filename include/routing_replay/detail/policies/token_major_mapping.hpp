/// @file
/// The mdspan mapping behind routing_replay::token_major.
#pragma once

#include <routing_replay/detail/macros.hpp>

#include <cuda/std/mdspan>

namespace routing_replay::detail {

/// @brief Maps (layer, token, k) to ((token * L) + layer) * K + k: a token's [L, K] row is contiguous.
///
/// Satisfies the standard LayoutMapping requirements so that cuda::std::mdspan accepts it; the
/// logical index order stays (layer, token, k) for every layout, so code never branches on layout.
template <class Layout, class Extents>
class token_major_mapping {
  static_assert(Extents::rank() == 3, "the routing buffer is (layer, token, k)");

 public:
  using extents_type = Extents;
  using index_type   = typename Extents::index_type;
  using size_type    = typename Extents::size_type;
  using rank_type    = typename Extents::rank_type;
  using layout_type  = Layout;

  constexpr token_major_mapping() noexcept = default;

  ROUTING_REPLAY_HOST_DEVICE constexpr explicit token_major_mapping(const extents_type& e) noexcept
    : extents_(e)
  {
  }

  [[nodiscard]] ROUTING_REPLAY_HOST_DEVICE constexpr const extents_type& extents() const noexcept
  {
    return extents_;
  }

  [[nodiscard]] ROUTING_REPLAY_HOST_DEVICE constexpr index_type required_span_size() const noexcept
  {
    return extents_.extent(0) * extents_.extent(1) * extents_.extent(2);
  }

  template <class Layer, class Token, class K>
  [[nodiscard]] ROUTING_REPLAY_HOST_DEVICE constexpr index_type operator()(Layer layer,
                                                                           Token token,
                                                                           K k) const noexcept
  {
    return (static_cast<index_type>(token) * extents_.extent(0) + static_cast<index_type>(layer)) *
             extents_.extent(2) +
           static_cast<index_type>(k);
  }

  ROUTING_REPLAY_HOST_DEVICE static constexpr bool is_always_unique() noexcept { return true; }
  ROUTING_REPLAY_HOST_DEVICE static constexpr bool is_always_exhaustive() noexcept { return true; }
  ROUTING_REPLAY_HOST_DEVICE static constexpr bool is_always_strided() noexcept { return true; }
  ROUTING_REPLAY_HOST_DEVICE static constexpr bool is_unique() noexcept { return true; }
  ROUTING_REPLAY_HOST_DEVICE static constexpr bool is_exhaustive() noexcept { return true; }
  ROUTING_REPLAY_HOST_DEVICE static constexpr bool is_strided() noexcept { return true; }

  [[nodiscard]] ROUTING_REPLAY_HOST_DEVICE constexpr index_type stride(rank_type r) const noexcept
  {
    // layer steps over one [K] group, token over a whole [L, K] row, k over one element
    return r == 0 ? extents_.extent(2)
                  : (r == 1 ? extents_.extent(0) * extents_.extent(2) : index_type{1});
  }

  [[nodiscard]] ROUTING_REPLAY_HOST_DEVICE friend constexpr bool operator==(
    const token_major_mapping& a, const token_major_mapping& b) noexcept
  {
    return a.extents_ == b.extents_;
  }

 private:
  extents_type extents_{};
};

}  // namespace routing_replay::detail
