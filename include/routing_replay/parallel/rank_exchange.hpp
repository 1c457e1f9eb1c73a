/// @file
/// What ranks exchange at the end of a step, once per step: the sequence-parallel gather of every
/// rank's shard of rows, and the pipeline-parallel send of every stage's layer slab to the output
/// rank. Each rank runs the end-of-step kernel over its own D first (check, token-major snapshot,
/// reset), so what travels is the snapshot and the status, whatever D's layout; statuses travel
/// with the rows, so a problem found on any rank reaches the output rank and fails the step there.
#pragma once

#include <routing_replay/backend.hpp>
#include <routing_replay/buffer_layout.hpp>
#include <routing_replay/config.hpp>
#include <routing_replay/detail/parallel/parallel_kernels.hpp>
#include <routing_replay/detail/step_status.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/index_type.hpp>
#include <routing_replay/parallel/communicator.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <vector>

namespace routing_replay {

namespace detail {

/// @brief Device bytes for exchange parts, as 8-byte words so every part's status is aligned.
template <class Backend>
using exchange_buffer = typename Backend::template device_vector<std::uint64_t>;

/// @brief A buffer of at least `bytes` bytes.
template <class Backend>
[[nodiscard]] exchange_buffer<Backend> make_exchange_buffer(std::size_t bytes)
{
  return exchange_buffer<Backend>((bytes + 7) / 8);
}

/// @brief The buffer's first byte.
template <class Backend>
[[nodiscard]] std::byte* bytes_of(exchange_buffer<Backend>& buffer) noexcept
{
  return reinterpret_cast<std::byte*>(Backend::data(buffer));
}

/// @brief The end-of-step kernel over a rank's own D into an exchange part (its status first,
/// zeroed before the kernel).
template <class Backend, class Index, class Buffer>
void harvest_into_part(Buffer& d, std::byte* part, std::int64_t rows, std::int64_t padded,
                       typename Backend::stream_ref stream)
{
  Backend::fill_2d_async(part, exchange_header_bytes, 0, sizeof(step_status), 1, stream);
  d.end_step(reinterpret_cast<Index*>(part + exchange_header_bytes), reinterpret_cast<step_status*>(part), rows,
             padded, stream);
}

}  // namespace detail

/// @brief Sequence parallel: each rank's shard of a step's rows, gathered once per step.
///
/// Every rank runs the end-of-step kernel over its shard (rows [0, shard.num_rows) checked and
/// snapshotted, every row of the shard reset), then one all-gather of (status, shard rows) parts;
/// on the output rank one kernel turns the parts into the step's rows [0, N) and merges the
/// statuses, rows renumbered to step rows. Graph-capturable: fixed buffers, no host sync.
template <backend Backend, expert_index Index>
class sequence_exchange {
 public:
  /// @brief Stream handle taken by every call that enqueues work.
  using stream_ref = typename Backend::stream_ref;

  /// @brief Buffers for steps of up to `max_step_rows` rows of `row_elems` ids over `ranks` ranks.
  sequence_exchange(std::int64_t max_step_rows, std::int64_t row_elems, int ranks)
    : row_elems_(row_elems),
      ranks_(ranks),
      max_shard_rows_((max_step_rows + ranks - 1) / ranks),
      part_(detail::make_exchange_buffer<Backend>(part_bytes(max_shard_rows_))),
      gathered_(detail::make_exchange_buffer<Backend>(static_cast<std::size_t>(ranks) * part_bytes(max_shard_rows_)))
  {
  }

  /// @brief The most rows one shard may have (a rank's local N_max).
  [[nodiscard]] std::int64_t max_shard_rows() const noexcept { return max_shard_rows_; }

