/// @file
/// The object Python holds for one replay: the type-erased instantiation, the backend it runs on
/// and the bookkeeping that keeps zero-copy extractions safe. Shared by the host module, which
/// binds it, and the CUDA module, which only creates it.
#pragma once

#include "instances/instance_registry.hpp"
#include "replay_base.hpp"
#include "replay_impl.hpp"

#include <routing_replay/host_backend.hpp>
#include <routing_replay/step_plan.hpp>

#include <nanobind/nanobind.h>

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
  /// @brief Staging path: request id object -> handle bits (a Python dict, so a step's lookups
  /// use the hashes Python caches in its str objects: one probe per request, no string copies).
  /// Entries go when the request is released or aborted.
  nanobind::dict id_cache;
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
                  ", copy=" + names.copy + ", storage=" + names.storage + ": compiled ahead of time: " +
                  compiled_index_types + "; routing_replay.Replay compiles the others on first use "
                  "(or reinstall with -C cmake.define.ROUTING_REPLAY_PYTHON_ALL_COMBINATIONS=ON)"};
  }
  return replay_handle{it->second(config, copy_stream, staging), kind, device};
}

}  // namespace routing_replay::python
