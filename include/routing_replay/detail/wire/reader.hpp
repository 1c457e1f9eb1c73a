/// @file
/// route_record_reader: checks a route record once (header, layer map, chunk index, bitmap, their
/// checksum) and then decodes any token range and layer range into the caller's array, touching,
/// decompressing and checksumming only the chunks that the range covers. Every offset it follows
/// was checked against the buffer's size first, so no record, however forged, makes it read out of
/// bounds (tests/fuzz/fuzz_route_record.cpp holds it to that).
#pragma once

#include <routing_replay/detail/wire/abi.hpp>
#include <routing_replay/detail/wire/bit_pack.hpp>
#include <routing_replay/detail/wire/combinatorial.hpp>
#include <routing_replay/detail/wire/encoder.hpp>
#include <routing_replay/detail/wire/format.hpp>
#include <routing_replay/detail/wire/zstd_codec.hpp>
#include <routing_replay/detail/xxhash64.hpp>
#include <routing_replay/errors.hpp>

#include <algorithm>
#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace routing_replay {
ROUTING_REPLAY_WIRE_ABI_BEGIN

/// @brief How one chunk of a record is stored (route_record_reader::chunk).
struct route_chunk_info {
  std::uint32_t first_token = 0;  ///< the chunk's first row (from row 0 of the record)
  std::uint32_t num_tokens  = 0;
  std::uint64_t stored_bytes = 0;
  route_codec codec = route_codec::packed;  ///< packed where compression did not shrink the chunk
};

/// @brief A checked, read-only view of one route record (docs/wire.md). The bytes must outlive it.
class route_record_reader {
 public:
  /// @brief The size a record says it has, from its header alone (to find records back to back).
  /// @throws error invalid_record where the header is truncated or wrong
  [[nodiscard]] static std::uint64_t size_of(std::span<const std::byte> bytes)
  {
    return detail::wire::read_header(bytes.data(), bytes.size()).record_bytes;
  }

  /// @brief Checks everything but the chunks' payload: the header's fields and limits, its
  /// checksum, the layer map, the chunk index and the validity bitmap.
  /// @throws error invalid_record naming what is wrong: truncated, trailing bytes, bad magic,
  /// unknown version, flag or codec, an extent past the limits, a checksum mismatch, an index whose
  /// chunks do not tile the payload
  explicit route_record_reader(std::span<const std::byte> record) : bytes_(record)
  {
    namespace w = detail::wire;
    h_ = w::read_header(record.data(), record.size());
    if (record.size() < h_.record_bytes) {
      w::bad_record("truncated: " + std::to_string(record.size()) + " of its " + std::to_string(h_.record_bytes) + " bytes");
    }
    if (record.size() > h_.record_bytes) {
      w::bad_record(std::to_string(record.size() - h_.record_bytes) + " bytes past the record's end (" +
                    std::to_string(h_.record_bytes) + " bytes)");
    }
    const std::uint32_t want_bits = h_.order_free() ? w::rank_bits(h_.num_experts, h_.top_k, w::max_order_free_table)
                                                    : h_.top_k * h_.bits_per_id;
    if (want_bits == 0) {
      w::bad_record("order-free form for " + std::to_string(h_.top_k) + " of " + std::to_string(h_.num_experts) +
                    " experts is past its limits");
    }
    if (h_.entry_bits != want_bits) {
      w::bad_record("entry_bits " + std::to_string(h_.entry_bits) + ", want " + std::to_string(want_bits));
    }
    if (const std::uint64_t sum = route_record_encoder::meta_checksum(record.data(), h_.payload_offset()); sum != h_.checksum) {
      w::bad_record("header checksum mismatch (the header, layer map, chunk index or bitmap is corrupted)");
    }
    const std::byte* p = record.data() + w::header_bytes;
    layer_map_.resize(h_.num_layers);
    for (std::uint32_t l = 0; l < h_.num_layers; ++l) { layer_map_[l] = w::load_le<std::uint32_t>(p + 4 * l); }
    read_index();
    read_bitmap();
    if (h_.order_free()) { sets_ = w::combinatorial_table{h_.num_experts, h_.top_k}; }
  }

