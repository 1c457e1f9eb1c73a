/// @file
/// The route record's byte layout (docs/wire.md section 2): constants, limits, the fixed 80-byte
/// header and its little-endian serialization. Everything a reader checks before it trusts a
/// single offset lives here, so that the encoder and the decoder cannot disagree about it.
#pragma once

#include <routing_replay/detail/wire/abi.hpp>
#include <routing_replay/errors.hpp>

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace routing_replay {

/// @brief How each chunk of a route record's payload is stored after bit packing.
///
/// A chunk that a compressing codec does not shrink is stored `packed` whatever the record's codec,
/// so no record is ever larger than its packed form.
enum class route_codec : std::uint8_t {
  packed       = 0,  ///< ids bit-packed at ceil(log2 E) bits, nothing more (random access by id)
  zstd         = 1,  ///< the packed bytes compressed with zstd (needs libzstd)
  zstd_columns = 2,  ///< ids transposed to one column per layer, in whole bytes, then zstd (or zstd of packed, if smaller)
};

/// @brief The codec's name as docs/wire.md and the Python module spell it ("packed", ...).
[[nodiscard]] constexpr const char* route_codec_name(route_codec c) noexcept
{
  switch (c) {
    case route_codec::packed: return "packed";
    case route_codec::zstd: return "zstd";
    case route_codec::zstd_columns: return "zstd_columns";
  }
  return "unknown";
}

}  // namespace routing_replay

namespace routing_replay::detail::wire {
ROUTING_REPLAY_WIRE_ABI_BEGIN

static_assert(std::endian::native == std::endian::little,
              "the route record is little-endian and read and written with memcpy");

/// The first 8 bytes of every record. "\r\n" catches a transfer that rewrote line ends.
inline constexpr std::array<unsigned char, 8> magic = {'R', 'R', 'O', 'U', 'T', 'E', '\r', '\n'};
/// The layout this code writes and the only one it reads (docs/wire.md, "Version rules").
inline constexpr std::uint16_t format_version = 1;
inline constexpr std::size_t header_bytes      = 80;  ///< the fixed header
inline constexpr std::size_t chunk_entry_bytes = 24;  ///< one entry of the chunk index
inline constexpr std::size_t checksum_offset   = 72;  ///< where the header's XXH64 sits

inline constexpr std::uint32_t flag_order_free  = 1u << 0;  ///< entries are ranks of sorted sets
inline constexpr std::uint32_t flag_has_missing = 1u << 1;  ///< a validity bitmap follows the index
inline constexpr std::uint32_t known_flags      = flag_order_free | flag_has_missing;

// Limits (docs/wire.md, "Limits"): what a reader accepts before it computes a single offset. They
// bound every product below well inside 64 bits, and one chunk's ids so that a decompressed chunk
// never asks for more than 128 MiB.
inline constexpr std::uint64_t max_tokens       = 0x7fffffffu;  ///< T (positions are int32 in every engine)
inline constexpr std::uint32_t max_layers       = 4096;         ///< L
inline constexpr std::uint32_t max_top_k        = 64;           ///< K
inline constexpr std::uint32_t max_experts      = 65536;        ///< E (ids fit 16 bits)
inline constexpr std::uint32_t max_chunk_tokens = 65536;
inline constexpr std::uint64_t max_chunk_ids    = std::uint64_t{1} << 26;  ///< chunk_tokens * L * K
inline constexpr std::int64_t max_token_start   = 0x7fffffff;
/// Order-free records keep a binomial table of E * (K + 1) entries on both sides.
inline constexpr std::uint64_t max_order_free_table = std::uint64_t{1} << 20;

/// @brief ceil(log2 E), at least 1: the bits of one id in the ordered form.
[[nodiscard]] constexpr std::uint32_t bits_for_experts(std::uint32_t num_experts) noexcept
{
  return num_experts <= 2 ? 1u : static_cast<std::uint32_t>(std::bit_width(num_experts - 1u));
}

/// @brief The fixed header, as fields (docs/wire.md, "Header").
struct record_header {
  std::uint16_t version       = format_version;
  std::uint32_t flags         = 0;
  std::uint32_t num_tokens    = 0;  ///< T
  std::uint32_t num_layers    = 0;  ///< L
  std::uint32_t num_experts   = 0;  ///< E
  std::uint32_t top_k         = 0;  ///< K
  std::uint32_t bits_per_id   = 0;  ///< ceil(log2 E), at least 1
  route_codec codec           = route_codec::packed;
  std::int64_t token_start    = 0;  ///< the position of row 0
  std::uint32_t chunk_tokens  = 0;
  std::uint32_t num_chunks    = 0;
  std::uint32_t missing_rows  = 0;
  std::uint32_t entry_bits    = 0;  ///< bits of one (token, layer) entry: K * bits, or the rank's bits
  std::uint64_t payload_bytes = 0;
  std::uint64_t record_bytes  = 0;
  std::uint64_t checksum      = 0;  ///< XXH64 of header[0, 72) then of [80, payload start)

