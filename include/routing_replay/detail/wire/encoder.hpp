/// @file
/// route_record_encoder: rows in, one route record out. Rows are read through strides straight from
/// the caller's storage (an engine's per-request rows, a numpy array) and staged one chunk at a time
/// as 16-bit ids, so that nothing of size [T, L, K] is ever copied; each full chunk is packed (and
/// compressed) at once and only its stored bytes are kept: packed in place at the end of the
/// payload, or, after write_into, straight into the caller's record buffer at its final place.
/// The per-row checks and the validity bitmap are row_stager's (row_stager.hpp), the options and
/// their check record_options.hpp's; this file holds the chunks' packing, compression and placing.
#pragma once

#include <routing_replay/detail/wire/abi.hpp>
#include <routing_replay/detail/wire/bit_pack.hpp>
#include <routing_replay/detail/wire/byte_buffer.hpp>
#include <routing_replay/detail/wire/combinatorial.hpp>
#include <routing_replay/detail/wire/format.hpp>
#include <routing_replay/detail/wire/record_options.hpp>
#include <routing_replay/detail/wire/row_stager.hpp>
#include <routing_replay/detail/wire/zstd_codec.hpp>
#include <routing_replay/detail/xxhash64.hpp>
#include <routing_replay/errors.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace routing_replay {
ROUTING_REPLAY_WIRE_ABI_BEGIN

/// @brief Builds one route record (docs/wire.md) from rows appended in position order.
///
/// A row is one token's [L, K] ids. Rows come from `append` (through strides, from any integer
/// type) or `append_missing` (rows the engine never computed: the validity bitmap marks them, they
/// cost no sentinel bit in every id). `finish_into` writes the record and makes the encoder ready
/// for the next one with the same shape and options.
class route_record_encoder {
 public:
  /// @throws error invalid_argument for a shape past docs/wire.md's limits, a layer map of another
  /// length, a zstd codec in a build without zstd, or an order-free form for a shape it cannot hold
  route_record_encoder(std::uint32_t num_layers, std::uint32_t top_k, std::uint32_t num_experts,
                       route_record_options options = {})
    : options_(std::move(options)),
      header_(detail::wire::checked_record_header(num_layers, top_k, num_experts, options_)),
      stager_(num_layers, top_k, num_experts, options_.ordered, options_.chunk_tokens),
      compressor_(options_.zstd_level)
  {
  }

  /// @brief Appends `n` rows: id (t, l, k) is `base[t * token_stride + l * layer_stride + k]`.
  ///
  /// Ids must lie in [0, E); order-free records also need the K ids of an entry distinct.
  /// With `missing_sentinel`, a row whose ids all equal it is appended as missing, and a row only
  /// partly so is refused. On a throw the record being built is dropped (the encoder is empty, as
  /// after finish_into): a record with a hole where a refused row was would be worse than none.
  /// @throws error invalid_expert_id naming the row, layer and id; invalid_argument past 2^31 - 1 rows
  template <std::integral Id>
  void append(const Id* base, std::size_t n, std::ptrdiff_t token_stride, std::ptrdiff_t layer_stride,
              std::optional<Id> missing_sentinel = std::nullopt)
  {
    if (n == 0) { return; }
    if (std::uint64_t{stager_.rows()} + n > detail::wire::max_tokens) {
      throw error{errc::invalid_argument, "route_record_encoder: more than 2^31 - 1 rows"};
    }
    try {
      for (std::size_t t = 0; t < n; ++t) {
        after_row(stager_.stage_row(base + static_cast<std::ptrdiff_t>(t) * token_stride, layer_stride, missing_sentinel, t));
      }
    } catch (...) {
      reset();  // rows of the call may already sit in a packed chunk: the record cannot be trusted
      throw;
    }
  }

  /// @brief Appends `n` rows the engine never computed (marked in the validity bitmap).
  void append_missing(std::size_t n)
  {
    if (std::uint64_t{stager_.rows()} + n > detail::wire::max_tokens) {
      throw error{errc::invalid_argument, "route_record_encoder: more than 2^31 - 1 rows"};
    }
    try {
      for (std::size_t i = 0; i < n; ++i) {
        stager_.stage_missing_row();
        after_row(false);
      }
    } catch (...) {
      reset();
      throw;
    }
  }

  /// @brief Rows appended so far.
  [[nodiscard]] std::uint32_t num_tokens() const noexcept { return stager_.rows(); }

