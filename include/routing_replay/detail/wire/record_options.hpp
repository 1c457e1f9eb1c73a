/// @file
/// route_record_options, what a route record is asked to be beyond its shape, and the check of a
/// shape and options against docs/wire.md's limits that turns them into the record's header
/// fields. Apart from the encoder because it is the one place those limits are enforced on the
/// writing side, run once per encoder and never on the hot path.
#pragma once

#include <routing_replay/detail/wire/abi.hpp>
#include <routing_replay/detail/wire/combinatorial.hpp>
#include <routing_replay/detail/wire/format.hpp>
#include <routing_replay/detail/wire/zstd_codec.hpp>
#include <routing_replay/errors.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace routing_replay {
ROUTING_REPLAY_WIRE_ABI_BEGIN

/// @brief What a route record says beyond its shape, and how it is stored.
struct route_record_options {
  std::int64_t token_start = 0;            ///< the position of the first row (multi-turn suffixes start later)
  std::vector<std::uint32_t> layer_map{};  ///< the model layer of each captured layer; empty: 0 .. L-1
  route_codec codec = route_codec::packed; ///< zstd codecs need ROUTING_REPLAY_WITH_ZSTD (routing_replay::zstd)
  bool ordered = true;                     ///< false: each entry's ids as a set (top-k order lost, fewer bits)
  int zstd_level = 3;                      ///< zstd's level for the compressing codecs
  std::uint32_t chunk_tokens = 256;        ///< tokens a chunk: the unit a slice decodes
};

ROUTING_REPLAY_WIRE_ABI_END
}  // namespace routing_replay

namespace routing_replay::detail::wire {
ROUTING_REPLAY_WIRE_ABI_BEGIN

/// @brief Checks a shape and `options` for route_record_encoder and returns the header of its
/// records (every field but the counts, sizes and checksum, which finishing a record sets). An
/// empty layer map in `options` is filled with 0 .. L-1.
/// @throws error invalid_argument for a shape past docs/wire.md's limits, a layer map of another
/// length or naming a layer twice, a zstd codec in a build without zstd, or an order-free form for
/// a shape it cannot hold
inline record_header checked_record_header(std::uint32_t num_layers, std::uint32_t top_k, std::uint32_t num_experts,
                                           route_record_options& options)
{
  auto bad = [](const std::string& what) { throw error{errc::invalid_argument, "route_record_encoder: " + what}; };
  if (num_layers < 1 || num_layers > max_layers) { bad("num_layers " + std::to_string(num_layers) + " outside [1, 4096]"); }
  if (num_experts < 1 || num_experts > max_experts) { bad("num_experts " + std::to_string(num_experts) + " outside [1, 65536]"); }
  if (top_k < 1 || top_k > std::min(num_experts, max_top_k)) {
    bad("top_k " + std::to_string(top_k) + " outside [1, min(num_experts, 64)]");
  }
  if (options.chunk_tokens < 1 || options.chunk_tokens > max_chunk_tokens ||
      std::uint64_t{options.chunk_tokens} * num_layers * top_k > max_chunk_ids) {
    bad("chunk_tokens " + std::to_string(options.chunk_tokens) + " outside [1, 65536] or past 2^26 ids a chunk");
  }
  if (options.token_start < 0 || options.token_start > max_token_start) {
    bad("token_start " + std::to_string(options.token_start) + " outside [0, 2^31)");
  }
  if (options.layer_map.empty()) {
    for (std::uint32_t l = 0; l < num_layers; ++l) { options.layer_map.push_back(l); }
  } else if (options.layer_map.size() != num_layers) {
    bad("layer_map has " + std::to_string(options.layer_map.size()) + " entries for " + std::to_string(num_layers) + " layers");
  }
  {
    std::vector<std::uint32_t> sorted = options.layer_map;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
      bad("layer_map names model layer " + std::to_string(*std::adjacent_find(sorted.begin(), sorted.end())) + " twice");
    }
  }
  if (!options.ordered && options.codec == route_codec::zstd_columns) {
    bad("zstd_columns transposes columns in top-k order; an order-free record takes packed or zstd");
  }
  if (options.codec != route_codec::packed && !zstd_available) {
    bad(std::string{"codec "} + route_codec_name(options.codec) + " needs libzstd, and this build has none (link routing_replay::zstd)");
  }
  record_header header;
  header.num_layers   = num_layers;
  header.top_k        = top_k;
  header.num_experts  = num_experts;
  header.bits_per_id  = bits_for_experts(num_experts);
  header.codec        = options.codec;
  header.token_start  = options.token_start;
  header.chunk_tokens = options.chunk_tokens;
  header.entry_bits   = top_k * header.bits_per_id;
  if (!options.ordered) {
    header.entry_bits = rank_bits(num_experts, top_k, max_order_free_table);
    if (header.entry_bits == 0) {
      bad("the order-free form holds C(E, K) < 2^127 with E * (K + 1) <= 2^20; " + std::to_string(top_k) + " of " +
          std::to_string(num_experts) + " is past that");
    }
    header.flags |= flag_order_free;
  }
  return header;
}

ROUTING_REPLAY_WIRE_ABI_END
}  // namespace routing_replay::detail::wire
