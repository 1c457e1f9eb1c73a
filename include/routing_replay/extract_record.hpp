/// @file
/// Route records (route_record.hpp, docs/wire.md) written straight from storage: a replay's request,
/// or the rows a slot_rows pool holds at a request's KV slots, handed to route_record_encoder where
/// they lie, so that no [T, L, K] array is made on the way (as to_base64_npy writes vLLM's field
/// from a view). The record's first position is the first one read, its layer map the storage's
/// (the replay's moe_layers, the pool layers captured), and rows without routing are missing rows.
///
/// @code
/// std::vector<std::byte> record;
/// routing_replay::extract_record_into(replay, "chat-7", record, {.start_position = 1024});
/// // the same bytes as encoding replay.extract("chat-7", {.start_position = 1024}) (sentinel rows
/// // as missing) with token_start 1024 and the replay's layer map
/// @endcode
#pragma once

#include <routing_replay/errors.hpp>
#include <routing_replay/index_type.hpp>
#include <routing_replay/route_record.hpp>
#include <routing_replay/routed_experts.hpp>
#include <routing_replay/detail/slot_rows/slot_rows_reader.hpp>
#include <routing_replay/step_plan.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace routing_replay {

namespace detail {

/// @brief The encoder's options for rows whose first position and layer map the storage gives.
/// @throws error invalid_argument if the caller set either
[[nodiscard]] inline route_record_options record_options_from(route_record_options options,
                                                              std::span<const std::int32_t> model_layers,
                                                              std::int64_t first_position,
                                                              const char* caller)
{
  if (options.token_start != 0 || !options.layer_map.empty()) {
    throw error{errc::invalid_argument, std::string{caller} +
                                          ": a record from storage takes its token_start (the first position read) "
                                          "and its layer map (the storage's) from the storage; leave both unset"};
  }
  options.token_start = first_position;
  options.layer_map.assign(model_layers.begin(), model_layers.end());
  return options;
}

/// @brief Feeds runs of rows to an encoder, missing rows marked as such, and names the positions
/// of a run the encoder refuses (its messages count rows from the start of the call).
class record_feed {
 public:
  /// @brief A feed into `encoder` of rows from position `first_position` of `who` ("request 7").
  record_feed(route_record_encoder& encoder, std::int64_t first_position, std::string who) noexcept
    : encoder_(encoder), position_(first_position), who_(std::move(who))
  {
  }

  /// @brief n rows: id (t, l, k) at `first[t * token_stride + l * layer_stride + k]`. A row whose
  /// ids are all the sentinel is missing, as `encode` of an extracted array reads it.
  /// @throws error invalid_expert_id, naming the positions of the run
  template <expert_index Index>
  void rows(const Index* first, std::int64_t n, std::int64_t token_stride, std::int64_t layer_stride)
  {
    try {
      encoder_.append(first, static_cast<std::size_t>(n), static_cast<std::ptrdiff_t>(token_stride),
                      static_cast<std::ptrdiff_t>(layer_stride), std::optional<Index>{index_traits<Index>::sentinel});
    } catch (const error& e) {
      throw error{e.code(), who_ + ", positions [" + std::to_string(position_) + ", " + std::to_string(position_ + n) +
                              "): " + e.what()};
    }
    position_ += n;
  }

  /// @brief n positions without a row.
  void missing(std::int64_t n)
  {
    encoder_.append_missing(static_cast<std::size_t>(n));
    position_ += n;
  }

 private:
  route_record_encoder& encoder_;
  std::int64_t position_;
  std::string who_;
};

}  // namespace detail

/// @brief Writes a request's rows [start_position, end_position) as a route record into `record`
/// (resized to it), straight from the replay's host storage (RoutingReplay, or any replay with
/// for_each_row_run()): no [T, L, K] array in between. Its token_start is `options.start_position`,
/// its layer map the replay's moe_layers, its E and K the replay's; rows never recorded, or stale,
/// are missing rows. `record_options` chooses codec, order-free form and chunk size; its
/// token_start and layer_map must stay unset.
/// @return the record's size in bytes
/// @throws error as extract(); invalid_argument for include_dense_layers, a token_start or
/// layer_map set, or a shape or codec the encoder refuses (E past 65536, zstd without libzstd);
/// invalid_expert_id (a row only partly missing) naming the positions
template <class Replay>
std::size_t extract_record_into(Replay& replay,
                                request_key id,
                                std::vector<std::byte>& record,
                                const extract_options& options        = {},
                                route_record_options record_options = {})
{
  using index        = typename Replay::index_type;
  const auto& config = replay.config();
  route_record_encoder encoder{static_cast<std::uint32_t>(replay.num_layers()), static_cast<std::uint32_t>(config.top_k),
                               static_cast<std::uint32_t>(config.num_experts),
                               detail::record_options_from(std::move(record_options), config.moe_layers,
                                                           options.start_position, "extract_record")};
  detail::record_feed feed{encoder, options.start_position, "request " + id.to_string()};
  const std::int64_t row = replay.row_size();
  const std::int64_t k   = replay.top_k();
  replay.for_each_row_run(
    id, options, [&](const index* rows, std::int64_t n) { feed.rows(rows, n, row, k); },
    [&](std::int64_t n) { feed.missing(n); });
  return encoder.finish_into(record);
}

/// @brief extract_record_into() a new buffer.
template <class Replay>
[[nodiscard]] std::vector<std::byte> extract_record(Replay& replay,
                                                    request_key id,
                                                    const extract_options& options        = {},
                                                    route_record_options record_options = {})
{
  std::vector<std::byte> record;
  extract_record_into(replay, id, record, options, std::move(record_options));
  return record;
}

/// @brief Writes the rows a slot_rows pool holds at a request's KV slots as a route record into
/// `record` (resized to it), read where they lie: its token_start is `options.first_position`,
/// its layer map the pool layers captured so far (run_layers()), its E and K the pool's; a slot
/// no step wrote is a missing row. From the pool as it is: the engine first waits for the steps
/// that may write these slots.
/// @return the record's size in bytes
/// @throws error slot_out_of_range; missing_routing (a row with routing for some layers only);
/// invalid_argument as extract_record_into()
template <class Rows, std::integral Slot>
std::size_t read_record_into(const Rows& pool,
                             std::span<const Slot> slots,
                             std::vector<std::byte>& record,
                             const slot_read_options& options      = {},
                             route_record_options record_options = {})
{
  using index                             = typename Rows::index_type;
  const auto& config                      = pool.config();
  const std::vector<std::int32_t> layers = pool.run_layers();
  route_record_encoder encoder{static_cast<std::uint32_t>(layers.size()), static_cast<std::uint32_t>(config.top_k),
                               static_cast<std::uint32_t>(config.num_experts),
                               detail::record_options_from(std::move(record_options), layers, options.first_position,
                                                           "read_record")};
  detail::record_feed feed{encoder, options.first_position, options.request.empty() ? "the read" : options.request};
  pool.for_each_run(
    slots,
    [&](const index* rows, std::int64_t n, std::int64_t token_stride, std::int64_t layer_stride) {
      feed.rows(rows, n, token_stride, layer_stride);
    },
    [&](std::int64_t n) { feed.missing(n); }, options);
  return encoder.finish_into(record);
}

}  // namespace routing_replay