  /// @brief Sets the position of row 0 of the record being built (an encoder kept for many
  /// records of one shape: each has its own first position).
  /// @throws error invalid_argument outside [0, 2^31)
  void set_token_start(std::int64_t token_start)
  {
    if (token_start < 0 || token_start > detail::wire::max_token_start) {
      throw error{errc::invalid_argument, "route_record_encoder: token_start " + std::to_string(token_start) + " outside [0, 2^31)"};
    }
    options_.token_start = token_start;
    header_.token_start  = token_start;
  }

  /// @brief The exact size of a record of `tokens` rows, none missing, with the packed codec (the
  /// size write_into wants; with a compressing codec, the most a record of them can take, plus its
  /// bitmap where rows are missing).
  [[nodiscard]] std::size_t packed_record_size(std::uint32_t tokens) const noexcept
  {
    const std::uint32_t ct     = options_.chunk_tokens;
    const std::uint32_t chunks = static_cast<std::uint32_t>((std::uint64_t{tokens} + ct - 1) / ct);
    const std::size_t full     = tokens / ct;
    return detail::wire::header_bytes + std::size_t{header_.num_layers} * 4 + std::size_t{chunks} * detail::wire::chunk_entry_bytes +
           full * header_.packed_chunk_bytes(ct) + header_.packed_chunk_bytes(tokens % ct);
  }

  /// @brief Packs the chunks of the next `tokens` rows straight into `out`, the buffer the record
  /// will be finished into (packed_record_size(tokens) bytes: a Python bytes object, a pinned
  /// buffer, ...), at their final place: finish_into(out) then writes only the header, layer map
  /// and chunk index around them, and no payload is kept or copied. Call it on an empty encoder
  /// of the packed codec. Where the plan fails (a row is missing, so a bitmap must come before
  /// the payload, or more rows come), the encoder takes the chunks packed so far back into its
  /// own memory and goes on there: finish_into(out) then throws for the size, and finished_size()
  /// says what a buffer must hold.
  /// @throws error invalid_argument for another codec, a non-empty encoder or `out` of another size
  void write_into(std::span<std::byte> out, std::uint32_t tokens)
  {
    if (options_.codec != route_codec::packed) {
      throw error{errc::invalid_argument, "route_record_encoder: write_into needs the packed codec (a compressed size is not known ahead)"};
    }
    if (stager_.rows() != 0) { throw error{errc::invalid_argument, "route_record_encoder: write_into on an encoder that holds rows"}; }
    if (out.size() != packed_record_size(tokens)) {
      throw error{errc::invalid_argument, "route_record_encoder: write_into a buffer of " + std::to_string(out.size()) +
                                            " bytes, a record of " + std::to_string(tokens) + " rows has " +
                                            std::to_string(packed_record_size(tokens))};
    }
    direct_out_      = out.data();
    direct_tokens_   = tokens;
    const std::size_t at = out.size() - payload_bytes_for(tokens);
    direct_          = out.data() + at;
    direct_capacity_ = out.size() - at;
    direct_used_     = 0;
  }

  /// @brief Bytes the encoder holds in its own buffers (kept between records: a caller that keeps
  /// one encoder for many records may drop it past a bound).
  [[nodiscard]] std::size_t capacity_bytes() const noexcept
  {
    return stager_.capacity_bytes() + packed_.capacity() + columns_.capacity() + compressed_.capacity() + best_.capacity() +
           payload_.capacity() + chunks_.capacity() * sizeof(detail::wire::chunk_entry);
  }

  /// @brief Writes the record into `buffer` (resized to it) and starts the next one.
  /// @return the record's size in bytes
  std::size_t finish_into(std::vector<std::byte>& buffer)
  {
    buffer.resize(finished_size());
    return finish_into(std::span<std::byte>{buffer});
  }

  /// @brief The size the record will have when finished now (it packs the partial chunk).
  [[nodiscard]] std::size_t finished_size()
  {
    if (stager_.staged() > 0) { flush_chunk(); }
    if (direct_ != nullptr && stager_.rows() != direct_tokens_) { leave_direct(); }  // fewer rows than planned
    return header_bytes_for(static_cast<std::uint32_t>(chunks_.size())) + payload_size();
  }

