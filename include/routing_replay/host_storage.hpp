/// @file
/// Host-storage policy: where rows are filed on the host until a request is extracted.
#pragma once

#include <routing_replay/detail/host_storage/block_slot_store.hpp>
#include <routing_replay/detail/host_storage/per_request_store.hpp>

#include <concepts>
#include <type_traits>
#include <cstdint>
#include <span>
#include <vector>

namespace routing_replay {

namespace detail {
/// @brief Takes the pieces device_pieces() emits, to check a store offers it (a named type: nvcc
/// refuses lambdas in requires-expressions).
struct piece_probe {
  void operator()(std::int16_t*, std::int64_t) const noexcept {}
};
/// @brief Takes the runs for_each_run() hands over, to check a store offers it.
struct run_probe {
  void operator()(const std::int16_t*, std::int64_t) const noexcept {}
  void operator()(std::int64_t) const noexcept {}
};
}  // namespace detail

/// @brief Each request owns one contiguous, lazily grown range of rows at its positions.
///
/// Extraction is a zero-copy view. Growth is amortised (segments that double the capacity, mapped
/// after the ones before, so rows never move) and capped at max_model_len rows; the total is
/// bounded by replay_config::host_memory_limit.
struct per_request_storage {
  /// @brief The storage implementation for an index type; `RowMemory` says whether kernels write
  /// the rows (device scatter).
  template <class Index, class RowMemory = detail::host_written_rows>
  using store = detail::per_request_store<Index, RowMemory>;
  /// @brief Whether row addresses stay fixed while rows are in flight (needed by device_scatter).
  static constexpr bool stable_row_addresses = true;
  /// @brief Human-readable name.
  static constexpr const char* name = "per_request";
};

/// @brief Rows live at KV-cache slots (block_id * block_size + offset) in one preallocated pool.
///
/// Prefix-cache hits and preemption keep rows with their KV blocks; a per-block generation makes
/// rows of a reallocated block read as missing. Extraction gathers a request's rows.
struct block_slot_storage {
  /// @brief The storage implementation for an index type; `RowMemory` says whether kernels write
  /// the pool (device scatter: pinned memory).
  template <class Index, class RowMemory = detail::host_written_rows>
  using store = detail::block_slot_store<Index, RowMemory>;
  /// @brief Whether row addresses stay fixed while rows are in flight (needed by device_scatter).
  static constexpr bool stable_row_addresses = true;
  /// @brief Human-readable name.
  static constexpr const char* name = "block_slot";
};

/// @brief The store of a host-storage policy for a backend and an index type: its rows in ordinary
/// memory, or, when a kernel writes them (`DeviceWrites`: device scatter), in memory pinned and
/// mapped through the backend.
template <class Storage, class Backend, class Index, bool DeviceWrites>
using host_store = typename Storage::template store<
  Index,
  std::conditional_t<DeviceWrites, detail::device_written_rows<Backend>, detail::host_written_rows>>;

/// @brief A host-storage policy: names a store that opens and closes requests, validates and
/// reserves ahead of the scatter (so filing never fails), files rows (claim/unclaim/erase, by step
/// serial, readable once filed), tells kernels where rows go (device_pieces), serves them
/// (contiguous/read/read_rows, and for_each_run where they lie), accounts its bytes against the
/// memory limit and waits for the memory it keeps ready ahead of need (wait_until_ahead); and says
/// whether row addresses stay fixed while rows are in flight.
template <class S>
concept host_storage = requires(typename S::template store<std::int16_t>& store,
                                const typename S::template store<std::int16_t>& cstore,
                                std::uint32_t h,
                                std::int64_t position,
                                std::span<const std::int64_t> slots,
                                std::int16_t* row) {
  { S::template store<std::int16_t>::slot_indexed } -> std::convertible_to<bool>;
  { S::template store<std::int16_t>::reserve_only_grows } -> std::convertible_to<bool>;
  { S::stable_row_addresses } -> std::convertible_to<bool>;
  store.open(h);
  store.close(h);
  cstore.check_slot_range(slots);
  store.bind_cached(h, slots, std::uint64_t{0});
  store.begin_validation();
  store.check_slots(slots, std::int32_t{1});
  cstore.prefetch(h, slots);
  cstore.check_blocks(slots, "");
  { cstore.growth_bytes(h, position, true) } -> std::convertible_to<std::size_t>;
  { store.reserve(h, position, true) } -> std::same_as<bool>;
  store.undo_reserve(h);
  store.refresh_blocks(slots);
  { cstore.generation_of(position) } -> std::same_as<std::uint32_t>;
  { store.claim(h, position, position, std::uint32_t{0}, std::uint64_t{0}, true) } -> std::same_as<detail::row_claim<std::int16_t>>;
  store.unclaim(h, position, position, std::uint64_t{0});
  store.restore_claim(h, position, position, std::uint64_t{1}, std::uint64_t{0});
  store.set_filed_through(std::uint64_t{0});
  cstore.device_pieces(h, row, position, detail::piece_probe{});
  store.erase(h, position, position);
  store.forget_replaced_row(h, position, std::uint64_t{0});
  { store.contiguous(h, position, position) } -> std::same_as<const std::int16_t*>;
  { cstore.read(h, position, row) } -> std::same_as<bool>;
  cstore.read_rows(h, position, position, row);
  store.for_each_run(h, position, position, detail::run_probe{}, detail::run_probe{});
  { cstore.bytes_in_use() } -> std::convertible_to<std::size_t>;
  { cstore.limit() } -> std::convertible_to<std::size_t>;
  cstore.wait_until_ahead();
};

}  // namespace routing_replay
