/// @file
/// faulty_backend<Base>: a backend policy that wraps a real one (host_backend, or cuda_backend in a
/// CUDA translation unit) and can make any of its operations fail, as the runtime under it would:
/// - creating a stream or an event: routing_replay::error backend_error (cudaStreamCreate,
///   cudaEventCreate), before anything is created;
/// - a device or pinned allocation (the backend's vectors): std::bad_alloc, as Thrust's allocators
///   throw (the library does not translate it);
/// - a copy, fill, kernel launch (bulk_async, launch_async, launch_dependent_async), event record or
///   stream wait: backend_error, and nothing is enqueued (a failed launch);
/// - registering host memory for kernels to write (cudaHostRegister): backend_error, nothing
///   registered;
/// - unregistering it (cudaHostUnregister, whose errors the library ignores by contract: it is
///   noexcept, called on teardown): counted, and when it fails nothing is unregistered and nothing
///   is thrown (fault_kind::ignored);
/// - an event query: backend_error;
/// - waiting for an event or a stream: backend_error after the wait, as a sticky error reported by
///   cudaEventSynchronize arrives once the work is over.
/// Every failure point counts in rr_test::fault_injector (fault_injection.hpp), which fails the
/// armed one. The engine's own buffers and kernels use `base_backend`, so they never count.
#pragma once

#include "fault_injection.hpp"

#include <routing_replay/detail/macros.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

namespace rr_test {

namespace detail_fault {

/// @brief The same vector template with another allocator: std::vector, thrust::device_vector and
/// thrust::host_vector all take (T, Allocator).
template <class Vector, class Allocator>
struct with_allocator;
template <template <class, class> class Vector, class T, class A, class Allocator>
struct with_allocator<Vector<T, A>, Allocator> {
  using type = Vector<T, Allocator>;
};

struct device_memory {
  static constexpr const char* name = "device allocation";
};
struct pinned_memory {
  static constexpr const char* name = "pinned allocation";
};

/// @brief An allocator that is a failure point, then allocates with the allocator it wraps.
template <class T, class Base, class Kind>
class faulty_allocator : public Base {
 public:
  using value_type = T;
  template <class U>
  struct rebind {
    using other = faulty_allocator<U, typename std::allocator_traits<Base>::template rebind_alloc<U>, Kind>;
  };

  faulty_allocator() = default;
  template <class U, class B>
  faulty_allocator(const faulty_allocator<U, B, Kind>& other) noexcept : Base(static_cast<const B&>(other))  // NOLINT
  {
  }

  /// @brief Allocates `n` elements unless this allocation is the one that fails.
  auto allocate(std::size_t n)
  {
    fault_injector::get().allocation_point(Kind::name);
    return Base::allocate(n);
  }

  friend bool operator==(const faulty_allocator&, const faulty_allocator&) noexcept { return true; }
  friend bool operator!=(const faulty_allocator&, const faulty_allocator&) noexcept { return false; }
};

template <class Vector, class Kind>
using faulty_vector = typename with_allocator<
  Vector,
  faulty_allocator<typename Vector::value_type, typename Vector::allocator_type, Kind>>::type;

/// @brief Base class that makes constructing an object a failure point, before the object's own
/// base (the real stream or event) is constructed.
template <class Tag>
struct creation_point {
  creation_point() { fault_injector::get().backend_point(Tag::name, fault_kind::create); }
};
struct stream_creation {
  static constexpr const char* name = "stream creation";
};
struct event_creation {
  static constexpr const char* name = "event creation";
};

}  // namespace detail_fault

/// @brief See the file comment.
template <class Base>
struct faulty_backend {
  /// @brief The backend wrapped; the engine's own buffers and kernels use it directly.
  using base_backend = Base;
  /// @brief As the wrapped backend's.
  using stream_ref = typename Base::stream_ref;

  /// @brief An owning stream whose creation can fail.
  class stream : private detail_fault::creation_point<detail_fault::stream_creation>, public Base::stream {
   public:
    using Base::stream::ref;
  };
  /// @brief An owning event whose creation can fail.
  class event : private detail_fault::creation_point<detail_fault::event_creation>, public Base::event {};

  /// @brief Device memory whose allocation can fail.
  template <class T>
  using device_vector =
    detail_fault::faulty_vector<typename Base::template device_vector<T>, detail_fault::device_memory>;
  /// @brief Pinned memory whose allocation can fail.
  template <class T>
  using pinned_vector =
    detail_fault::faulty_vector<typename Base::template pinned_vector<T>, detail_fault::pinned_memory>;

