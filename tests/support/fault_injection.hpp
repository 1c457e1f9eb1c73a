/// @file
/// The state behind fault injection: which call of the library is running, and which failure point
/// (a backend operation, a device or pinned allocation, or a host allocation through operator new)
/// fails next. fault_backend.hpp counts its operations here; a test translation unit that replaces
/// the global operator new counts host allocations here (fault_host_allocations.hpp);
/// checked_replay.hpp marks every library call and asks afterwards whether a fault fired in it.
///
/// Only the thread that drives the library counts: host-stream worker threads never call the
/// backend's static operations or allocate through the library's containers, and they must not
/// fail by accident. All state is thread_local for that reason.
#pragma once

#include <cstdint>
#include <new>
#include <string>

#include <routing_replay/errors.hpp>

namespace rr_test {

/// @brief What kind of failure point fired: it decides which documented state the call leaves.
enum class fault_kind : std::uint8_t {
  none,
  create,    ///< a stream or event could not be created (constructor: no object)
  allocate,  ///< a device or pinned allocation failed (constructor: no object)
  enqueue,   ///< a copy, fill, kernel launch, event record or stream wait failed to enqueue
  query,     ///< an event query (cudaEventQuery) failed
  wait,      ///< waiting for an event or a stream failed (after the wait, as a sticky error does)
  host_new,  ///< operator new failed outside any backend operation
  ignored,   ///< a call whose errors the library ignores by contract (unregister_host) failed
};

/// @brief Which failure points a sweep arms.
enum class fault_source : std::uint8_t {
  backend,  ///< backend operations, stream and event creation, device and pinned allocations
  host_new, ///< operator new on the driving thread, inside a library call
};

/// @brief The injector: counts failure points of one source and fails the armed one.
class fault_injector {
 public:
  /// @brief The injector of the calling thread.
  static fault_injector& get() noexcept
  {
    thread_local fault_injector instance;
    return instance;
  }

  /// @brief Counts the failure points of `source` from now on without failing any.
  static constexpr std::uint64_t count_only = ~std::uint64_t{0};

  /// @brief Fails the `k`-th failure point (1-based) of `source` from now on (count_only: none),
  /// only within library calls named `only_in_call` if given (host allocations).
  void arm(fault_source source, std::uint64_t k, std::string only_in_call = {})
  {
    source_       = source;
    armed_at_     = k;
    count_        = 0;
    fired_        = 0;
    fired_kind_   = fault_kind::none;
    fired_op_.clear();
    only_in_call_ = std::move(only_in_call);
    only_op_.clear();
  }
  /// @brief Fails the `occurrence`-th backend operation named `op` ("record", "fill_2d_async", ...)
  /// from now on, counting no other failure point: a test that aims at one operation does not
  /// depend on how many others come first.
  void arm_op(std::string op, std::uint64_t occurrence)
  {
    arm(fault_source::backend, occurrence);
    only_op_ = std::move(op);
  }

  /// @brief Stops counting and failing.
  void disarm() noexcept
  {
    armed_at_ = 0;
    source_   = fault_source::backend;
    count_    = 0;
    only_op_.clear();
  }

  /// @brief Whether a sweep is counting (then every call is checked as if it could fail).
  [[nodiscard]] bool armed() const noexcept { return armed_at_ != 0; }
  /// @brief Failure points of the armed source seen since arm().
  [[nodiscard]] std::uint64_t count() const noexcept { return count_; }
  /// @brief How many faults fired since arm() (0 or 1).
  [[nodiscard]] std::uint64_t fired() const noexcept { return fired_; }
  /// @brief The kind of the fault that fired.
  [[nodiscard]] fault_kind fired_kind() const noexcept { return fired_kind_; }
  /// @brief The failure point that fired ("record", "operator new in begin_step", ...).
  [[nodiscard]] const std::string& fired_op() const noexcept { return fired_op_; }

