/// @file
/// route_record_encoder: rows in, one route record out. Rows are read through strides straight from
/// the caller's storage (an engine's per-request rows, a numpy array) and staged one chunk at a time
/// as 16-bit ids, so that nothing of size [T, L, K] is ever copied; each full chunk is packed (and
/// compressed) at once and only its stored bytes are kept: packed in place at the end of the
/// payload, or, after write_into, straight into the caller's record buffer at its final place.
#pragma once

#include <routing_replay/detail/wire/abi.hpp>
#include <routing_replay/detail/wire/bit_pack.hpp>
#include <routing_replay/detail/wire/combinatorial.hpp>
#include <routing_replay/detail/wire/format.hpp>
#include <routing_replay/detail/wire/zstd_codec.hpp>
#include <routing_replay/detail/xxhash64.hpp>
#include <routing_replay/errors.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace routing_replay::detail::wire {
ROUTING_REPLAY_WIRE_ABI_BEGIN

/// std::allocator, but `resize` leaves new elements default-initialized (bytes: not zeroed): a
/// buffer the encoder writes whole right after growing it need not be cleared first.
template <class T>
struct uninitialized_allocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = uninitialized_allocator<U>;
  };
  uninitialized_allocator() = default;
  template <class U>
  uninitialized_allocator(const uninitialized_allocator<U>&) noexcept {}
  template <class U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>)
  {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args)
  {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
/// A byte buffer that grows without clearing.
using byte_buffer = std::vector<std::byte, uninitialized_allocator<std::byte>>;

ROUTING_REPLAY_WIRE_ABI_END
}  // namespace routing_replay::detail::wire

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
    : options_(std::move(options)), compressor_(options_.zstd_level)
  {
    namespace w = detail::wire;
    auto bad    = [](const std::string& what) { throw error{errc::invalid_argument, "route_record_encoder: " + what}; };
    if (num_layers < 1 || num_layers > w::max_layers) { bad("num_layers " + std::to_string(num_layers) + " outside [1, 4096]"); }
    if (num_experts < 1 || num_experts > w::max_experts) { bad("num_experts " + std::to_string(num_experts) + " outside [1, 65536]"); }
    if (top_k < 1 || top_k > std::min(num_experts, w::max_top_k)) {
      bad("top_k " + std::to_string(top_k) + " outside [1, min(num_experts, 64)]");
    }
    if (options_.chunk_tokens < 1 || options_.chunk_tokens > w::max_chunk_tokens ||
        std::uint64_t{options_.chunk_tokens} * num_layers * top_k > w::max_chunk_ids) {
      bad("chunk_tokens " + std::to_string(options_.chunk_tokens) + " outside [1, 65536] or past 2^26 ids a chunk");
    }
    if (options_.token_start < 0 || options_.token_start > w::max_token_start) {
      bad("token_start " + std::to_string(options_.token_start) + " outside [0, 2^31)");
    }
    if (options_.layer_map.empty()) {
      for (std::uint32_t l = 0; l < num_layers; ++l) { options_.layer_map.push_back(l); }
    } else if (options_.layer_map.size() != num_layers) {
      bad("layer_map has " + std::to_string(options_.layer_map.size()) + " entries for " + std::to_string(num_layers) + " layers");
    }
    {
      std::vector<std::uint32_t> sorted = options_.layer_map;
      std::sort(sorted.begin(), sorted.end());
      if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
        bad("layer_map names model layer " + std::to_string(*std::adjacent_find(sorted.begin(), sorted.end())) + " twice");
      }
    }
    if (!options_.ordered && options_.codec == route_codec::zstd_columns) {
      bad("zstd_columns transposes columns in top-k order; an order-free record takes packed or zstd");
    }
    if (options_.codec != route_codec::packed && !w::zstd_available) {
      bad(std::string{"codec "} + route_codec_name(options_.codec) +
          " needs libzstd, and this build has none (link routing_replay::zstd)");
    }
    header_.num_layers   = num_layers;
    header_.top_k        = top_k;
    header_.num_experts  = num_experts;
    header_.bits_per_id  = w::bits_for_experts(num_experts);
    header_.codec        = options_.codec;
    header_.token_start  = options_.token_start;
    header_.chunk_tokens = options_.chunk_tokens;
    header_.entry_bits   = top_k * header_.bits_per_id;
    if (!options_.ordered) {
      header_.entry_bits = w::rank_bits(num_experts, top_k, w::max_order_free_table);
      if (header_.entry_bits == 0) {
        bad("the order-free form holds C(E, K) < 2^127 with E * (K + 1) <= 2^20; " + std::to_string(top_k) + " of " +
            std::to_string(num_experts) + " is past that");
      }
      header_.flags |= w::flag_order_free;
      sets_ = w::combinatorial_table{num_experts, top_k};
    }
    row_ids_ = std::size_t{num_layers} * top_k;
    stage_.resize(std::size_t{options_.chunk_tokens} * row_ids_);
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
    if (std::uint64_t{rows_} + n > detail::wire::max_tokens) {
      throw error{errc::invalid_argument, "route_record_encoder: more than 2^31 - 1 rows"};
    }
    try {
      for (std::size_t t = 0; t < n; ++t) {
        stage_row(base + static_cast<std::ptrdiff_t>(t) * token_stride, layer_stride, missing_sentinel, t);
      }
    } catch (...) {
      reset();  // rows of the call may already sit in a packed chunk: the record cannot be trusted
      throw;
    }
  }

  /// @brief Appends `n` rows the engine never computed (marked in the validity bitmap).
  void append_missing(std::size_t n)
  {
    if (std::uint64_t{rows_} + n > detail::wire::max_tokens) {
      throw error{errc::invalid_argument, "route_record_encoder: more than 2^31 - 1 rows"};
    }
    try {
      for (std::size_t i = 0; i < n; ++i) {
        stage_missing(stage_.data() + std::size_t{staged_} * row_ids_);
        mark(false);
      }
    } catch (...) {
      reset();
      throw;
    }
  }

  /// @brief Rows appended so far.
  [[nodiscard]] std::uint32_t num_tokens() const noexcept { return rows_; }

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
    if (rows_ != 0) { throw error{errc::invalid_argument, "route_record_encoder: write_into on an encoder that holds rows"}; }
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
    return stage_.capacity() * sizeof(std::uint16_t) + packed_.capacity() + columns_.capacity() + compressed_.capacity() +
           best_.capacity() + payload_.capacity() + valid_.capacity() + chunks_.capacity() * sizeof(detail::wire::chunk_entry);
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
    if (staged_ > 0) { flush_chunk(); }
    if (direct_ != nullptr && rows_ != direct_tokens_) { leave_direct(); }  // fewer rows than planned
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
    header_.num_tokens   = rows_;
    header_.num_chunks   = static_cast<std::uint32_t>(chunks_.size());
    header_.missing_rows = missing_;
    header_.flags        = (header_.flags & ~w::flag_has_missing) | (missing_ > 0 ? w::flag_has_missing : 0u);
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
    if (missing_ > 0) { std::copy_n(valid_.data(), header_.bitmap_bytes(), q); q += header_.bitmap_bytes(); }
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
    valid_.reserve(valid_.size() + tokens / 8 + 1);
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
           (missing_ > 0 ? (std::size_t{rows_} + 7) / 8 : 0);
  }

  void reset() noexcept
  {
    rows_ = staged_ = missing_ = 0;
    payload_.clear();
    chunks_.clear();
    valid_.clear();
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

  void mark(bool present)
  {
    if (rows_ % 8 == 0) { valid_.push_back(std::byte{0}); }
    if (present) {
      valid_.back() |= static_cast<std::byte>(1u << (rows_ % 8));
    } else {
      ++missing_;
      if (direct_ != nullptr) { leave_direct(); }  // a bitmap now comes before the payload
    }
    ++rows_;
    if (++staged_ == options_.chunk_tokens) { flush_chunk(); }
  }

  template <class Id>
  void stage_row(const Id* row, std::ptrdiff_t layer_stride, std::optional<Id> sentinel, std::size_t t)
  {
    const std::uint32_t K = header_.top_k, E = header_.num_experts;
    std::uint16_t* out = stage_.data() + std::size_t{staged_} * row_ids_;
    bool bad = false;
    if (layer_stride == static_cast<std::ptrdiff_t>(K)) {  // a contiguous row: flat loops
      // The conversion, then the range check as a min and a max in Id itself (a negative id of a
      // signed type must never alias a valid one through the narrowing). Separate loops in fixed
      // blocks of 32 are what g++ vectorizes at -O2 (its cheap cost model refuses a loop that
      // needs an epilogue, or one that stores and reduces at once).
      if constexpr (sizeof(Id) == sizeof(std::uint16_t)) {
        std::memcpy(out, row, row_ids_ * sizeof(Id));  // the same bits: negatives fail the check below
      } else {
        for (std::size_t i = 0; i < row_ids_; ++i) { out[i] = static_cast<std::uint16_t>(row[i]); }
      }
      Id lo = row[0], hi = row[0];
      std::size_t i = 0;
      for (; i + 32 <= row_ids_; i += 32) {
        Id bl = row[i], bh = row[i];
        for (std::size_t j = 0; j < 32; ++j) {
          bl = row[i + j] < bl ? row[i + j] : bl;
          bh = row[i + j] > bh ? row[i + j] : bh;
        }
        lo = bl < lo ? bl : lo;
        hi = bh > hi ? bh : hi;
      }
      for (; i < row_ids_; ++i) {
        lo = row[i] < lo ? row[i] : lo;
        hi = row[i] > hi ? row[i] : hi;
      }
      bad = lo < 0 || static_cast<std::uint64_t>(hi) >= E;
    } else {
      stage_strided(row, layer_stride, out, bad);
    }
    if (bad) {
      if (sentinel && whole_row_is(row, layer_stride, *sentinel)) {
        stage_missing(out);
        mark(false);
        return;
      }
      refuse_row(row, layer_stride, sentinel, t);
    }
    if (!options_.ordered) { check_sets(out, t); }
    mark(true);
  }

  template <class Id>
  void stage_strided(const Id* row, std::ptrdiff_t layer_stride, std::uint16_t* out, bool& bad) const noexcept
  {
    const std::uint32_t L = header_.num_layers, K = header_.top_k, E = header_.num_experts;
    for (std::uint32_t l = 0; l < L; ++l) {
      const Id* ids = row + static_cast<std::ptrdiff_t>(l) * layer_stride;
      for (std::uint32_t k = 0; k < K; ++k) {
        // negatives become huge through the signed widening, so one unsigned compare catches both
        const auto v = static_cast<std::uint64_t>(static_cast<std::int64_t>(ids[k]));
        bad |= v >= E;
        out[l * K + k] = static_cast<std::uint16_t>(ids[k]);
      }
    }
  }

  // A missing row's ids are stored as the entry of code 0: ids 0 (ordered) or the set {0, .., K-1}
  // (rank 0), so that packing needs no branch for it; the bitmap is what marks it.
  void stage_missing(std::uint16_t* out) const noexcept
  {
    for (std::size_t i = 0; i < row_ids_; ++i) {
      out[i] = options_.ordered ? std::uint16_t{0} : static_cast<std::uint16_t>(i % header_.top_k);
    }
  }

  template <class Id>
  [[nodiscard]] bool whole_row_is(const Id* row, std::ptrdiff_t layer_stride, Id v) const noexcept
  {
    for (std::uint32_t l = 0; l < header_.num_layers; ++l) {
      for (std::uint32_t k = 0; k < header_.top_k; ++k) {
        if (row[static_cast<std::ptrdiff_t>(l) * layer_stride + k] != v) { return false; }
      }
    }
    return true;
  }

  template <class Id>
  [[noreturn]] void refuse_row(const Id* row, std::ptrdiff_t layer_stride, std::optional<Id> sentinel, std::size_t t) const
  {
    for (std::uint32_t l = 0; l < header_.num_layers; ++l) {
      for (std::uint32_t k = 0; k < header_.top_k; ++k) {
        const Id v = row[static_cast<std::ptrdiff_t>(l) * layer_stride + k];
        if (v < 0 || static_cast<std::uint64_t>(v) >= header_.num_experts) {
          std::string why = "route_record_encoder: row " + std::to_string(t) + " of the call, layer " + std::to_string(l) +
                            ", column " + std::to_string(k) + ": expert id " + std::to_string(static_cast<long long>(v)) +
                            " outside [0, " + std::to_string(header_.num_experts) + ")";
          if (sentinel && v == *sentinel) { why += " (the missing-row sentinel, but the row is only partly missing)"; }
          throw error{errc::invalid_expert_id, why};
        }
      }
    }
    throw error{errc::invalid_expert_id, "route_record_encoder: row " + std::to_string(t) + " has an id out of range"};
  }

  void check_sets(const std::uint16_t* ids, std::size_t t) const
  {
    for (std::uint32_t l = 0; l < header_.num_layers; ++l) {
      if (!sets_.rank(ids + std::size_t{l} * header_.top_k)) {
        throw error{errc::invalid_argument, "route_record_encoder: row " + std::to_string(t) + " of the call, layer " +
                                              std::to_string(l) + ": an id repeats, and the order-free form stores sets"};
      }
    }
  }

  void flush_chunk()
  {
    namespace w = detail::wire;
    const std::uint32_t tokens = staged_;
    const std::size_t ids      = std::size_t{tokens} * row_ids_;
    const std::size_t bytes    = header_.packed_chunk_bytes(tokens);
    if (direct_ != nullptr && (direct_used_ + bytes > direct_capacity_ || rows_ > direct_tokens_)) { leave_direct(); }
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
      w::pack_ids(stage_.data(), ids, header_.bits_per_id, packed);  // stores every byte it covers
    } else {
      std::fill_n(packed, bytes + w::pack_slack, std::byte{0});  // bit_writer ORs into zeroed bytes
      w::bit_writer out{packed};
      for (std::size_t e = 0; e < std::size_t{tokens} * header_.num_layers; ++e) {
        out.put(*sets_.rank(stage_.data() + e * header_.top_k), header_.entry_bits);
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
        w::to_columns(stage_.data(), tokens, header_.num_layers, header_.top_k, width, columns_.data());
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
    staged_ = 0;
  }

  route_record_options options_;
  detail::wire::record_header header_;
  detail::wire::combinatorial_table sets_;
  detail::wire::zstd_compressor compressor_;
  std::size_t row_ids_ = 0;            // L * K
  std::vector<std::uint16_t> stage_;   // the chunk being filled, [chunk_tokens][L][K]
  detail::wire::byte_buffer packed_;   // a chunk packed aside (the last of a caller's buffer)
  std::vector<std::byte> columns_, compressed_, best_;
  detail::wire::byte_buffer payload_;  // stored chunks, back to back
  std::vector<detail::wire::chunk_entry> chunks_;
  std::vector<std::byte> valid_;       // the validity bitmap, a bit a row (1: present)
  std::uint32_t rows_ = 0, staged_ = 0, missing_ = 0;
  // write_into: the caller's record buffer, where its payload starts, its room and what is used
  std::byte* direct_out_ = nullptr;
  std::byte* direct_     = nullptr;
  std::size_t direct_capacity_ = 0, direct_used_ = 0;
  std::uint32_t direct_tokens_ = 0;
};

ROUTING_REPLAY_WIRE_ABI_END
}  // namespace routing_replay