  [[nodiscard]] std::uint32_t num_tokens() const noexcept { return h_.num_tokens; }    ///< T
  [[nodiscard]] std::uint32_t num_layers() const noexcept { return h_.num_layers; }    ///< L
  [[nodiscard]] std::uint32_t top_k() const noexcept { return h_.top_k; }              ///< K
  [[nodiscard]] std::uint32_t num_experts() const noexcept { return h_.num_experts; }  ///< E
  [[nodiscard]] std::int64_t token_start() const noexcept { return h_.token_start; }   ///< position of row 0
  [[nodiscard]] std::uint32_t bits_per_id() const noexcept { return h_.bits_per_id; }  ///< ceil(log2 E)
  /// @brief Bits of one (token, layer) entry: K * bits_per_id, or the rank's bits order-free.
  [[nodiscard]] std::uint32_t entry_bits() const noexcept { return h_.entry_bits; }
  [[nodiscard]] bool ordered() const noexcept { return !h_.order_free(); }  ///< columns keep top-k order
  [[nodiscard]] route_codec codec() const noexcept { return h_.codec; }    ///< the codec asked for
  [[nodiscard]] std::uint32_t chunk_tokens() const noexcept { return h_.chunk_tokens; }
  [[nodiscard]] std::uint32_t num_chunks() const noexcept { return h_.num_chunks; }
  [[nodiscard]] std::uint32_t missing_rows() const noexcept { return h_.missing_rows; }
  [[nodiscard]] std::uint16_t version() const noexcept { return h_.version; }
  [[nodiscard]] std::uint64_t size_bytes() const noexcept { return h_.record_bytes; }
  [[nodiscard]] std::uint64_t payload_bytes() const noexcept { return h_.payload_bytes; }
  /// @brief The model layer of each captured layer.
  [[nodiscard]] std::span<const std::uint32_t> layer_map() const noexcept { return layer_map_; }

  /// @brief Whether row `t` (from row 0) was computed; false for a missing row.
  [[nodiscard]] bool row_present(std::uint32_t t) const noexcept
  {
    if (!h_.has_missing()) { return true; }
    return ((std::to_integer<unsigned>(bitmap()[t / 8]) >> (t % 8)) & 1u) != 0;
  }

  /// @brief How chunk `c` is stored.
  [[nodiscard]] route_chunk_info chunk(std::uint32_t c) const noexcept
  {
    return {c * h_.chunk_tokens, h_.tokens_in_chunk(c), index_[c].stored_bytes, index_[c].codec};
  }

  /// @brief The chunks [first, last) that rows [token_begin, token_end) lie in.
  [[nodiscard]] std::pair<std::uint32_t, std::uint32_t> chunks_of(std::uint32_t token_begin,
                                                                  std::uint32_t token_end) const noexcept
  {
    if (token_begin >= token_end) { return {0, 0}; }
    return {token_begin / h_.chunk_tokens, (token_end - 1) / h_.chunk_tokens + 1};
  }

