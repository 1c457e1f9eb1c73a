/// @file
/// The object Python holds for one replay: the type-erased instantiation, the backend it runs on
/// and the bookkeeping that keeps zero-copy extractions safe. Shared by the host module, which
/// binds it, and the CUDA module, which only creates it.
#pragma once

#include "replay_base.hpp"
#include "replay_impl.hpp"

#include <routing_replay/host_backend.hpp>
#include <routing_replay/step_plan.hpp>

#include <nanobind/nanobind.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace routing_replay::python {

/// @brief Where a replay's "device" memory lives.
enum class backend_kind : std::int32_t { host, cuda };

/// @brief A step plan that owns what step_plan only refers to: string ids and slot lists, which
/// Python hands over as temporary objects.
struct plan_holder {
  step_plan plan;                              ///< the plan begin_step() takes
  std::deque<std::string> ids;                 ///< string ids of the scheduled requests
  std::deque<std::vector<std::int64_t>> slots; ///< slot lists (block-slot storage)
  /// Scratch of schedule_handles(): its columns as int64, capacity kept from step to step.
  std::vector<std::int64_t> columns[4];

  /// @brief Empties the plan, keeping capacity where it can.
  void clear()
  {
    plan.clear();
    ids.clear();
    slots.clear();
  }
};

/// @brief Host backend: the buffers captures snapshot router outputs into, recycled. A snapshot
/// goes back once the stream has run its capture kernel, so steady-state captures neither allocate
/// nor zero memory (a fresh 64 KiB buffer per layer at decode batch 1024 cost more than the rest of
/// the call: page faults of memory the allocator had just given back).
class snapshot_pool : public std::enable_shared_from_this<snapshot_pool> {
 public:
  /// @brief A snapshot buffer of at least `elems` ids; it returns to the pool when destroyed.
  class buffer {
   public:
    /// @brief Holds `ids`, taken from `pool`.
    buffer(std::shared_ptr<snapshot_pool> pool, std::vector<std::int64_t> ids) noexcept
      : pool_(std::move(pool)), ids_(std::move(ids))
    {
    }
    buffer(const buffer&)            = delete;
    buffer& operator=(const buffer&) = delete;
    /// @brief Gives the ids back to the pool.
    ~buffer() { pool_->give(std::move(ids_)); }
    /// @brief The ids.
    [[nodiscard]] std::int64_t* data() noexcept { return ids_.data(); }

   private:
    std::shared_ptr<snapshot_pool> pool_;
    std::vector<std::int64_t> ids_;
  };