  [[nodiscard]] bool order_free() const noexcept { return (flags & flag_order_free) != 0; }
  [[nodiscard]] bool has_missing() const noexcept { return (flags & flag_has_missing) != 0; }
  [[nodiscard]] std::uint64_t layer_map_bytes() const noexcept { return std::uint64_t{num_layers} * 4; }
  [[nodiscard]] std::uint64_t index_bytes() const noexcept { return std::uint64_t{num_chunks} * chunk_entry_bytes; }
  [[nodiscard]] std::uint64_t bitmap_bytes() const noexcept { return has_missing() ? (std::uint64_t{num_tokens} + 7) / 8 : 0; }
  /// @brief Where the chunk index starts (after the header and the layer map).
  [[nodiscard]] std::uint64_t index_offset() const noexcept { return header_bytes + layer_map_bytes(); }
  [[nodiscard]] std::uint64_t bitmap_offset() const noexcept { return index_offset() + index_bytes(); }
  [[nodiscard]] std::uint64_t payload_offset() const noexcept { return bitmap_offset() + bitmap_bytes(); }
  /// @brief Tokens in chunk `c` (the last one may be short).
  [[nodiscard]] std::uint32_t tokens_in_chunk(std::uint32_t c) const noexcept
  {
    const std::uint64_t first = std::uint64_t{c} * chunk_tokens;
    const std::uint64_t left  = num_tokens - first;
    return static_cast<std::uint32_t>(left < chunk_tokens ? left : chunk_tokens);
  }
  /// @brief Bytes of a chunk of `tokens` tokens in packed form: its entries' bits, rounded up.
  [[nodiscard]] std::uint64_t packed_chunk_bytes(std::uint32_t tokens) const noexcept
  {
    return (std::uint64_t{tokens} * num_layers * entry_bits + 7) / 8;
  }
};

/// @brief One entry of the chunk index (docs/wire.md, "Chunk index").
struct chunk_entry {
  std::uint64_t offset = 0;            ///< from the start of the payload
  std::uint32_t stored_bytes = 0;      ///< bytes the chunk takes in the payload
  route_codec codec = route_codec::packed;  ///< packed, or the record's codec
  std::uint64_t checksum = 0;          ///< XXH64 of the stored bytes
};

template <class T>
inline void store_le(std::byte* p, T v) noexcept
{
  std::memcpy(p, &v, sizeof(T));
}

template <class T>
[[nodiscard]] inline T load_le(const std::byte* p) noexcept
{
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

/// @brief Writes the 80 header bytes (the checksum field as it is in `h`).
inline void write_header(const record_header& h, std::byte* p) noexcept
{
  std::memcpy(p, magic.data(), magic.size());
  store_le<std::uint16_t>(p + 8, h.version);
  store_le<std::uint16_t>(p + 10, static_cast<std::uint16_t>(header_bytes));
  store_le<std::uint32_t>(p + 12, h.flags);
  store_le<std::uint32_t>(p + 16, h.num_tokens);
  store_le<std::uint32_t>(p + 20, h.num_layers);
  store_le<std::uint32_t>(p + 24, h.num_experts);
  store_le<std::uint16_t>(p + 28, static_cast<std::uint16_t>(h.top_k));
  store_le<std::uint8_t>(p + 30, static_cast<std::uint8_t>(h.bits_per_id));
  store_le<std::uint8_t>(p + 31, static_cast<std::uint8_t>(h.codec));
  store_le<std::int64_t>(p + 32, h.token_start);
  store_le<std::uint32_t>(p + 40, h.chunk_tokens);
  store_le<std::uint32_t>(p + 44, h.num_chunks);
  store_le<std::uint32_t>(p + 48, h.missing_rows);
  store_le<std::uint32_t>(p + 52, h.entry_bits);
  store_le<std::uint64_t>(p + 56, h.payload_bytes);
  store_le<std::uint64_t>(p + 64, h.record_bytes);
  store_le<std::uint64_t>(p + 72, h.checksum);
}

[[noreturn]] inline void bad_record(const std::string& what)
{
  throw error{errc::invalid_record, "route record: " + what};
}

/// @brief Whether `c` names a codec this version defines.
[[nodiscard]] constexpr bool known_codec(std::uint8_t c) noexcept { return c <= 2; }

/// @brief Reads and checks the header's fields against each other and the limits; not the
/// checksum (the reader computes it over the bytes that follow) and not the buffer's size beyond
/// the header. @throws error invalid_record naming the first field that is wrong
[[nodiscard]] inline record_header read_header(const std::byte* p, std::size_t available)
{
  if (available < header_bytes) {
    bad_record("truncated: " + std::to_string(available) + " bytes, the header alone is " +
               std::to_string(header_bytes));
  }
  if (std::memcmp(p, magic.data(), magic.size()) != 0) { bad_record("bad magic: not a route record"); }
  record_header h;
  h.version = load_le<std::uint16_t>(p + 8);
  if (h.version != format_version) {
    bad_record("unknown version " + std::to_string(h.version) + " (this reader reads version " +
               std::to_string(format_version) + ")");
  }
  if (const auto hb = load_le<std::uint16_t>(p + 10); hb != header_bytes) {
    bad_record("header size " + std::to_string(hb) + ", version 1 has " + std::to_string(header_bytes));
  }
  h.flags = load_le<std::uint32_t>(p + 12);
  if ((h.flags & ~known_flags) != 0) { bad_record("unknown flags " + std::to_string(h.flags & ~known_flags)); }
  h.num_tokens  = load_le<std::uint32_t>(p + 16);
  h.num_layers  = load_le<std::uint32_t>(p + 20);
  h.num_experts = load_le<std::uint32_t>(p + 24);
  h.top_k       = load_le<std::uint16_t>(p + 28);
  h.bits_per_id = load_le<std::uint8_t>(p + 30);
  const auto codec = load_le<std::uint8_t>(p + 31);
  if (!known_codec(codec)) { bad_record("unknown codec " + std::to_string(codec)); }
  h.codec         = static_cast<route_codec>(codec);
  h.token_start   = load_le<std::int64_t>(p + 32);
  h.chunk_tokens  = load_le<std::uint32_t>(p + 40);
  h.num_chunks    = load_le<std::uint32_t>(p + 44);
  h.missing_rows  = load_le<std::uint32_t>(p + 48);
  h.entry_bits    = load_le<std::uint32_t>(p + 52);
  h.payload_bytes = load_le<std::uint64_t>(p + 56);
  h.record_bytes  = load_le<std::uint64_t>(p + 64);
  h.checksum      = load_le<std::uint64_t>(p + 72);

  auto limit = [](const char* name, std::uint64_t v, std::uint64_t lo, std::uint64_t hi) {
    if (v < lo || v > hi) {
      bad_record(std::string{name} + " " + std::to_string(v) + " outside [" + std::to_string(lo) + ", " +
                 std::to_string(hi) + "]");
    }
  };
  limit("num_tokens", h.num_tokens, 0, max_tokens);
  limit("num_layers", h.num_layers, 1, max_layers);
  limit("num_experts", h.num_experts, 1, max_experts);
  limit("top_k", h.top_k, 1, h.num_experts < max_top_k ? h.num_experts : max_top_k);
  limit("chunk_tokens", h.chunk_tokens, 1, max_chunk_tokens);
  limit("token_start", static_cast<std::uint64_t>(h.token_start < 0 ? -1 : h.token_start), 0,
        static_cast<std::uint64_t>(max_token_start));
  if (std::uint64_t{h.chunk_tokens} * h.num_layers * h.top_k > max_chunk_ids) {
    bad_record("chunk of " + std::to_string(h.chunk_tokens) + " tokens x " + std::to_string(h.num_layers) +
               " layers x " + std::to_string(h.top_k) + " ids is past the limit of " +
               std::to_string(max_chunk_ids) + " ids a chunk");
  }
  if (h.bits_per_id != bits_for_experts(h.num_experts)) {
    bad_record("bits_per_id " + std::to_string(h.bits_per_id) + " for " + std::to_string(h.num_experts) +
               " experts (want " + std::to_string(bits_for_experts(h.num_experts)) + ")");
  }
  const std::uint64_t chunks = (std::uint64_t{h.num_tokens} + h.chunk_tokens - 1) / h.chunk_tokens;
  if (h.num_chunks != chunks) {
    bad_record("num_chunks " + std::to_string(h.num_chunks) + " for " + std::to_string(h.num_tokens) +
               " tokens in chunks of " + std::to_string(h.chunk_tokens) + " (want " + std::to_string(chunks) + ")");
  }
  if (h.missing_rows > h.num_tokens || (h.missing_rows != 0 && !h.has_missing())) {
    bad_record("missing_rows " + std::to_string(h.missing_rows) + " with " + std::to_string(h.num_tokens) +
               " tokens" + (h.has_missing() ? "" : " and no validity bitmap"));
  }
  if (h.record_bytes != h.payload_offset() + h.payload_bytes) {
    bad_record("record_bytes " + std::to_string(h.record_bytes) + " != header, layer map, index, bitmap and payload (" +
               std::to_string(h.payload_offset() + h.payload_bytes) + ")");
  }
  return h;
}

ROUTING_REPLAY_WIRE_ABI_END
}  // namespace routing_replay::detail::wire