  /// @brief Decodes rows [token_begin, token_end) (from row 0), captured layers [layer_begin,
  /// layer_end), into `out`: id (t, l, k) of the range goes to out[t * token_stride + l *
  /// layer_stride + k]; a missing row's ids are all `missing`. Order-free records give each entry's
  /// ids ascending. Only the chunks the rows lie in are read and checked.
  /// @throws error invalid_argument for a range outside the record, index_type_too_narrow where Id
  /// cannot hold E - 1, invalid_record for a chunk whose checksum, frame or ids are wrong
  template <std::integral Id>
  void decode(std::uint32_t token_begin, std::uint32_t token_end, std::uint32_t layer_begin, std::uint32_t layer_end,
              Id* out, std::ptrdiff_t token_stride, std::ptrdiff_t layer_stride, Id missing) const
  {
    namespace w = detail::wire;
    if (token_begin > token_end || token_end > h_.num_tokens || layer_begin > layer_end || layer_end > h_.num_layers) {
      throw error{errc::invalid_argument, "route record: rows [" + std::to_string(token_begin) + ", " +
                                            std::to_string(token_end) + "), layers [" + std::to_string(layer_begin) + ", " +
                                            std::to_string(layer_end) + ") outside " + std::to_string(h_.num_tokens) +
                                            " rows x " + std::to_string(h_.num_layers) + " layers"};
    }
    if (static_cast<std::uint64_t>(std::numeric_limits<Id>::max()) < h_.num_experts - 1u) {
      throw error{errc::index_type_too_narrow, "route record: " + std::to_string(h_.num_experts) +
                                                 " experts do not fit the output's integer type"};
    }
    const std::uint32_t K = h_.top_k, nl = layer_end - layer_begin;
    if (token_begin == token_end || nl == 0) { return; }
    const std::uint32_t L = h_.num_layers;
    // Where Id holds 2^bits - 1, a packed chunk unpacks straight into the caller's rows (no staging
    // pass), and where E is a power of two no unpacked id can be out of range (no checking pass).
    const bool fits_bits = static_cast<std::uint64_t>(std::numeric_limits<Id>::max()) >= (std::uint64_t{1} << h_.bits_per_id) - 1;
    const bool direct = fits_bits && !h_.order_free() && layer_stride == static_cast<std::ptrdiff_t>(K);
    const bool whole  = direct && nl == L && token_stride == static_cast<std::ptrdiff_t>(std::size_t{L} * K);
    const bool check_ids = (std::uint64_t{1} << h_.bits_per_id) != h_.num_experts;
    const auto [c0, c1] = chunks_of(token_begin, token_end);
    scratch s;
    const std::size_t per_token = std::size_t{nl} * K;
    // Rows go through a staging block of about 8k ids (16 KiB, in L1) between unpacking and the
    // output, not through a whole chunk's worth.
    const std::uint32_t block = static_cast<std::uint32_t>(std::max<std::size_t>(1, 8192 / per_token));
    s.ids.resize(std::size_t{std::min(block, token_end - token_begin)} * per_token);
    w::zstd_decompressor unzstd;
    for (std::uint32_t c = c0; c < c1; ++c) {
      const std::uint32_t first = c * h_.chunk_tokens;
      const std::uint32_t a = std::max(token_begin, first) - first;
      const std::uint32_t b = std::min(token_end, first + h_.tokens_in_chunk(c)) - first;
      const std::byte* data = chunk_bytes(c, unzstd, s);
      if (direct && index_[c].codec != route_codec::zstd_columns) {
        decode_direct(c, data, s.size, first, a, b, token_begin, layer_begin, nl, whole, check_ids, out, token_stride, missing);
        continue;
      }
      for (std::uint32_t ta = a; ta < b; ta += block) {
        const std::uint32_t tb = std::min(b, ta + block);
        std::uint16_t* ids = s.ids.data();
        unpack_block(c, data, s.size, ta, tb, layer_begin, nl, ids);
        std::uint16_t top = 0;
        for (std::size_t i = 0; i < (tb - ta) * per_token; ++i) { top = std::max(top, ids[i]); }
        if (top >= h_.num_experts) { bad_ids(c, "expert id " + std::to_string(top) + " >= " + std::to_string(h_.num_experts)); }
        for (std::uint32_t t = ta; t < tb; ++t) {
          Id* row = out + static_cast<std::ptrdiff_t>(first + t - token_begin) * token_stride;
          const std::uint16_t* src = ids + (t - ta) * per_token;
          if (!row_present(first + t)) {
            for (std::uint32_t l = 0; l < nl; ++l) { std::fill_n(row + static_cast<std::ptrdiff_t>(l) * layer_stride, K, missing); }
          } else if (layer_stride == static_cast<std::ptrdiff_t>(K)) {
            for (std::size_t i = 0; i < per_token; ++i) { row[i] = static_cast<Id>(src[i]); }
          } else {
            for (std::uint32_t l = 0; l < nl; ++l) {
              Id* dst = row + static_cast<std::ptrdiff_t>(l) * layer_stride;
              for (std::uint32_t k = 0; k < K; ++k) { dst[k] = static_cast<Id>(src[l * K + k]); }
            }
          }
        }
      }
    }
  }