  /// @brief A buffer of at least `elems` ids (contents unspecified).
  [[nodiscard]] std::shared_ptr<buffer> take(std::size_t elems)
  {
    std::vector<std::int64_t> ids;
    {
      const std::lock_guard lock{mutex_};
      if (!free_.empty()) {
        ids = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (ids.size() < elems) { ids.resize(elems); }  // grows once to the largest capture
    return std::make_shared<buffer>(shared_from_this(), std::move(ids));
  }

 private:
  void give(std::vector<std::int64_t> ids) noexcept
  {
    try {
      const std::lock_guard lock{mutex_};
      free_.push_back(std::move(ids));
    } catch (...) {  // no room to keep it: it is freed instead
    }
  }

  std::mutex mutex_;  // buffers come back on the stream's worker thread
  std::vector<std::vector<std::int64_t>> free_;
};

/// @brief The staging path's first look-up of a request id: the id object's address -> handle
/// bits, for an engine that passes the same id objects step after step (vLLM's scheduler keeps its
/// requests' id strings). A table of 4-way buckets of one cache line each: a multiply and a compare
/// or four per request, where the dict look-up by value behind it cost about 140 instructions a
/// request in the drop-in's post-forward call (callgrind, decode B1024). A miss (a new object, or
/// one pushed out of a full bucket) falls back to the look-up by value and takes a way.
///
/// Each entry holds a reference to its id object, so an address it knows never names another
/// object; there is at most one entry per request (the latest object seen for it), dropped when the
/// request is released or aborted (forget()), before its handle index can name another request.
/// Every call needs the GIL.
class id_object_cache {
 public:
  id_object_cache() = default;
  id_object_cache(id_object_cache&& other) noexcept
    : slots_(std::move(other.slots_)),
      slot_of_(std::move(other.slot_of_)),
      entries_(std::exchange(other.entries_, 0)),
      shift_(other.shift_)
  {
  }
  id_object_cache& operator=(id_object_cache&&)      = delete;
  id_object_cache(const id_object_cache&)            = delete;
  id_object_cache& operator=(const id_object_cache&) = delete;
  ~id_object_cache()
  {
    for (const entry& e : slots_) { Py_XDECREF(e.key); }
  }

  /// @brief The handle bits remembered for the object `key`, if any.
  [[nodiscard]] std::optional<std::uint64_t> find(PyObject* key) const noexcept
  {
    if (slots_.empty()) { return std::nullopt; }
    const entry* bucket = slots_.data() + bucket_of(key);
    for (std::size_t way = 0; way < ways; ++way) {
      if (bucket[way].key == key) { return bucket[way].bits; }
    }
    return std::nullopt;
  }

  /// @brief Remembers that the object `key` names the request whose handle is `bits`, in place of
  /// any object remembered for that request (and, in a full bucket, of another request's).
  void remember(PyObject* key, std::uint64_t bits)
  {
    const auto index = static_cast<std::uint32_t>(bits);  // request_handle::bits(): the index is the low half
    if (index >= slot_of_.size()) { slot_of_.resize(static_cast<std::size_t>(index) + 1, no_slot); }
    if (2 * (entries_ + 1) > slots_.size()) { grow(); }
    forget(index);
    const std::size_t bucket = bucket_of(key);
    std::size_t at           = bucket;  // way 0 goes if the bucket is full
    for (std::size_t way = 0; way < ways; ++way) {
      if (slots_[bucket + way].key == nullptr) {
        at = bucket + way;
        break;
      }
    }
    if (slots_[at].key != nullptr) { drop(at); }
    Py_INCREF(key);
    slots_[at]      = entry{key, bits};
    slot_of_[index] = static_cast<std::uint32_t>(at);
    ++entries_;
  }

  /// @brief Forgets the object remembered for the request of handle index `index`, if any.
  void forget(std::uint32_t index) noexcept
  {
    if (index < slot_of_.size() && slot_of_[index] != no_slot) { drop(slot_of_[index]); }
  }

 private:
  struct entry {
    PyObject* key      = nullptr;
    std::uint64_t bits = 0;  // request_handle::bits()
  };
  static constexpr std::size_t ways        = 4;  // 4 entries of 16 bytes: one cache line
  static constexpr std::uint32_t no_slot   = 0xffffffffu;
  static constexpr std::size_t first_slots = 1024;

  // The first slot of the bucket of `key`: Fibonacci hashing of its address (objects are 16-byte
  // aligned), the product's top bits.
  [[nodiscard]] std::size_t bucket_of(PyObject* key) const noexcept
  {
    const auto address = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(key) >> 4);
    return static_cast<std::size_t>((address * 0x9E3779B97F4A7C15ull) >> shift_) * ways;
  }

  void drop(std::size_t at) noexcept
  {
    PyObject* key = std::exchange(slots_[at].key, nullptr);
    slot_of_[static_cast<std::uint32_t>(slots_[at].bits)] = no_slot;
    --entries_;
    Py_DECREF(key);  // last: freeing the id may run Python code, which must find the table consistent
  }

  // Doubles the table (at first_slots at least), keeping what fits: an entry whose bucket is full
  // there is dropped, and its request falls back to the dict once.
  void grow()
  {
    std::vector<entry> old = std::exchange(slots_, std::vector<entry>(std::max(first_slots, 2 * slots_.size())));
    shift_                 = 64 - static_cast<unsigned>(std::countr_zero(slots_.size() / ways));
    entries_               = 0;
    std::fill(slot_of_.begin(), slot_of_.end(), no_slot);
    for (const entry& e : old) {
      if (e.key == nullptr) { continue; }
      const std::size_t bucket = bucket_of(e.key);
      std::size_t way          = 0;
      while (way < ways && slots_[bucket + way].key != nullptr) { ++way; }
      if (way == ways) {
        Py_DECREF(e.key);
        continue;
      }
      slots_[bucket + way]                          = e;
      slot_of_[static_cast<std::uint32_t>(e.bits)] = static_cast<std::uint32_t>(bucket + way);
      ++entries_;
    }
  }

  std::vector<entry> slots_;            // buckets of `ways` entries
  std::vector<std::uint32_t> slot_of_;  // per handle index: the slot of its entry, or no_slot
  std::size_t entries_ = 0;
  unsigned shift_      = 64;
};

/// @brief One replay as Python sees it.
struct replay_handle {
  /// @brief Takes over an instantiation running on `kind`, on CUDA device `device`.
  replay_handle(std::unique_ptr<replay_base> replay, backend_kind kind, std::int32_t device)
    : impl(std::move(replay)), backend(kind), device_id(device)
  {
  }
  /// @brief Takes over another handle (nanobind moves a returned handle into its Python object).
  replay_handle(replay_handle&&) noexcept            = default;
  replay_handle& operator=(replay_handle&&) noexcept = delete;
  replay_handle(const replay_handle&)                = delete;
  replay_handle& operator=(const replay_handle&)     = delete;
  /// @brief Host backend: waits for every stream the replay enqueued work on (a capture kernel may
  /// still write the device buffer), then destroys the replay, then lets the streams go.
  ~replay_handle()
  {
    for (const nanobind::object& s : host_streams) {
      try {
        nanobind::cast<host_stream&>(s).synchronize();
      } catch (...) {  // a failed task was the engine's to collect; nothing to report it to here
      }
    }
    impl.reset();
  }

