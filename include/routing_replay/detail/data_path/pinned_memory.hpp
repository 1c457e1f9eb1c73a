/// @file
/// The backend's pinned host memory as a std::pmr memory resource, for containers whose elements
/// the host writes and a kernel then reads in place: the device scatter's op lists
/// (step_record::ops), which the planner writes at begin_step() and the scatter reads, uncopied.
#pragma once

#include <cstddef>
#include <memory_resource>
#include <new>

namespace routing_replay::detail {

/// @brief Allocates with `Backend::allocate_pinned` and frees with `Backend::free_pinned`.
/// Stateless, so one per backend serves every replay; get() never destroys it, so that a replay
/// destroyed during static destruction still frees into a live resource.
template <class Backend>
class pinned_memory_resource final : public std::pmr::memory_resource {
 public:
  /// @brief The backend's resource.
  [[nodiscard]] static pinned_memory_resource* get() noexcept
  {
    static auto* const resource = new pinned_memory_resource{};  // immortal, see above
    return resource;
  }

 private:
  pinned_memory_resource() = default;

  void* do_allocate(std::size_t bytes, std::size_t alignment) override
  {
    // both backends' pinned memory is aligned at least as operator new's
    if (alignment > __STDCPP_DEFAULT_NEW_ALIGNMENT__) { throw std::bad_alloc{}; }
    return Backend::allocate_pinned(bytes);
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t) noexcept override { Backend::free_pinned(p, bytes); }
  [[nodiscard]] bool do_is_equal(const std::pmr::memory_resource& other) const noexcept override
  {
    return this == &other;
  }
};

}  // namespace routing_replay::detail