  /// @brief Decodes the whole record into a new [T, L, K] array.
  template <std::integral Id>
  [[nodiscard]] std::vector<Id> decode_all(Id missing) const
  {
    std::vector<Id> out(std::size_t{h_.num_tokens} * h_.num_layers * h_.top_k);
    decode<Id>(0, h_.num_tokens, 0, h_.num_layers, out.data(), std::ptrdiff_t{h_.num_layers} * h_.top_k, h_.top_k, missing);
    return out;
  }

  /// @brief Checks every chunk (checksum, frame, ids) without keeping what it decodes.
  /// @throws error invalid_record as decode does
  void verify() const
  {
    std::vector<std::int32_t> rows(std::size_t{h_.chunk_tokens} * h_.num_layers * h_.top_k);
    for (std::uint32_t c = 0; c < h_.num_chunks; ++c) {
      const std::uint32_t first = c * h_.chunk_tokens;
      decode<std::int32_t>(first, first + h_.tokens_in_chunk(c), 0, h_.num_layers, rows.data(),
                           std::ptrdiff_t{h_.num_layers} * h_.top_k, h_.top_k, -1);
    }
  }

 private:
  struct scratch {
    std::vector<std::uint16_t> ids;  // the range of one chunk, [tokens][layers][K]
    std::vector<std::byte> chunk;    // a decompressed chunk
    std::size_t size = 0;            // bytes of the chunk's data as chunk_bytes returned it
  };

  /// The largest of n unpacked (so non-negative) ids, in fixed blocks of 32 that the compiler
  /// vectorizes even at -O2 (its cheap cost model refuses a loop that needs an epilogue).
  template <class Id>
  [[nodiscard]] static std::uint64_t max_of(const Id* v, std::size_t n) noexcept
  {
    Id top = 0;
    std::size_t i = 0;
    for (; i + 32 <= n; i += 32) {
      Id m = 0;
      for (std::size_t j = 0; j < 32; ++j) { m = v[i + j] > m ? v[i + j] : m; }
      top = m > top ? m : top;
    }
    for (; i < n; ++i) { top = v[i] > top ? v[i] : top; }
    return static_cast<std::uint64_t>(top);
  }

  /// A packed chunk's rows [a, b) straight into the caller's rows (layer_stride == K), then the
  /// range check where E is not a power of two, then the missing rows' fill.
  template <class Id>
  void decode_direct(std::uint32_t c, const std::byte* data, std::size_t size, std::uint32_t first, std::uint32_t a,
                     std::uint32_t b, std::uint32_t token_begin, std::uint32_t layer_begin, std::uint32_t nl, bool whole,
                     bool check_ids, Id* out, std::ptrdiff_t token_stride, Id missing) const
  {
    const std::uint32_t K = h_.top_k, L = h_.num_layers;
    const std::size_t per_token = std::size_t{nl} * K;
    Id* rows = out + static_cast<std::ptrdiff_t>(first + a - token_begin) * token_stride;
    if (whole) {
      detail::wire::unpack_ids(data, size, h_.bits_per_id, std::size_t{a} * per_token, (b - a) * per_token, rows);
    } else {
      for (std::uint32_t t = a; t < b; ++t) {
        detail::wire::unpack_ids(data, size, h_.bits_per_id, (std::size_t{t} * L + layer_begin) * K, per_token,
                                 rows + static_cast<std::ptrdiff_t>(t - a) * token_stride);
      }
    }
    for (std::uint32_t t = a; t < b; ++t) {
      Id* row = rows + static_cast<std::ptrdiff_t>(t - a) * token_stride;
      if (check_ids) {
        if (const std::uint64_t top = max_of(row, per_token); top >= h_.num_experts) { bad_ids(c, "expert id " + std::to_string(top) + " >= " + std::to_string(h_.num_experts)); }
      }
      if (!row_present(first + t)) { std::fill_n(row, per_token, missing); }
    }
  }

