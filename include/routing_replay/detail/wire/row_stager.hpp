/// @file
/// row_stager: the route record encoder's first step, rows in, one chunk of 16-bit ids out. Each
/// row (one token's [L, K] ids, read through strides from the caller's storage, of any integer
/// type) is range-checked and narrowed into the chunk being filled, or stored as missing (the
/// validity bitmap marks it); order-free records also check each entry is a set. It is apart from
/// the encoder because it is the one per-id loop before packing, and knows nothing of chunks'
/// packing, compression or where their bytes go: the encoder packs the chunk when it is full.
#pragma once

#include <routing_replay/detail/wire/abi.hpp>
#include <routing_replay/detail/wire/combinatorial.hpp>
#include <routing_replay/errors.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace routing_replay::detail::wire {
ROUTING_REPLAY_WIRE_ABI_BEGIN

/// @brief Stages rows of [L, K] expert ids into the chunk being filled, [chunk_tokens][L][K], and
/// keeps the validity bitmap of the record's rows so far.
///
/// Every row appended lands in the next slot of the chunk; once chunk_full(), the owner packs
/// staged_ids() and calls chunk_taken() before the next row.
class row_stager {
 public:
  /// @brief An empty stager of no shape (a placeholder until the encoder has checked its shape).
  row_stager() = default;

  /// @pre the shape lies within docs/wire.md's limits; an order-free stager (`ordered` false)
  /// also needs rank_bits(num_experts, top_k, ...) != 0
  row_stager(std::uint32_t num_layers, std::uint32_t top_k, std::uint32_t num_experts, bool ordered,
             std::uint32_t chunk_tokens)
    : num_layers_(num_layers),
      top_k_(top_k),
      num_experts_(num_experts),
      chunk_tokens_(chunk_tokens),
      ordered_(ordered),
      row_ids_(std::size_t{num_layers} * top_k)
  {
    if (!ordered) { sets_ = combinatorial_table{num_experts, top_k}; }
    stage_.resize(std::size_t{chunk_tokens} * row_ids_);
  }

