/// @file
/// The kernels that move ids as 8- or 16-byte words, run on any backend at the shapes where a row,
/// a cell or a buffer offset is not a multiple of the word: one layer, top-1 or top-3, odd row
/// counts, 1- and 2-byte ids, D narrowed from uint16 to uint8 (E = 256), ring slots of an odd
/// number of bytes, snapshots at every offset within 16 bytes. Each returns how many ids came back
/// wrong (a wrong id, an unclean status, a step that failed), so the host and the GPU test share
/// the cases. On the host backend every word access is checked for its alignment
/// (detail::require_word_aligned() aborts where a GPU would fault).
#pragma once

#include <routing_replay/backend.hpp>
#include <routing_replay/buffer_layout.hpp>
#include <routing_replay/config.hpp>
#include <routing_replay/data_path/capture_buffer.hpp>
#include <routing_replay/data_path/step_snapshots.hpp>
#include <routing_replay/detail/step_status.hpp>
#include <routing_replay/detail/validate_config.hpp>
#include <routing_replay/layer_map.hpp>
#include <routing_replay/slot_rows.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

namespace rr_test {

/// @brief The id of (row, layer, column) in a step: a pure function below `experts`, distinct
/// enough that a misplaced or stale id shows.
inline std::int64_t word_shape_id(std::int64_t row, std::int32_t layer, std::int32_t column, std::int64_t step,
                                  std::int64_t experts)
{
  return (row * 7 + layer * 13 + column * 3 + step * 5) % experts;
}

/// @brief `host` in device memory of `Backend` (synchronized: the vector may go).
template <class Backend, class T>
typename Backend::template device_vector<T> upload(const std::vector<T>& host, typename Backend::stream_ref stream)
{
  typename Backend::template device_vector<T> d(host.size());
  Backend::copy_async(Backend::data(d), host.data(), host.size() * sizeof(T), stream);
  Backend::synchronize(stream);
  return d;
}

/// @brief `n` elements of device memory of `Backend` at `from`, to the host.
template <class Backend, class T>
std::vector<T> download(const T* from, std::size_t n, typename Backend::stream_ref stream)
{
  std::vector<T> host(n);
  Backend::copy_async(host.data(), from, n * sizeof(T), stream);
  Backend::synchronize(stream);
  return host;
}

/// @brief A router output [rows, K] (int32) of `layer` in step `step`.
inline std::vector<std::int32_t> word_shape_router(std::int64_t rows, std::int32_t layer, std::int32_t top_k,
                                                   std::int64_t step, std::int64_t experts)
{
  std::vector<std::int32_t> ids(static_cast<std::size_t>(rows * top_k));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int32_t k = 0; k < top_k; ++k) {
      ids[static_cast<std::size_t>(r * top_k + k)] = static_cast<std::int32_t>(word_shape_id(r, layer, k, step, experts));
    }
  }
  return ids;
}