  /// @brief Writes the record into `out`, which holds exactly finished_size() bytes (a Python
  /// bytes object, a pinned buffer, ...), and starts the next one.
  /// @throws error invalid_argument where `out` has another size (nothing is written then)
  std::size_t finish_into(std::span<std::byte> out)
  {
    namespace w = detail::wire;
    if (out.size() != finished_size()) {
      throw error{errc::invalid_argument, "route_record_encoder: " + std::to_string(out.size()) +
                                            " bytes to finish into, the record has " + std::to_string(finished_size())};
    }
    header_.num_tokens   = stager_.rows();
    header_.num_chunks   = static_cast<std::uint32_t>(chunks_.size());
    header_.missing_rows = stager_.missing();
    header_.flags        = (header_.flags & ~w::flag_has_missing) | (stager_.missing() > 0 ? w::flag_has_missing : 0u);
    header_.payload_bytes = payload_size();
    header_.record_bytes  = header_.payload_offset() + payload_size();
    std::byte* p = out.data();
    std::byte* q = p + w::header_bytes;
    for (const std::uint32_t layer : options_.layer_map) { w::store_le<std::uint32_t>(q, layer); q += 4; }
    for (const w::chunk_entry& c : chunks_) {
      w::store_le<std::uint64_t>(q, c.offset);
      w::store_le<std::uint32_t>(q + 8, c.stored_bytes);
      w::store_le<std::uint8_t>(q + 12, static_cast<std::uint8_t>(c.codec));
      std::fill_n(q + 13, 3, std::byte{0});
      w::store_le<std::uint64_t>(q + 16, c.checksum);
      q += w::chunk_entry_bytes;
    }
    if (stager_.missing() > 0) { std::copy_n(stager_.bitmap(), header_.bitmap_bytes(), q); q += header_.bitmap_bytes(); }
    if (direct_ == nullptr) {
      std::copy(payload_.begin(), payload_.end(), q);
    } else if (direct_out_ != p || direct_ != q) {  // packed into another buffer: move it here
      std::memmove(q, direct_, direct_used_);
    }
    header_.checksum = 0;
    w::write_header(header_, p);
    header_.checksum = meta_checksum(p, header_.payload_offset());
    w::store_le<std::uint64_t>(p + w::checksum_offset, header_.checksum);
    const std::size_t size = out.size();
    reset();
    return size;
  }

  /// @brief Reserves room for `tokens` more rows' packed chunks (no reallocation while appending).
  void reserve(std::size_t tokens)
  {
    if (direct_ != nullptr) { return; }  // the chunks go to the caller's buffer
    payload_.reserve(payload_.size() + (tokens * header_.num_layers * header_.entry_bits + 7) / 8 + detail::wire::pack_slack);
    stager_.reserve(tokens);
  }

  /// @brief finish_into a new buffer.
  [[nodiscard]] std::vector<std::byte> finish()
  {
    std::vector<std::byte> out;
    finish_into(out);
    return out;
  }

  /// @brief The XXH64 the header carries: of bytes [0, 72), then, seeded with it, of [80, payload).
  [[nodiscard]] static std::uint64_t meta_checksum(const std::byte* record, std::size_t payload_offset) noexcept
  {
    namespace w = detail::wire;
    const std::uint64_t h = detail::xxhash64({record, w::checksum_offset});
    return detail::xxhash64({record + w::header_bytes, payload_offset - w::header_bytes}, h);
  }

 private:
  // header, layer map, chunk index and bitmap of a record of `chunks` chunks with the rows so far
  [[nodiscard]] std::size_t header_bytes_for(std::uint32_t chunks) const noexcept
  {
    return detail::wire::header_bytes + std::size_t{header_.num_layers} * 4 + std::size_t{chunks} * detail::wire::chunk_entry_bytes +
           (stager_.missing() > 0 ? (std::size_t{stager_.rows()} + 7) / 8 : 0);
  }

  void reset() noexcept
  {
    stager_.clear();
    payload_.clear();
    chunks_.clear();
    direct_ = direct_out_ = nullptr;
    direct_capacity_ = direct_used_ = 0;
    direct_tokens_ = 0;
  }

  [[nodiscard]] std::size_t payload_size() const noexcept { return direct_ != nullptr ? direct_used_ : payload_.size(); }

  // the packed payload of `tokens` rows in chunks of chunk_tokens
  [[nodiscard]] std::size_t payload_bytes_for(std::uint32_t tokens) const noexcept
  {
    const std::uint32_t ct = options_.chunk_tokens;
    return std::size_t{tokens / ct} * header_.packed_chunk_bytes(ct) + header_.packed_chunk_bytes(tokens % ct);
  }

  // write_into's plan failed: the chunks packed so far come back into the encoder's own payload
  void leave_direct()
  {
    payload_.assign(direct_, direct_ + direct_used_);
    direct_ = direct_out_ = nullptr;
    direct_capacity_ = direct_used_ = 0;
  }

  /// A row is staged: a missing one puts a bitmap before the payload, a full chunk is packed.
  void after_row(bool present)
  {
    if (!present && direct_ != nullptr) { leave_direct(); }  // a bitmap now comes before the payload
    if (stager_.chunk_full()) { flush_chunk(); }
  }