  /// @brief On every rank, on `stream`: the end-of-step kernel over `d` (this rank's D) for
  /// `shard`, then the all-gather. The output rank passes the step's `snapshot` and `status`
  /// (zero), which receive rows [0, step_rows) and every rank's verdict; the others pass nullptr.
  template <class Buffer, class Comm>
  void exchange_async(Buffer& d,
                      const sequence_shard& shard,
                      std::int64_t step_rows,
                      Comm& comm,
                      Index* snapshot,
                      detail::step_status* status,
                      stream_ref stream)
  {
    std::byte* part     = detail::bytes_of<Backend>(part_);
    std::byte* gathered = detail::bytes_of<Backend>(gathered_);
    detail::harvest_into_part<Backend, Index>(d, part, shard.num_rows, shard.shard_rows, stream);
    const std::size_t bytes = part_bytes(shard.shard_rows);
    comm.all_gather_async(part, gathered, bytes, stream);
    if (snapshot == nullptr) { return; }
    const std::int64_t elems = step_rows * row_elems_;
    Backend::bulk_async(std::max<std::int64_t>(elems, 1),
                        detail::assemble_shards<Index>{gathered, static_cast<std::int64_t>(bytes),
                                                       std::max<std::int64_t>(shard.shard_rows, 1), row_elems_, elems,
                                                       ranks_, snapshot, status},
                        stream);
  }

 private:
  [[nodiscard]] std::size_t part_bytes(std::int64_t shard_rows) const noexcept
  {
    return detail::exchange_bytes(shard_rows * row_elems_, sizeof(Index));
  }

  std::int64_t row_elems_;
  std::int32_t ranks_;
  std::int64_t max_shard_rows_;
  detail::exchange_buffer<Backend> part_;      // this rank's status and shard
  detail::exchange_buffer<Backend> gathered_;  // every rank's, in rank order
};

/// @brief Pipeline parallel: each stage's slab of layers, sent once per step to the output rank.
///
/// Stage r owns `stage_layers[r]` consecutive captured layers (in moe_layers order). A stage other
/// than the output rank runs the end-of-step kernel over its layers and sends (status, slab
/// [N, L_r, K]) to the output rank. The output rank receives every slab, writes the rows into its
/// D (which has every layer), runs the end-of-step kernel over all of D, and merges the stages'
/// statuses, layer slots renumbered to D's. A stage that recorded nothing for a row leaves the
/// sentinel there, so the row is reported missing and the step is not filed.
template <backend Backend, expert_index Index, buffer_layout Layout>
class stage_exchange {
 public:
  /// @brief Stream handle taken by every call that enqueues work.
  using stream_ref = typename Backend::stream_ref;

  /// @brief For rank `rank` of a pipeline whose stages own `stage_layers` layers each (summing to
  /// L of the validated `config`), delivering to `output_rank`.
  /// @throws error invalid_config if the stages do not cover L, or a stage other than the output
  /// rank owns no layer
  stage_exchange(const replay_config& config, std::span<const std::int32_t> stage_layers, int rank, int output_rank)
    : rank_(rank), output_rank_(output_rank), top_k_(config.top_k), layers_(stage_layers.begin(), stage_layers.end())
  {
    check_stages(config, stage_layers, output_rank);
    std::int32_t first = 0;
    for (const std::int32_t n : stage_layers) {
      first_slot_.push_back(first);
      first += n;
    }
    const std::int64_t max_rows = config.max_tokens_per_step;
    if (rank != output_rank) {
      part_ = detail::make_exchange_buffer<Backend>(part_bytes(max_rows, rank));
      return;
    }
    std::vector<detail::stage_layer> by_slot(static_cast<std::size_t>(first));
    std::vector<detail::stage_part> parts;
    std::int64_t offset = 0;
    for (int s = 0; s < static_cast<int>(layers_.size()); ++s) {
      if (s == output_rank) { continue; }
      for (std::int32_t l = 0; l < layers_[s]; ++l) {
        by_slot[static_cast<std::size_t>(first_slot_[s] + l)] = {offset, l, layers_[s]};
      }
      parts.push_back({offset, first_slot_[s]});
      offset += static_cast<std::int64_t>(part_bytes(max_rows, s));
    }
    part_       = detail::make_exchange_buffer<Backend>(static_cast<std::size_t>(offset));
    slot_table_ = typename Backend::template device_vector<detail::stage_layer>(by_slot.begin(), by_slot.end());
    part_table_ = typename Backend::template device_vector<detail::stage_part>(parts.begin(), parts.end());
    part_offsets_.reserve(parts.size());
    for (const auto& p : parts) { part_offsets_.push_back(p.offset); }
  }