  /// @brief Host backend: keeps a stream (a HostStream object) alive for as long as the replay,
  /// and has the destructor wait for it.
  void hold_stream(nanobind::handle stream)
  {
    for (const nanobind::object& s : host_streams) {
      if (s.is(stream)) { return; }
    }
    host_streams.push_back(nanobind::borrow(stream));
  }

  std::vector<nanobind::object> host_streams;  ///< host streams used; destroyed after `impl`
  /// @brief Host backend: snapshot buffers of captures (outlives the replay while one is in flight).
  std::shared_ptr<snapshot_pool> snapshots = std::make_shared<snapshot_pool>();
  std::unique_ptr<replay_base> impl;  ///< the instantiation
  backend_kind backend;               ///< host or CUDA
  std::int32_t device_id;             ///< CUDA device of the buffers (0 on the host)
  /// @brief Zero-copy extractions alive, per request handle index: release, abort and a plan that
  /// schedules the request (by id or handle) are refused while any is alive (BufferError), as
  /// bytearray refuses to resize.
  std::unordered_map<std::uint32_t, std::int64_t> views;
  std::int64_t live_views = 0;  ///< sum of `views`
  plan_holder staged_plan;      ///< the plan the staging path builds each step
  /// @brief Staging path: request id -> handle bits, by value (a Python dict, so a look-up uses the
  /// hash Python caches in its str objects, no string copies), behind `id_objects`. Entries go when
  /// the request is released or aborted.
  nanobind::dict id_cache;
  /// @brief Staging path: request id object -> handle bits, by address: the look-up tried first.
  id_object_cache id_objects;
};

/// @brief Creates a replay of the instantiation `table` holds for the policy names.
/// @throws error invalid_argument when the combination is not compiled; as the constructor
inline replay_handle create_replay(const factory_table& table, const policy_names& names, const replay_config& config,
                                   std::optional<std::uintptr_t> copy_stream, bool staging, backend_kind kind,
                                   std::int32_t device)
{
  const auto it = table.find(policy_key(names.index, names.layout, names.copy, names.storage));
  if (it == table.end()) {
    throw error{errc::invalid_argument,
                "no compiled " + names.backend + " instantiation for index=" + names.index + ", layout=" + names.layout +
                  ", copy=" + names.copy + ", storage=" + names.storage + "; routing_replay.policies('" +
                  names.backend + "') lists them"};
  }
  return replay_handle{it->second(config, copy_stream, staging), kind, device};
}

}  // namespace routing_replay::python
