/// @file
/// byte_buffer: the route record encoder's growable byte buffer, a std::vector whose `resize`
/// does not zero the new bytes. The encoder grows its payload by a chunk's packed size and then
/// writes every byte of it, so clearing them first would be a wasted pass over the payload; this
/// is its own file because it is a memory detail, not part of the record's layout or encoding.
#pragma once

#include <routing_replay/detail/wire/abi.hpp>

#include <cstddef>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace routing_replay::detail::wire {
ROUTING_REPLAY_WIRE_ABI_BEGIN

/// std::allocator, but `resize` leaves new elements default-initialized (bytes: not zeroed): a
/// buffer the encoder writes whole right after growing it need not be cleared first.
template <class T>
struct uninitialized_allocator : std::allocator<T> {
  /// @brief The same allocator for another element type (the containers' rebind protocol).
  template <class U>
  struct rebind {
    using other = uninitialized_allocator<U>;  ///< the rebound allocator
  };
  /// @brief A stateless allocator.
  uninitialized_allocator() = default;
  /// @brief Converts from the allocator of another element type (it holds nothing).
  template <class U>
  uninitialized_allocator(const uninitialized_allocator<U>&) noexcept {}
  /// @brief Default-initializes `*p`: for bytes, leaves them as they are.
  template <class U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>)
  {
    ::new (static_cast<void*>(p)) U;
  }
  /// @brief Constructs `*p` from `args`, as std::allocator does.
  template <class U, class... Args>
  void construct(U* p, Args&&... args)
  {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
/// A byte buffer that grows without clearing.
using byte_buffer = std::vector<std::byte, uninitialized_allocator<std::byte>>;

ROUTING_REPLAY_WIRE_ABI_END
}  // namespace routing_replay::detail::wire
