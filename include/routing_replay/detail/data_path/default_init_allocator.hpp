/// @file
/// An allocator whose vectors grow without writing their new elements.
#pragma once

#include <memory>
#include <new>
#include <type_traits>
#include <utility>

namespace routing_replay::detail {

/// @brief std::allocator, but value-less construction default-initializes: `resize(n)` of a vector
/// of trivial elements leaves the new ones unwritten, for a writer that fills each of them next.
/// A step record's slots are sized for a run and written by its claims (one pass over the run),
/// where a plain resize() zeroed them first (another pass over a prefill chunk).
template <class T, class Base = std::allocator<T>>
class default_init_allocator : public Base {
  using traits = std::allocator_traits<Base>;

 public:
  /// @brief The same allocator for another element type.
  template <class U>
  struct rebind {
    /// @brief The rebound allocator.
    using other = default_init_allocator<U, typename traits::template rebind_alloc<U>>;
  };

  using Base::Base;

  /// @brief Default-initializes `*p` (no write for a trivial T).
  template <class U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>)
  {
    ::new (static_cast<void*>(p)) U;
  }
  /// @brief Constructs `*p` from `args`, as the base allocator does.
  template <class U, class... Args>
  void construct(U* p, Args&&... args)
  {
    traits::construct(static_cast<Base&>(*this), p, std::forward<Args>(args)...);
  }
};

}  // namespace routing_replay::detail