  /// @brief Human-readable name.
  static constexpr const char* name = "faulty";

  [[nodiscard]] static bool available() noexcept { return Base::available(); }

  template <class Vector>
  [[nodiscard]] static auto* data(Vector& v) noexcept
  {
    return Base::data(v);
  }

  static void copy_2d_async(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch,
                            std::size_t width, std::size_t height, stream_ref s)
  {
    enqueue("copy_2d_async", [&] { Base::copy_2d_async(dst, dst_pitch, src, src_pitch, width, height, s); });
  }
  static void copy_async(void* dst, const void* src, std::size_t bytes, stream_ref s)
  {
    enqueue("copy_async", [&] { Base::copy_async(dst, src, bytes, s); });
  }
  static void fill_2d_async(void* dst, std::size_t pitch, unsigned char value, std::size_t width,
                            std::size_t height, stream_ref s)
  {
    enqueue("fill_2d_async", [&] { Base::fill_2d_async(dst, pitch, value, width, height, s); });
  }
  template <class Op>
  static void bulk_async(std::int64_t n, Op op, stream_ref s)
  {
    enqueue("bulk_async", [&] { Base::bulk_async(n, op, s); });
  }
  template <class Op>
  static void launch_async(std::int32_t num_blocks, std::int32_t block_threads, Op op, stream_ref s)
  {
    enqueue("launch_async", [&] { Base::launch_async(num_blocks, block_threads, op, s); });
  }
  template <class Op>
  static void launch_dependent_async(std::int32_t num_blocks, std::int32_t block_threads, Op op, stream_ref s)
  {
    enqueue("launch_dependent_async", [&] { Base::launch_dependent_async(num_blocks, block_threads, op, s); });
  }
  static void register_host(void* p, std::size_t bytes)
  {
    fault_injector::backend_op_scope scope{"register_host", fault_kind::enqueue};
    fault_injector::get().backend_point("register_host", fault_kind::enqueue);
    Base::register_host(p, bytes);
  }
  static void unregister_host(void* p) noexcept
  {
    if (fault_injector::get().ignored_point("unregister_host")) { return; }  // the error is ignored
    Base::unregister_host(p);
  }
  // a pinned allocation, as the pinned vectors' (std::bad_alloc, which the library does not translate)
  [[nodiscard]] static void* allocate_pinned(std::size_t bytes)
  {
    fault_injector::get().allocation_point("allocate_pinned");
    return Base::allocate_pinned(bytes);
  }
  static void free_pinned(void* p, std::size_t bytes) noexcept { Base::free_pinned(p, bytes); }
  using host_thread_state = typename Base::host_thread_state;
  static host_thread_state host_thread_context() { return Base::host_thread_context(); }
  // on the arena's worker thread: its failure only stops the pinning ahead (the engine's thread then
  // pins what it needs itself), which the sweep covers through register_host
  static void adopt_host_thread_context(host_thread_state s) { Base::adopt_host_thread_context(s); }
  static void record(event& e, stream_ref s)
  {
    enqueue("record", [&] { Base::record(e, s); });
  }
  static void wait(stream_ref s, const event& e)
  {
    enqueue("wait", [&] { Base::wait(s, e); });
  }
  [[nodiscard]] static bool ready(const event& e)
  {
    fault_injector::backend_op_scope scope{"ready", fault_kind::query};
    fault_injector::get().backend_point("ready", fault_kind::query);
    return Base::ready(e);
  }
  static void synchronize(const event& e)
  {
    fault_injector::backend_op_scope scope{"synchronize(event)", fault_kind::wait};
    Base::synchronize(e);
    fault_injector::get().backend_point("synchronize(event)", fault_kind::wait);
  }
  static void synchronize(stream_ref s)
  {
    fault_injector::backend_op_scope scope{"synchronize(stream)", fault_kind::wait};
    Base::synchronize(s);
    fault_injector::get().backend_point("synchronize(stream)", fault_kind::wait);
  }

 private:
  // A failed enqueue enqueues nothing; a host allocation failing inside the real one counts as a
  // failed enqueue too.
  template <class F>
  static void enqueue(const char* op, F&& f)
  {
    fault_injector::backend_op_scope scope{op, fault_kind::enqueue};
    fault_injector::get().backend_point(op, fault_kind::enqueue);
    f();
  }
};

}  // namespace rr_test