  /// Ids of rows [a, b) of chunk c, layers [layer_begin, layer_begin + nl), into ids [b - a][nl][K].
  void unpack_block(std::uint32_t c, const std::byte* data, std::size_t size, std::uint32_t a, std::uint32_t b,
                    std::uint32_t layer_begin, std::uint32_t nl, std::uint16_t* ids) const
  {
    namespace w = detail::wire;
    const std::uint32_t K = h_.top_k, L = h_.num_layers;
    const std::size_t per_token = std::size_t{nl} * K;
    if (index_[c].codec == route_codec::zstd_columns) {
      // layer by layer: a layer's rows [a, b) are one contiguous run of the column form
      const std::uint32_t width = w::column_bytes(h_.num_experts), n = h_.tokens_in_chunk(c);
      for (std::uint32_t l = 0; l < nl; ++l) {
        const auto* src = reinterpret_cast<const unsigned char*>(data) + (std::size_t{layer_begin + l} * n + a) * K * width;
        for (std::uint32_t t = a; t < b; ++t, src += std::size_t{K} * width) {
          std::uint16_t* dst = ids + (t - a) * per_token + std::size_t{l} * K;
          if (width == 1) {
            for (std::uint32_t k = 0; k < K; ++k) { dst[k] = src[k]; }
          } else {
            for (std::uint32_t k = 0; k < K; ++k) { dst[k] = static_cast<std::uint16_t>(src[2 * k] | (src[2 * k + 1] << 8)); }
          }
        }
      }
    } else if (h_.order_free()) {
      for (std::uint32_t t = a; t < b; ++t) {
        for (std::uint32_t l = 0; l < nl; ++l) {
          const std::size_t entry = std::size_t{t} * L + layer_begin + l;
          const w::uint128 r      = w::read_bits(data, size, entry * h_.entry_bits, h_.entry_bits);
          if (r >= sets_.count()) { bad_ids(c, "an order-free rank past C(E, K)"); }
          sets_.unrank(r, ids + (t - a) * per_token + std::size_t{l} * K);
        }
      }
    } else if (nl == L) {  // whole rows: one contiguous run of ids
      w::unpack_ids(data, size, h_.bits_per_id, std::size_t{a} * per_token, (b - a) * per_token, ids);
    } else {
      for (std::uint32_t t = a; t < b; ++t) {
        w::unpack_ids(data, size, h_.bits_per_id, (std::size_t{t} * L + layer_begin) * K, per_token, ids + (t - a) * per_token);
      }
    }
  }

  [[nodiscard]] const std::byte* bitmap() const noexcept { return bytes_.data() + h_.bitmap_offset(); }

  [[noreturn]] static void bad_ids(std::uint32_t c, const std::string& what)
  {
    detail::wire::bad_record("chunk " + std::to_string(c) + ": " + what);
  }

  /// The chunk's data in its decoded form (packed bytes, or the column form), after its checksum.
  const std::byte* chunk_bytes(std::uint32_t c, detail::wire::zstd_decompressor& unzstd, scratch& s) const
  {
    namespace w = detail::wire;
    const w::chunk_entry& e = index_[c];
    const std::byte* stored = bytes_.data() + h_.payload_offset() + e.offset;
    if (detail::xxhash64({stored, e.stored_bytes}) != e.checksum) {
      bad_ids(c, "checksum mismatch (the payload is corrupted)");
    }
    if (e.codec == route_codec::packed) {
      s.size = e.stored_bytes;
      return stored;
    }
    const std::uint32_t n = h_.tokens_in_chunk(c);
    s.size = e.codec == route_codec::zstd ? h_.packed_chunk_bytes(n)
                                          : std::size_t{n} * h_.num_layers * h_.top_k * w::column_bytes(h_.num_experts);
    s.chunk.resize(s.size);
    unzstd.decompress(stored, e.stored_bytes, s.size, s.chunk.data(), c);
    return s.chunk.data();
  }