  /// @brief A backend failure point: throws routing_replay::error backend_error if it is the armed one.
  void backend_point(const char* op, fault_kind kind)
  {
    if (!counting(fault_source::backend) || (!only_op_.empty() && only_op_ != op)) { return; }
    if (++count_ == armed_at_) {
      fire(op, kind);
      throw routing_replay::error{routing_replay::errc::backend_error,
                                  std::string{"injected fault: "} + op + " failed"};
    }
  }
  /// @brief A failure point the library ignores by contract (a noexcept teardown call): true if it
  /// must fail; never throws.
  bool ignored_point(const char* op) noexcept
  {
    if (!counting(fault_source::backend) || (!only_op_.empty() && only_op_ != op)) { return false; }
    if (++count_ != armed_at_) { return false; }
    in_hook_ = true;  // fire() builds a string: not a host failure point
    try {
      fire(op, fault_kind::ignored);
    } catch (...) {  // the string could not be built: the fault still fired
      fired_kind_ = fault_kind::ignored;
    }
    in_hook_ = false;
    return true;
  }
  /// @brief A device or pinned allocation: throws std::bad_alloc if it is the armed one (Thrust's
  /// allocation failures derive from it; the library does not translate them).
  void allocation_point(const char* op)
  {
    if (!counting(fault_source::backend) || !only_op_.empty()) { return; }
    if (++count_ == armed_at_) {
      fire(op, fault_kind::allocate);
      throw std::bad_alloc{};
    }
  }
  /// @brief A host allocation (operator new): true if it must fail. Never throws itself (the
  /// replaced operator new does), and never allocates.
  bool host_allocation_fails() noexcept
  {
    if (!counting(fault_source::host_new) || call_depth_ == 0 || in_hook_) { return false; }
    if (!only_in_call_.empty() && only_in_call_ != call_) { return false; }
    if (++count_ != armed_at_) { return false; }
    in_hook_ = true;  // fire() builds a string
    fire(backend_op_ != nullptr ? backend_op_ : "operator new",
         backend_op_ != nullptr ? backend_kind_ : fault_kind::host_new);
    in_hook_ = false;
    return true;
  }

  /// @brief Marks a library call (nested marks keep the outer name).
  class call_scope {
   public:
    explicit call_scope(const char* name) noexcept : injector_(get())
    {
      if (injector_.call_depth_++ == 0) { injector_.call_ = name; }
    }
    call_scope(const call_scope&)            = delete;
    call_scope& operator=(const call_scope&) = delete;
    ~call_scope() { --injector_.call_depth_; }

   private:
    fault_injector& injector_;
  };

  /// @brief Marks a backend operation, so a host allocation failing inside it reports the
  /// operation's kind (a failed enqueue, say) rather than a bare host allocation.
  class backend_op_scope {
   public:
    backend_op_scope(const char* op, fault_kind kind) noexcept
      : injector_(get()), op_(injector_.backend_op_), kind_(injector_.backend_kind_)
    {
      injector_.backend_op_   = op;
      injector_.backend_kind_ = kind;
    }
    backend_op_scope(const backend_op_scope&)            = delete;
    backend_op_scope& operator=(const backend_op_scope&) = delete;
    ~backend_op_scope()
    {
      injector_.backend_op_   = op_;
      injector_.backend_kind_ = kind_;
    }

   private:
    fault_injector& injector_;
    const char* op_;
    fault_kind kind_;
  };

  /// @brief Suspends counting (the checker reading state is not part of the schedule under test).
  class pause_scope {
   public:
    pause_scope() noexcept : injector_(get()) { ++injector_.paused_; }
    pause_scope(const pause_scope&)            = delete;
    pause_scope& operator=(const pause_scope&) = delete;
    ~pause_scope() { --injector_.paused_; }

   private:
    fault_injector& injector_;
  };

 private:
  [[nodiscard]] bool counting(fault_source source) const noexcept
  {
    return source_ == source && paused_ == 0 && armed_at_ != 0 && fired_ == 0;
  }

  void fire(const char* op, fault_kind kind)
  {
    ++fired_;
    fired_kind_ = kind;
    fired_op_   = std::string{op} + " in " + (call_depth_ > 0 ? call_ : "construction");
  }

  fault_source source_ = fault_source::backend;
  std::uint64_t armed_at_ = 0;
  std::uint64_t count_    = 0;
  std::uint64_t fired_    = 0;
  fault_kind fired_kind_  = fault_kind::none;
  std::string fired_op_;
  std::string only_in_call_;
  std::string only_op_;
  const char* call_         = "";
  int call_depth_           = 0;
  const char* backend_op_   = nullptr;
  fault_kind backend_kind_  = fault_kind::none;
  int paused_               = 0;
  bool in_hook_             = false;
};

}  // namespace rr_test
