/// @file
/// Buffer-layout policy: how the device buffer D orders (layer, token, k).
#pragma once

#include <routing_replay/detail/policies/token_major_mapping.hpp>

#include <cuda/std/concepts>
#include <cuda/std/cstdint>
#include <cuda/std/mdspan>
#include <cuda/std/type_traits>

namespace routing_replay {

/// @brief Extents of the device buffer D, always indexed as (layer, token, k) whatever the layout.
using buffer_extents = cuda::std::dextents<std::int32_t, 3>;

/// @brief Layer-major (L, N, K): each layer owns a contiguous row-major (N, K) slab.
///
/// Fused MoE kernels that write routing themselves (FlashInfer's `routing_replay_out`) need this:
/// their output argument is one contiguous [num_tokens, K] array per layer.
using layer_major = cuda::std::layout_right;

/// @brief Token-major (N, L, K): each token's [L, K] row is contiguous.
///
/// The host side wants whole rows (one memcpy per token into storage), and so do sequence-parallel
/// gathers that move token shards between ranks.
struct token_major {
  /// @brief The mdspan mapping of this layout.
  template <class Extents>
  using mapping = detail::token_major_mapping<token_major, Extents>;
};

/// @brief Static facts about a buffer layout that the copy and scatter paths rely on.
template <class Layout>
struct layout_traits;

/// @brief layer_major: rows of one token are L separate groups of K ids.
template <>
struct layout_traits<layer_major> {
  /// @brief Whether a token's [L, K] row is contiguous in D.
  static constexpr bool token_rows_contiguous = false;
  /// @brief Human-readable name, used by the demo and the benchmarks.
  static constexpr const char* name = "layer_major";
};

/// @brief token_major: rows are contiguous.
template <>
struct layout_traits<token_major> {
  /// @brief Whether a token's [L, K] row is contiguous in D.
  static constexpr bool token_rows_contiguous = true;
  /// @brief Human-readable name, used by the demo and the benchmarks.
  static constexpr const char* name = "token_major";
};

/// @brief A layout of the device buffer: a real cuda::std::mdspan layout policy over
/// (layer, token, k) for which layout_traits says whether token rows are contiguous.
template <class Layout>
concept buffer_layout =
  requires { typename Layout::template mapping<buffer_extents>; } &&
  cuda::std::is_same_v<decltype(layout_traits<Layout>::token_rows_contiguous), const bool>;

/// @brief The mdspan type of the device buffer for an index type and a layout.
template <class Index, class Layout>
using buffer_mdspan = cuda::std::mdspan<Index, buffer_extents, Layout>;

}  // namespace routing_replay