  void read_index()
  {
    namespace w = detail::wire;
    const std::byte* p = bytes_.data() + h_.index_offset();
    index_.resize(h_.num_chunks);
    std::uint64_t offset = 0;
    for (std::uint32_t c = 0; c < h_.num_chunks; ++c, p += w::chunk_entry_bytes) {
      w::chunk_entry& e = index_[c];
      e.offset       = w::load_le<std::uint64_t>(p);
      e.stored_bytes = w::load_le<std::uint32_t>(p + 8);
      const auto codec = w::load_le<std::uint8_t>(p + 12);
      e.checksum     = w::load_le<std::uint64_t>(p + 16);
      const std::string at = "chunk " + std::to_string(c) + ": ";
      if (p[13] != std::byte{0} || p[14] != std::byte{0} || p[15] != std::byte{0}) { w::bad_record(at + "reserved bytes not zero"); }
      if (!w::known_codec(codec)) { w::bad_record(at + "unknown codec " + std::to_string(codec)); }
      e.codec = static_cast<route_codec>(codec);
      // zstd_columns records keep a chunk as zstd where the packed form compressed better
      const bool allowed = e.codec == route_codec::packed || e.codec == h_.codec ||
                           (e.codec == route_codec::zstd && h_.codec == route_codec::zstd_columns);
      if (!allowed) {
        w::bad_record(at + "codec " + route_codec_name(e.codec) + " in a record of codec " + route_codec_name(h_.codec));
      }
      if (e.codec == route_codec::zstd_columns && h_.order_free()) { w::bad_record(at + "zstd_columns in an order-free record"); }
      if (e.offset != offset) {
        w::bad_record(at + "offset " + std::to_string(e.offset) + ", the chunks before end at " + std::to_string(offset));
      }
      const std::uint64_t packed = h_.packed_chunk_bytes(h_.tokens_in_chunk(c));
      if (e.codec == route_codec::packed ? e.stored_bytes != packed : (e.stored_bytes == 0 || e.stored_bytes >= packed)) {
        w::bad_record(at + std::to_string(e.stored_bytes) + " bytes stored " + route_codec_name(e.codec) + ", packed it is " +
                      std::to_string(packed));
      }
      offset += e.stored_bytes;
    }
    if (offset != h_.payload_bytes) {
      w::bad_record("the chunks hold " + std::to_string(offset) + " bytes, the payload " + std::to_string(h_.payload_bytes));
    }
  }

  void read_bitmap() const
  {
    if (!h_.has_missing()) { return; }
    const std::byte* b = bitmap();
    std::uint64_t present = 0;
    for (std::uint64_t i = 0; i < h_.bitmap_bytes(); ++i) { present += std::popcount(std::to_integer<unsigned>(b[i])); }
    if (h_.num_tokens % 8 != 0 && (std::to_integer<unsigned>(b[h_.bitmap_bytes() - 1]) >> (h_.num_tokens % 8)) != 0) {
      detail::wire::bad_record("validity bitmap has bits set past the last row");
    }
    if (h_.missing_rows == 0 || h_.num_tokens - present != h_.missing_rows) {
      detail::wire::bad_record("validity bitmap marks " + std::to_string(h_.num_tokens - present) +
                               " rows missing, the header " + std::to_string(h_.missing_rows));
    }
  }

  std::span<const std::byte> bytes_;
  detail::wire::record_header h_;
  std::vector<std::uint32_t> layer_map_;
  std::vector<detail::wire::chunk_entry> index_;
  detail::wire::combinatorial_table sets_;
};

ROUTING_REPLAY_WIRE_ABI_END
}  // namespace routing_replay
