/// @file
/// The route record: one request's routing, compact and self-describing, for the trip from the
/// engine to the trainer (docs/wire.md). Plain C++20; the zstd codecs where the program is built
/// with ROUTING_REPLAY_WITH_ZSTD=1 (the CMake target routing_replay::zstd defines it and links
/// libzstd).
///
/// A record holds [T, L, K] expert ids at ceil(log2 E) bits each, in chunks of 256 tokens, with
/// its shape, layer map, first position, missing rows (a validity bitmap) and checksums in its
/// header, so that a reader needs nothing else and can decode any token range and layer range
/// reading only the chunks that range lies in:
///
/// @code
/// routing_replay::route_record_encoder enc{48, 8, 128, {.token_start = 1024}};
/// enc.append(rows.data(), T, 48 * 8, 8);          // from the engine's storage, through strides
/// enc.append_missing(1);                           // a row the engine never computed
/// std::vector<std::byte> record = enc.finish();
///
/// routing_replay::route_record_reader reader{record};  // checks the header, index and bitmap
/// std::vector<std::int16_t> slice(64 * 12 * 8);
/// reader.decode<std::int16_t>(256, 320, 24, 36, slice.data(), 12 * 8, 8, -1);  // rows 256..319, layers 24..35
/// @endcode
#pragma once

#include <routing_replay/detail/wire/encoder.hpp>
#include <routing_replay/detail/wire/format.hpp>
#include <routing_replay/detail/wire/reader.hpp>
#include <routing_replay/detail/wire/zstd_codec.hpp>

namespace routing_replay {

/// @brief Whether this build reads and writes the zstd codecs (ROUTING_REPLAY_WITH_ZSTD).
inline constexpr bool route_record_has_zstd = detail::wire::zstd_available;

/// @brief The record format version this code writes and the only one it reads.
inline constexpr std::uint16_t route_record_version = detail::wire::format_version;

}  // namespace routing_replay
