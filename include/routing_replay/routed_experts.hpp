/// @file
/// What extraction returns: a request's routing as a contiguous [T, L, K] array.
#pragma once

#include <routing_replay/index_type.hpp>

#include <cuda/std/mdspan>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

namespace routing_replay {

/// @brief Options of extract() and extract_into().
struct extract_options {
  /// @brief First position returned: multi-turn rollouts take only the new suffix.
  std::int64_t start_position = 0;
  /// @brief One past the last position returned (clip to the accepted output length); -1: up to
  /// the request's recorded length. Past the recorded length is an error.
  std::int64_t end_position = -1;
  /// @brief Prompt length for the prompt/generation split; -1: the one given to add_request().
  std::int64_t prompt_length = -1;
  /// @brief Return every model layer ([T, num_model_layers, K]) with rows of uncaptured (dense)
  /// layers set to the sentinel, instead of captured MoE layers only. Always copies.
  bool include_dense_layers = false;
};

/// @brief Positions [first_position, end_position) of a request that a read covered.
struct row_range {
  std::int64_t first_position = 0;  ///< the first position
  std::int64_t end_position   = 0;  ///< one past the last
};

/// @brief A request's routing: T rows of [layers, K] expert ids, row t being position
/// first_position() + t. Missing rows (never recorded, or stale) hold the sentinel.
///
/// With per-request storage this is a view into the storage (no copy), valid until the request is
/// released or aborted or scheduled again; otherwise it owns a gathered copy. Move-only.
///
/// An element is `rows()(t, l, k)` (or `rows()[cuda::std::array<std::int64_t, 3>{t, l, k}]`), `l`
/// counting captured layers: libcu++'s mdspan offers operator() in place of C++23's
/// multidimensional operator[], and in C++20 `rows()[t, l, k]` is the comma operator's `rows()[k]`.
template <expert_index Index>
class routed_experts {
 public:
  /// @brief The [rows, layers, K] view type.
  using view_type = cuda::std::mdspan<const Index, cuda::std::dextents<std::int64_t, 3>>;

  /// @brief A view of rows that someone else owns.
  routed_experts(const Index* data,
                 std::int64_t rows,
                 std::int64_t layers,
                 std::int64_t top_k,
                 std::int64_t first_position,
                 std::int64_t prompt_length) noexcept
    : data_(data),
      rows_(rows),
      layers_(layers),
      top_k_(top_k),
      first_position_(first_position),
      prompt_length_(prompt_length)
  {
  }

  /// @brief Rows gathered into an owned buffer (of rows * layers * top_k ids).
  routed_experts(std::unique_ptr<Index[]> owned,
                 std::int64_t rows,
                 std::int64_t layers,
                 std::int64_t top_k,
                 std::int64_t first_position,
                 std::int64_t prompt_length) noexcept
    : owned_(std::move(owned)),
      data_(owned_.get()),
      rows_(rows),
      layers_(layers),
      top_k_(top_k),
      first_position_(first_position),
      prompt_length_(prompt_length)
  {
  }

  /// @brief Moves; an owned buffer keeps its address, so views stay valid.
  routed_experts(routed_experts&&) noexcept = default;
  /// @brief Move assignment, as the move constructor.
  routed_experts& operator=(routed_experts&&) noexcept = default;
  routed_experts(const routed_experts&)                = delete;
  routed_experts& operator=(const routed_experts&)     = delete;

  /// @brief All rows: [num_rows(), num_layers(), top_k()].
  [[nodiscard]] view_type rows() const noexcept { return slice(0, rows_); }
  /// @brief Rows of prompt positions (empty if the prompt length is unknown).
  [[nodiscard]] view_type prompt_rows() const noexcept { return slice(0, split_row()); }
  /// @brief Rows of generated positions (all rows if the prompt length is unknown).
  [[nodiscard]] view_type generation_rows() const noexcept { return slice(split_row(), rows_); }

  /// @brief The rows as one flat row-major array.
  [[nodiscard]] std::span<const Index> flat() const noexcept
  {
    return {data_, static_cast<std::size_t>(rows_ * layers_ * top_k_)};
  }

  /// @brief T: rows returned.
  [[nodiscard]] std::int64_t num_rows() const noexcept { return rows_; }
  /// @brief Layers per row (captured MoE layers, or all model layers).
  [[nodiscard]] std::int64_t num_layers() const noexcept { return layers_; }
  /// @brief K.
  [[nodiscard]] std::int64_t top_k() const noexcept { return top_k_; }
  /// @brief Position of row 0.
  [[nodiscard]] std::int64_t first_position() const noexcept { return first_position_; }
  /// @brief Prompt length used for the split, -1 if unknown.
  [[nodiscard]] std::int64_t prompt_length() const noexcept { return prompt_length_; }
  /// @brief Whether this is a zero-copy view of host storage.
  [[nodiscard]] bool is_view() const noexcept { return owned_ == nullptr && rows_ > 0; }

  /// @brief Rows that hold no routing at all (every id the sentinel): never recorded, or stale.
  /// Dense-layer groups of an include_dense_layers extraction do not make a row missing. O(T L K).
  [[nodiscard]] std::int64_t count_missing_rows() const noexcept
  {
    const std::int64_t row = layers_ * top_k_;
    std::int64_t missing   = 0;
    for (std::int64_t t = 0; t < rows_; ++t) {
      const Index* first = data_ + t * row;
      missing += std::all_of(first, first + row, [](Index v) { return v == index_traits<Index>::sentinel; })
                   ? 1
                   : 0;
    }
    return missing;
  }

 private:
  [[nodiscard]] std::int64_t split_row() const noexcept
  {
    if (prompt_length_ < 0) { return 0; }
    return std::clamp<std::int64_t>(prompt_length_ - first_position_, 0, rows_);
  }

  [[nodiscard]] view_type slice(std::int64_t begin, std::int64_t end) const noexcept
  {
    return view_type{data_ + begin * layers_ * top_k_, end - begin, layers_, top_k_};
  }

  std::unique_ptr<Index[]> owned_;  // a gathered copy; null for a view
  const Index* data_;
  std::int64_t rows_;
  std::int64_t layers_;
  std::int64_t top_k_;
  std::int64_t first_position_;
  std::int64_t prompt_length_;
};

}  // namespace routing_replay