  /// @brief Stages one row: id (l, k) is `row[l * layer_stride + k]`; `t` is its index in the
  /// caller's call (for messages).
  ///
  /// With `sentinel`, a row whose ids all equal it is staged as missing.
  /// @return true where the row was staged as present, false where as missing
  /// @throws error invalid_expert_id for an id outside [0, E) (a row only partly the sentinel
  /// included); invalid_argument for an order-free entry with a repeated id
  template <class Id>
  [[nodiscard]] bool stage_row(const Id* row, std::ptrdiff_t layer_stride, std::optional<Id> sentinel, std::size_t t)
  {
    const std::uint32_t K = top_k_, E = num_experts_;
    std::uint16_t* out = slot();
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
        return false;
      }
      refuse_row(row, layer_stride, sentinel, t);
    }
    if (!ordered_) { check_sets(out, t); }
    mark(true);
    return true;
  }

  /// @brief Stages one row the engine never computed (marked missing in the bitmap).
  void stage_missing_row()
  {
    stage_missing(slot());
    mark(false);
  }

  /// @brief Whether the chunk being filled holds chunk_tokens rows (the owner packs it now).
  [[nodiscard]] bool chunk_full() const noexcept { return staged_ == chunk_tokens_; }

  /// @brief Rows in the chunk being filled.
  [[nodiscard]] std::uint32_t staged() const noexcept { return staged_; }

  /// @brief The chunk being filled: staged() rows of L * K ids, [token][layer][k].
  [[nodiscard]] const std::uint16_t* staged_ids() const noexcept { return stage_.data(); }

  /// @brief The owner has packed the staged rows: the next row starts a new chunk.
  void chunk_taken() noexcept { staged_ = 0; }

  /// @brief Rows staged in the record so far (present and missing).
  [[nodiscard]] std::uint32_t rows() const noexcept { return rows_; }

  /// @brief Missing rows in the record so far.
  [[nodiscard]] std::uint32_t missing() const noexcept { return missing_; }

  /// @brief The validity bitmap so far, a bit a row (1: present), LSB first: (rows() + 7) / 8 bytes.
  [[nodiscard]] const std::byte* bitmap() const noexcept { return valid_.data(); }

  /// @brief The ranks of K-id sets (order-free stagers only; empty otherwise).
  [[nodiscard]] const combinatorial_table& sets() const noexcept { return sets_; }

  /// @brief Reserves bitmap room for `tokens` more rows.
  void reserve(std::size_t tokens) { valid_.reserve(valid_.size() + tokens / 8 + 1); }

  /// @brief Drops every row (the record's and the chunk's), keeping the buffers.
  void clear() noexcept
  {
    rows_ = staged_ = missing_ = 0;
    valid_.clear();
  }

  /// @brief Bytes held in the stager's buffers.
  [[nodiscard]] std::size_t capacity_bytes() const noexcept { return stage_.capacity() * sizeof(std::uint16_t) + valid_.capacity(); }

 private:
  /// The next row's place in the chunk being filled.
  [[nodiscard]] std::uint16_t* slot() noexcept { return stage_.data() + std::size_t{staged_} * row_ids_; }

  /// The row is staged: its bit in the bitmap, and one more row in the record and in the chunk.
  void mark(bool present)
  {
    if (rows_ % 8 == 0) { valid_.push_back(std::byte{0}); }
    if (present) {
      valid_.back() |= static_cast<std::byte>(1u << (rows_ % 8));
    } else {
      ++missing_;
    }
    ++rows_;
    ++staged_;
  }

  /// Narrows a row of any layer stride into `out`; `bad` is set where an id lies outside [0, E).
  template <class Id>
  void stage_strided(const Id* row, std::ptrdiff_t layer_stride, std::uint16_t* out, bool& bad) const noexcept
  {
    const std::uint32_t L = num_layers_, K = top_k_, E = num_experts_;
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

  /// A missing row's ids are stored as the entry of code 0: ids 0 (ordered) or the set {0, .., K-1}
  /// (rank 0), so that packing needs no branch for it; the bitmap is what marks it.
  void stage_missing(std::uint16_t* out) const noexcept
  {
    for (std::size_t i = 0; i < row_ids_; ++i) {
      out[i] = ordered_ ? std::uint16_t{0} : static_cast<std::uint16_t>(i % top_k_);
    }
  }

  /// Whether every id of the row equals `v` (the missing-row sentinel).
  template <class Id>
  [[nodiscard]] bool whole_row_is(const Id* row, std::ptrdiff_t layer_stride, Id v) const noexcept
  {
    for (std::uint32_t l = 0; l < num_layers_; ++l) {
      for (std::uint32_t k = 0; k < top_k_; ++k) {
        if (row[static_cast<std::ptrdiff_t>(l) * layer_stride + k] != v) { return false; }
      }
    }
    return true;
  }

  /// Throws for a row with an id out of range, naming the first such id.
  template <class Id>
  [[noreturn]] void refuse_row(const Id* row, std::ptrdiff_t layer_stride, std::optional<Id> sentinel, std::size_t t) const
  {
    for (std::uint32_t l = 0; l < num_layers_; ++l) {
      for (std::uint32_t k = 0; k < top_k_; ++k) {
        const Id v = row[static_cast<std::ptrdiff_t>(l) * layer_stride + k];
        if (v < 0 || static_cast<std::uint64_t>(v) >= num_experts_) {
          std::string why = "route_record_encoder: row " + std::to_string(t) + " of the call, layer " + std::to_string(l) +
                            ", column " + std::to_string(k) + ": expert id " + std::to_string(static_cast<long long>(v)) +
                            " outside [0, " + std::to_string(num_experts_) + ")";
          if (sentinel && v == *sentinel) { why += " (the missing-row sentinel, but the row is only partly missing)"; }
          throw error{errc::invalid_expert_id, why};
        }
      }
    }
    throw error{errc::invalid_expert_id, "route_record_encoder: row " + std::to_string(t) + " has an id out of range"};
  }

  /// Throws where an entry of an order-free row repeats an id (it is not a set).
  void check_sets(const std::uint16_t* ids, std::size_t t) const
  {
    for (std::uint32_t l = 0; l < num_layers_; ++l) {
      if (!sets_.rank(ids + std::size_t{l} * top_k_)) {
        throw error{errc::invalid_argument, "route_record_encoder: row " + std::to_string(t) + " of the call, layer " +
                                              std::to_string(l) + ": an id repeats, and the order-free form stores sets"};
      }
    }
  }

  std::uint32_t num_layers_ = 0, top_k_ = 0, num_experts_ = 0;  ///< L, K, E
  std::uint32_t chunk_tokens_ = 0;     ///< rows a chunk holds
  bool ordered_ = true;                ///< false: entries are sets, checked by check_sets
  std::size_t row_ids_ = 0;            ///< L * K
  combinatorial_table sets_;           ///< order-free: the ranks check_sets and packing use
  std::vector<std::uint16_t> stage_;   ///< the chunk being filled, [chunk_tokens][L][K]
  std::vector<std::byte> valid_;       ///< the validity bitmap, a bit a row (1: present)
  std::uint32_t rows_ = 0;             ///< rows in the record so far
  std::uint32_t staged_ = 0;           ///< rows in the chunk being filled
  std::uint32_t missing_ = 0;          ///< missing rows in the record so far
};

ROUTING_REPLAY_WIRE_ABI_END
}  // namespace routing_replay::detail::wire