/// @brief step_snapshots<Backend, Index, Out> of L x K ids of E experts, `max_rows` rows and a ring
/// of `depth` slots: `2 * depth + 1` steps (every slot used twice), full and partial, each captured
/// in two halves (destination_row_offset, as a chunked batch is), harvested, copied to host memory
/// and checked. Every other step is offered host memory to harvest into: the host backend's kernel
/// and, for steps within step_snapshots::direct_write_bytes(), the device's write it directly.
template <class Backend, class Index, class Out>
std::size_t step_snapshot_errors(std::int32_t layers, std::int32_t top_k, std::int32_t experts, std::int32_t max_rows,
                                 std::int32_t depth)
{
  typename Backend::stream compute, copy;
  routing_replay::step_snapshots<Backend, Index, Out> snapshots{layers, top_k, experts, max_rows, depth};
  const std::size_t row_elems = static_cast<std::size_t>(layers) * static_cast<std::size_t>(top_k);
  const std::size_t bytes     = static_cast<std::size_t>(max_rows) * row_elems * sizeof(Out);
  auto* host                  = static_cast<Out*>(Backend::allocate_pinned(bytes > 0 ? bytes : 1));
  std::size_t wrong           = 0;
  for (std::int32_t step = 0; step < 2 * depth + 1; ++step) {
    const std::int32_t rows = step % 3 == 2 ? max_rows / 2 : max_rows - step % 2;
    const std::int32_t half = rows / 2;
    snapshots.open_step(compute.ref());
    std::vector<typename Backend::template device_vector<std::int32_t>> inputs;
    for (std::int32_t l = 0; l < layers; ++l) {
      inputs.push_back(upload<Backend>(word_shape_router(rows, l, top_k, step, experts), compute.ref()));
      const std::int32_t* ids = Backend::data(inputs.back());
      routing_replay::capture_options first_half, second_half;
      second_half.destination_row_offset = half;
      snapshots.capture(l, ids, half, compute.ref(), first_half);
      snapshots.capture(l, ids + static_cast<std::ptrdiff_t>(half) * top_k, rows - half, compute.ref(), second_half);
    }
    const bool direct = step % 2 == 1;
    const std::int32_t slot = snapshots.harvest(rows, compute.ref(), -1, direct ? host : nullptr);
    snapshots.copy_to_host(slot, host, copy.ref());
    snapshots.wait(slot);
    Backend::synchronize(compute.ref());  // the inputs may go
    wrong += snapshots.status(slot).clean() ? 0 : 1;
    for (std::int32_t r = 0; r < rows; ++r) {
      for (std::int32_t l = 0; l < layers; ++l) {
        for (std::int32_t k = 0; k < top_k; ++k) {
          const Out got = host[(static_cast<std::size_t>(r) * static_cast<std::size_t>(layers) + static_cast<std::size_t>(l)) *
                                 static_cast<std::size_t>(top_k) + static_cast<std::size_t>(k)];
          wrong += static_cast<std::int64_t>(got) != word_shape_id(r, l, k, step, experts) ? 1 : 0;
        }
      }
    }
  }
  Backend::free_pinned(host, bytes > 0 ? bytes : 1);
  return wrong;
}

/// @brief capture_buffer<Backend, Index, Layout>'s end-of-step kernel into a snapshot that starts
/// `offset` ids past an aligned address, for two steps: the kernel moves cells as the widest word
/// both D and the snapshot allow.
template <class Backend, class Index, class Layout>
std::size_t capture_buffer_errors(std::int32_t layers, std::int32_t top_k, std::int32_t rows, std::int32_t offset)
{
  routing_replay::replay_config c;
  c.num_experts         = 100;
  c.top_k               = top_k;
  c.max_tokens_per_step = rows;
  c.max_model_len       = 1;
  c.moe_layers.resize(static_cast<std::size_t>(layers));
  std::iota(c.moe_layers.begin(), c.moe_layers.end(), 0);
  c                    = routing_replay::detail::validated_config<Index>(std::move(c));
  const routing_replay::layer_map map{c};
  routing_replay::capture_buffer<Backend, Index, Layout> buffer{c, map};
  typename Backend::stream compute;
  const std::size_t elems = static_cast<std::size_t>(rows) * static_cast<std::size_t>(layers) * static_cast<std::size_t>(top_k);
  typename Backend::template device_vector<Index> snapshot(elems + 16);
  typename Backend::template device_vector<routing_replay::detail::step_status> status(1);
  std::size_t wrong = 0;
  for (std::int64_t step = 0; step < 2; ++step) {
    buffer.begin_step(rows, compute.ref());
    std::vector<typename Backend::template device_vector<std::int32_t>> inputs;
    for (std::int32_t l = 0; l < layers; ++l) {
      inputs.push_back(upload<Backend>(word_shape_router(rows, l, top_k, step, c.num_experts), compute.ref()));
      buffer.capture(l, Backend::data(inputs.back()), rows, compute.ref());
    }
    Backend::fill_2d_async(Backend::data(status), sizeof(routing_replay::detail::step_status), 0,
                           sizeof(routing_replay::detail::step_status), 1, compute.ref());
    buffer.end_step(Backend::data(snapshot) + offset, Backend::data(status), rows, -1, compute.ref());
    const auto got = download<Backend>(Backend::data(snapshot) + offset, elems, compute.ref());
    wrong += download<Backend>(Backend::data(status), 1, compute.ref())[0].clean() ? 0 : 1;
    for (std::int32_t r = 0; r < rows; ++r) {
      for (std::int32_t l = 0; l < layers; ++l) {
        for (std::int32_t k = 0; k < top_k; ++k) {
          const Index id = got[(static_cast<std::size_t>(r) * static_cast<std::size_t>(layers) + static_cast<std::size_t>(l)) *
                                 static_cast<std::size_t>(top_k) + static_cast<std::size_t>(k)];
          wrong += static_cast<std::int64_t>(id) != word_shape_id(r, l, k, step, c.num_experts) ? 1 : 0;
        }
      }
    }
  }
  return wrong;
}

