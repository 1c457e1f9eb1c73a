/// @file
/// Index-type policy: which integer type holds expert ids, and which of its values is the sentinel.
#pragma once

#include <routing_replay/detail/macros.hpp>

#include <cuda/std/cstdint>
#include <cuda/std/limits>
#include <cuda/std/type_traits>

#include <cstdint>

namespace routing_replay {

/// @brief An integer type that stores logical expert ids on the device and on the host.
///
/// Any integral type of at most 32 bits other than bool. One value is reserved as the sentinel that
/// marks a missing row, so a type holds at most index_traits<T>::max_experts experts.
template <class T>
concept expert_index =
  cuda::std::is_integral_v<T> && !cuda::std::is_same_v<T, bool> && (sizeof(T) <= 4);

/// @brief An integer type that a router may hand to capture(): int64 from torch.topk, int32, int16...
template <class T>
concept source_index = cuda::std::is_integral_v<T> && !cuda::std::is_same_v<T, bool>;

/// @brief Sentinel and capacity of an expert_index type.
///
/// The sentinel is -1 for signed types and the maximum value for unsigned ones: in both cases every
/// byte is 0xFF, so one byte-wise fill resets device buffers and host storage of any index type.
template <expert_index Index>
struct index_traits {
  /// @brief The value that marks "no routing recorded"; never a valid expert id.
  static constexpr Index sentinel =
    cuda::std::is_signed_v<Index> ? Index(-1) : cuda::std::numeric_limits<Index>::max();

  /// @brief The largest number of experts E whose ids [0, E) all differ from the sentinel.
  static constexpr std::int64_t max_experts =
    cuda::std::is_signed_v<Index>
      ? static_cast<std::int64_t>(cuda::std::numeric_limits<Index>::max()) + 1
      : static_cast<std::int64_t>(cuda::std::numeric_limits<Index>::max());

  /// @brief The byte that, repeated, spells the sentinel.
  static constexpr unsigned char sentinel_byte = 0xFF;

  /// @brief Whether `id` is a valid expert id for a model with `num_experts` experts.
  ROUTING_REPLAY_HOST_DEVICE static constexpr bool is_valid(std::int64_t id,
                                                            std::int64_t num_experts) noexcept
  {
    return id >= 0 && id < num_experts;
  }
};

}  // namespace routing_replay