  void flush_chunk()
  {
    namespace w = detail::wire;
    const std::uint32_t tokens = stager_.staged();
    const std::uint16_t* stage = stager_.staged_ids();
    const std::size_t ids      = std::size_t{tokens} * header_.num_layers * header_.top_k;
    const std::size_t bytes    = header_.packed_chunk_bytes(tokens);
    if (direct_ != nullptr && (direct_used_ + bytes > direct_capacity_ || stager_.rows() > direct_tokens_)) { leave_direct(); }
    // The packed form goes where the chunk will be stored: the end of the payload (the caller's
    // buffer after write_into, else the encoder's own), with pack_slack writable past it (the
    // next chunk overwrites it). Only the last chunk of a caller's buffer, which has no slack
    // past it, is packed aside and copied.
    const std::size_t offset = payload_size();
    std::byte* at            = nullptr;
    if (direct_ != nullptr) {
      at = direct_used_ + bytes + w::pack_slack <= direct_capacity_ ? direct_ + direct_used_ : nullptr;
    } else {
      payload_.resize(offset + bytes + w::pack_slack);
      at = payload_.data() + offset;
    }
    std::byte* packed = at;
    if (packed == nullptr) {
      packed_.resize(bytes + w::pack_slack);
      packed = packed_.data();
    }
    if (options_.ordered) {
      w::pack_ids(stage, ids, header_.bits_per_id, packed);  // stores every byte it covers
    } else {
      std::fill_n(packed, bytes + w::pack_slack, std::byte{0});  // bit_writer ORs into zeroed bytes
      w::bit_writer out{packed};
      for (std::size_t e = 0; e < std::size_t{tokens} * header_.num_layers; ++e) {
        out.put(*stager_.sets().rank(stage + e * header_.top_k), header_.entry_bits);
      }
      out.finish();
    }
    const std::byte* stored = packed;
    std::size_t stored_size = bytes;
    route_codec codec       = route_codec::packed;
    if (options_.codec != route_codec::packed) {
      // a chunk that compression does not shrink is kept packed: no record is larger than packed.
      // zstd_columns keeps the smaller of zstd over the columns and zstd over the packed form, so
      // it is never larger than zstd either (routing without column structure compresses better
      // packed: a skewed router's repeats are whole entries either way, and 9-bit ids pack tighter)
      if (compressor_.compress(packed, bytes, compressed_) && compressed_.size() < stored_size) {
        stored_size = compressed_.size();
        codec       = route_codec::zstd;
        std::swap(best_, compressed_);
        stored = best_.data();
      }
      if (options_.codec == route_codec::zstd_columns) {
        const std::uint32_t width = w::column_bytes(header_.num_experts);
        columns_.resize(ids * width);
        w::to_columns(stage, tokens, header_.num_layers, header_.top_k, width, columns_.data());
        if (compressor_.compress(columns_.data(), columns_.size(), compressed_) && compressed_.size() < stored_size) {
          stored_size = compressed_.size();
          codec       = route_codec::zstd_columns;
          stored      = compressed_.data();
        }
      }
    }
    w::chunk_entry entry;
    entry.offset       = offset;
    entry.stored_bytes = static_cast<std::uint32_t>(stored_size);
    entry.codec        = codec;
    entry.checksum     = detail::xxhash64({stored, stored_size});
    if (direct_ != nullptr) {
      if (stored != direct_ + offset) { std::memcpy(direct_ + offset, stored, stored_size); }
      direct_used_ += stored_size;
    } else {
      // a compressed chunk is smaller than its packed form: it fits where that was packed
      if (stored != payload_.data() + offset) { std::memcpy(payload_.data() + offset, stored, stored_size); }
      payload_.resize(offset + stored_size);
    }
    chunks_.push_back(entry);
    stager_.chunk_taken();
  }

  route_record_options options_;
  detail::wire::record_header header_;
  detail::wire::row_stager stager_;    // rows in: the chunk being filled and the validity bitmap
  detail::wire::zstd_compressor compressor_;
  detail::wire::byte_buffer packed_;   // a chunk packed aside (the last of a caller's buffer)
  std::vector<std::byte> columns_, compressed_, best_;
  detail::wire::byte_buffer payload_;  // stored chunks, back to back
  std::vector<detail::wire::chunk_entry> chunks_;
  // write_into: the caller's record buffer, where its payload starts, its room and what is used
  std::byte* direct_out_ = nullptr;
  std::byte* direct_     = nullptr;
  std::size_t direct_capacity_ = 0, direct_used_ = 0;
  std::uint32_t direct_tokens_ = 0;
};

ROUTING_REPLAY_WIRE_ABI_END
}  // namespace routing_replay