/// @brief slot_rows<Backend, Index> of L x K ids (rows of L * K * sizeof(Index) bytes: 1, 3, 6,
/// 16, ...) with steps of at most `fused_max_rows` rows stored by the end-of-step kernel alone
/// (slot_rows_config::fused_scatter_max_rows) and larger ones scattered: four steps of `rows` and
/// `rows / 2` rows in turn, read back, then a step of `rows / 2` rows with one slot outside the pool,
/// which must fail and leave the sentinel at its other slots (written over rows already stored).
template <class Backend, class Index>
std::size_t slot_rows_errors(std::int32_t layers, std::int32_t top_k, std::int32_t rows, std::int32_t fused_max_rows)
{
  routing_replay::slot_rows_config c;
  c.num_experts            = 100;
  c.top_k                  = top_k;
  c.max_tokens_per_step    = rows;
  c.num_model_layers       = layers;
  c.num_slots              = 4 * static_cast<std::int64_t>(rows) + 3;
  c.steps_in_flight        = 2;
  c.fused_scatter_max_rows = fused_max_rows;
  routing_replay::slot_rows<Backend, Index> pool{c};
  typename Backend::stream compute;
  std::size_t wrong = 0;
  const std::size_t row_elems = static_cast<std::size_t>(layers) * static_cast<std::size_t>(top_k);
  for (std::int64_t step = 0; step < 5; ++step) {
    const bool refused = step == 4;
    const std::int32_t n = step % 2 == 0 && !refused ? rows : std::max(1, rows / 2);
    std::vector<std::int64_t> slots(static_cast<std::size_t>(n));
    for (std::int32_t r = 0; r < n; ++r) { slots[static_cast<std::size_t>(r)] = (r * 3 + step * 5 + 1) % c.num_slots; }
    if (refused) { slots.back() = c.num_slots + 1; }
    std::vector<typename Backend::template device_vector<std::int32_t>> inputs;
    for (std::int32_t l = 0; l < layers; ++l) {
      inputs.push_back(upload<Backend>(word_shape_router(n, l, top_k, step, c.num_experts), compute.ref()));
      pool.capture(l, Backend::data(inputs.back()), n, compute.ref());
    }
    const auto device_slots    = upload<Backend>(slots, compute.ref());
    const std::uint64_t serial = pool.end_step(Backend::data(device_slots), n, compute.ref());
    pool.wait(serial);
    Backend::synchronize(compute.ref());  // the inputs may go
    try {
      pool.throw_failure(serial);
      wrong += refused ? 1 : 0;
    } catch (const routing_replay::error& e) {
      wrong += refused && e.code() == routing_replay::errc::slot_out_of_range ? 0 : 1;
      if (!refused) { continue; }
    }
    std::vector<std::int32_t> out(row_elems);
    if (refused) {  // every row the step stored before its bad slot was seen is the sentinel again
      for (std::int32_t r = 0; r + 1 < n; ++r) {
        try {
          pool.template read<std::int32_t>(std::span<const std::int64_t>{&slots[static_cast<std::size_t>(r)], 1}, out.data());
          ++wrong;
        } catch (const routing_replay::error& e) {
          wrong += e.code() == routing_replay::errc::missing_routing ? 0 : 1;
        }
      }
      continue;
    }
    out.resize(static_cast<std::size_t>(n) * row_elems);
    pool.template read<std::int32_t>(std::span<const std::int64_t>{slots}, out.data());
    for (std::int32_t r = 0; r < n; ++r) {
      for (std::int32_t l = 0; l < layers; ++l) {
        for (std::int32_t k = 0; k < top_k; ++k) {
          const std::int32_t id = out[static_cast<std::size_t>(r) * row_elems + static_cast<std::size_t>(l) * static_cast<std::size_t>(top_k) +
                                      static_cast<std::size_t>(k)];
          // a row is read with the id it was captured with (its row in the step)
          wrong += id != word_shape_id(r, l, k, step, c.num_experts) ? 1 : 0;
        }
      }
    }
  }
  return wrong;
}

}  // namespace rr_test