  /// @brief The configuration of stage `rank`'s own capture buffer: its layers only.
  [[nodiscard]] static replay_config stage_config(replay_config config, std::span<const std::int32_t> stage_layers, int rank)
  {
    const std::int32_t first = std::accumulate(stage_layers.begin(), stage_layers.begin() + rank, 0);
    const auto begin         = config.moe_layers.begin() + first;
    config.moe_layers.assign(begin, begin + stage_layers[static_cast<std::size_t>(rank)]);
    return config;
  }

  /// @brief A stage other than the output rank, on `stream`: the end-of-step kernel over its D
  /// (rows [0, rows) checked, rows the forward wrote reset), then its part to the output rank.
  template <class Buffer, class Comm>
  void send_async(Buffer& d, std::int64_t rows, std::int64_t padded_rows, Comm& comm, stream_ref stream)
  {
    std::byte* part = detail::bytes_of<Backend>(part_);
    detail::harvest_into_part<Backend, Index>(d, part, rows, padded_rows, stream);
    comm.send_async(part, part_bytes(rows, rank_), output_rank_, stream);
  }

  /// @brief The output rank, on `stream`: receives every other stage's part, merges their rows
  /// into `d`, runs the end-of-step kernel over `d` into `snapshot` and `status`, merges their
  /// statuses into `status`.
  template <class Buffer, class Comm>
  void harvest_async(Buffer& d, std::int64_t rows, std::int64_t padded_rows, Comm& comm, Index* snapshot,
                     detail::step_status* status, stream_ref stream)
  {
    std::byte* received = detail::bytes_of<Backend>(part_);
    std::size_t p       = 0;
    for (int s = 0; s < static_cast<int>(layers_.size()); ++s) {
      if (s == output_rank_) { continue; }
      comm.recv_async(received + part_offsets_[p++], part_bytes(rows, s), s, stream);
    }
    if (rows > 0) {
      const auto buffer = d.whole();
      Backend::bulk_async(rows * buffer.extent(0) * buffer.extent(2),
                          detail::merge_stage_rows<Index, Layout>{buffer, received, Backend::data(slot_table_), rows},
                          stream);
    }
    d.end_step(snapshot, status, rows, padded_rows, stream);
    Backend::bulk_async(1,
                        detail::merge_stage_statuses{received, Backend::data(part_table_),
                                                     static_cast<std::int32_t>(part_offsets_.size()), status},
                        stream);
  }

 private:
  [[nodiscard]] std::size_t part_bytes(std::int64_t rows, int stage) const noexcept
  {
    return detail::exchange_bytes(rows * layers_[static_cast<std::size_t>(stage)] * top_k_, sizeof(Index));
  }

  static void check_stages(const replay_config& config, std::span<const std::int32_t> stage_layers, int output_rank)
  {
    const auto total = std::accumulate(stage_layers.begin(), stage_layers.end(), std::int64_t{0});
    bool empty_stage = false;
    for (std::size_t s = 0; s < stage_layers.size(); ++s) {
      empty_stage = empty_stage || stage_layers[s] < 0 || (stage_layers[s] == 0 && static_cast<int>(s) != output_rank);
    }
    if (total != static_cast<std::int64_t>(config.moe_layers.size()) || empty_stage) {
      throw error{errc::invalid_config,
                  "pipeline stages own " + std::to_string(total) + " captured layers, the layer map has " +
                    std::to_string(config.moe_layers.size()) +
                    "; every stage but the output rank must own at least one"};
    }
  }

  int rank_;
  int output_rank_;
  std::int32_t top_k_;
  std::vector<std::int32_t> layers_;      // per stage: layers it owns
  std::vector<std::int32_t> first_slot_;  // per stage: its first layer slot
  std::vector<std::int64_t> part_offsets_;  // output rank: where each other stage's part lands
  detail::exchange_buffer<Backend> part_;   // a stage's part, or (output rank) every other stage's
  typename Backend::template device_vector<detail::stage_layer> slot_table_;
  typename Backend::template device_vector<detail::stage_part> part_table_;
};

}  // namespace routing_replay
