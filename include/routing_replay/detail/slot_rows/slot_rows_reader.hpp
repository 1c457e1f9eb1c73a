/// @file
/// The host side of slot_rows' reads: which layers a capture path was handed, and rows read back
/// from the pool at a request's KV slots, widened, checked and, on request, written as base64 without
/// the array in between, or handed over where they lie (for a route record).
#pragma once

#include <routing_replay/detail/slot_rows/slot_rows_kernels.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/index_type.hpp>
#include <routing_replay/layer_map.hpp>
#include <routing_replay/npy.hpp>

#include <algorithm>
#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace routing_replay {

/// @brief How slot_rows::read() names what it reads, and what it writes for layers with no rows.
struct slot_read_options {
  /// @brief The position of the first slot read (messages name positions from it).
  std::int64_t first_position = 0;
  /// @brief How messages name the reader's request ("request pool index 3"); empty: "row i".
  std::string request;
  /// @brief Written for every id of a layer no capture path was ever handed, and of model layers
  /// outside the layer map.
  std::int64_t uncaptured_value = 0;
};

namespace detail {

/// @brief The layers captured so far and the reads of the pool of a slot_rows.
template <class Index>
class slot_rows_reader {
  using traits = index_traits<Index>;

 public:
  /// @brief For a pool of `num_slots` rows of `layers`' layers (K ids each), read as rows of
  /// `num_model_layers` layers.
  slot_rows_reader(std::int32_t num_model_layers, std::int32_t top_k, std::int64_t num_slots, const layer_map& layers)
    : layers_(layers),
      num_model_layers_(num_model_layers),
      top_k_(top_k),
      num_slots_(num_slots),
      row_elems_(static_cast<std::int64_t>(layers.num_layers()) * top_k),
      captured_(static_cast<std::size_t>(layers.num_layers()), false),
      read_slot_(static_cast<std::size_t>(num_model_layers), -1)
  {
  }

  /// @brief The pool rows are read from.
  void attach(const Index* pool) noexcept { pool_ = pool; }

  /// @brief Layer slot `slot` was handed to a capture path: from now on its cells must be written.
  void mark_captured(std::int32_t slot) noexcept
  {
    if (captured_[static_cast<std::size_t>(slot)]) { return; }
    captured_[static_cast<std::size_t>(slot)] = true;
    required_[static_cast<std::size_t>(slot >> 6)] |= std::uint64_t{1} << (slot & 63);
    for (std::int32_t m = 0; m < num_model_layers_; ++m) {
      if (layers_.slot_or_none(m) == slot) { read_slot_[static_cast<std::size_t>(m)] = slot; }
    }
  }
  /// @brief The layer slots captured so far, as the end-of-step kernel takes them.
  [[nodiscard]] const layer_mask& required_layers() const noexcept { return required_; }
  /// @brief Whether model layer `model_layer` is in the map and was captured.
  [[nodiscard]] bool model_layer_captured(std::int32_t model_layer) const noexcept
  {
    const std::int32_t s = layers_.slot_or_none(model_layer);
    return s >= 0 && captured_[static_cast<std::size_t>(s)];
  }

  /// @brief Writes [slots.size(), num_model_layers, K] of `Out` read at `slots`.
  template <class Out, std::integral Slot>
  void read(std::span<const Slot> slots, Out* out, const slot_read_options& options) const
  {
    const std::size_t out_row = out_row_elems();
    for (std::size_t i = 0; i < slots.size(); ++i) { read_row(slots, i, out + i * out_row, options); }
  }

  /// @brief Characters of the base64 of `rows` rows of `Out`.
  template <class Out>
  [[nodiscard]] std::size_t base64_chars(std::int64_t rows) const noexcept
  {
    return base64_size(static_cast<std::size_t>(std::max<std::int64_t>(rows, 0)) * out_row_elems() * sizeof(Out));
  }

  /// @brief Writes base64 of the bytes read() would write, three rows at a time (3 rows are a
  /// multiple of 3 bytes, so each group encodes on its own), into `chars`.
  template <class Out, std::integral Slot>
  void read_base64(std::span<const Slot> slots, char* chars, const slot_read_options& options) const
  {
    static_assert(std::endian::native == std::endian::little, "the wire format is little-endian");
    constexpr std::size_t rows_per_group = 3;
    const std::size_t out_row            = out_row_elems();
    std::vector<Out> group(rows_per_group * out_row);
    for (std::size_t first = 0; first < slots.size(); first += rows_per_group) {
      const std::size_t rows = std::min(rows_per_group, slots.size() - first);
      for (std::size_t r = 0; r < rows; ++r) { read_row(slots, first + r, group.data() + r * out_row, options); }
      const std::size_t bytes = rows * out_row * sizeof(Out);
      base64_encode_to(reinterpret_cast<const unsigned char*>(group.data()), bytes, chars);
      chars += base64_size(bytes);
    }
  }

  /// @brief The pool layers (slots) a read of rows where they lie covers: those captured so far,
  /// or every pool layer while none is; in pool order.
  [[nodiscard]] std::vector<std::int32_t> run_layers() const
  {
    std::vector<std::int32_t> slots;
    for (std::int32_t s = 0; s < layers_.num_layers(); ++s) {
      if (captured_[static_cast<std::size_t>(s)]) { slots.push_back(s); }
    }
    if (slots.empty()) {
      for (std::int32_t s = 0; s < layers_.num_layers(); ++s) { slots.push_back(s); }
    }
    return slots;
  }

  /// @brief Hands the rows at `slots` over in order, with the layers of run_layers() only:
  /// `rows(first, n, token_stride, layer_stride)` for n rows that hold routing (read in place, at
  /// consecutive slots, where those layers are evenly spaced in the pool; else one at a time,
  /// gathered here), `missing(n)` for n rows that hold none (slots no step wrote).
  /// @throws error slot_out_of_range; missing_routing for a row with routing for some of those
  /// layers and not others (read() refuses it too); what the callables throw
  template <std::integral Slot, class Rows, class Missing>
  void for_each_run(std::span<const Slot> slots, const slot_read_options& options, Rows&& rows, Missing&& missing) const
  {
    const std::vector<std::int32_t> layers = run_layers();
    const std::int64_t k                   = top_k_;
    const std::int64_t spacing             = layers.size() > 1 ? layers[1] - layers[0] : 1;
    bool even                              = true;
    for (std::size_t l = 1; l < layers.size(); ++l) { even = even && layers[l] - layers[l - 1] == spacing; }
    std::vector<Index> gathered(even ? 0 : layers.size() * static_cast<std::size_t>(k));
    const auto slot_at = [&](std::size_t i) { return checked_slot(slots, i, options); };
    std::int64_t gap   = 0;  // rows without routing not handed over yet: one call for a run of them
    for (std::size_t i = 0; i < slots.size();) {
      const std::int64_t slot = slot_at(i);
      const Index* row        = pool_ + slot * row_elems_;
      if (!holds_routing(row, layers, slot, i, options)) {
        ++gap;
        ++i;
        continue;
      }
      if (gap != 0) { missing(std::exchange(gap, 0)); }
      if (!even) {
        for (std::size_t l = 0; l < layers.size(); ++l) {
          std::copy_n(row + layers[l] * k, k, gathered.data() + static_cast<std::int64_t>(l) * k);
        }
        rows(static_cast<const Index*>(gathered.data()), std::int64_t{1}, static_cast<std::int64_t>(gathered.size()), k);
        ++i;
        continue;
      }
      std::size_t run = 1;
      while (i + run < slots.size() && slot_at(i + run) == slot + static_cast<std::int64_t>(run) &&
             holds_routing(row + static_cast<std::int64_t>(run) * row_elems_, layers, slot + static_cast<std::int64_t>(run),
                           i + run, options)) {
        ++run;
      }
      rows(row + layers.front() * k, static_cast<std::int64_t>(run), row_elems_, spacing * k);
      i += run;
    }
    if (gap != 0) { missing(gap); }
  }

 private:
  [[nodiscard]] std::size_t out_row_elems() const noexcept
  {
    return static_cast<std::size_t>(num_model_layers_) * static_cast<std::size_t>(top_k_);
  }

  [[nodiscard]] static std::string who(const slot_read_options& o, std::size_t i)
  {
    if (o.request.empty()) { return "row " + std::to_string(i); }
    return o.request + ", position " + std::to_string(o.first_position + static_cast<std::int64_t>(i));
  }

  template <std::integral Slot>
  [[nodiscard]] std::int64_t checked_slot(std::span<const Slot> slots, std::size_t i, const slot_read_options& options) const
  {
    const auto slot = static_cast<std::int64_t>(slots[i]);
    if (slot < 0 || slot >= num_slots_) {
      throw error{errc::slot_out_of_range, who(options, i) + " has KV slot " + std::to_string(slot) +
                                             ", outside the pool [0, " + std::to_string(num_slots_) + ")"};
    }
    return slot;
  }

  // Whether the pool row at `slot` holds routing for every layer of `layers` (true) or for none
  // (false); a row with some of them only is refused as read() refuses it.
  [[nodiscard]] bool holds_routing(const Index* row, const std::vector<std::int32_t>& layers, std::int64_t slot,
                                   std::size_t i, const slot_read_options& options) const
  {
    const auto k            = static_cast<std::size_t>(top_k_);
    std::int32_t first_gap  = -1;
    std::size_t written     = 0;
    for (const std::int32_t s : layers) {
      const Index* cell = row + static_cast<std::size_t>(s) * k;
      bool missing      = false;
      for (std::size_t c = 0; c < k; ++c) { missing |= cell[c] == traits::sentinel; }
      if (missing && first_gap < 0) { first_gap = s; }
      written += missing ? 0 : 1;
    }
    if (first_gap < 0) { return true; }
    if (written == 0) { return false; }
    throw error{errc::missing_routing, who(options, i) + " (KV slot " + std::to_string(slot) + ") holds no routing for " +
                                         layers_.describe(first_gap) + ", and routing for " + std::to_string(written) +
                                         " other layer(s): a step wrote part of the row"};
  }

  template <class Out, std::integral Slot>
  void read_row(std::span<const Slot> slots, std::size_t i, Out* out, const slot_read_options& options) const
  {
    const std::int64_t slot = checked_slot(slots, i, options);
    const Index* row        = pool_ + slot * row_elems_;
    const auto k     = static_cast<std::size_t>(top_k_);
    for (std::int32_t m = 0; m < num_model_layers_; ++m, out += k) {
      const std::int32_t s = read_slot_[static_cast<std::size_t>(m)];
      if (s < 0) {
        std::fill(out, out + k, static_cast<Out>(options.uncaptured_value));
        continue;
      }
      const Index* cell = row + static_cast<std::size_t>(s) * k;
      bool missing      = false;  // checked once a cell: the copy loop stays free of branches
      for (std::size_t c = 0; c < k; ++c) {
        missing |= cell[c] == traits::sentinel;
        out[c] = static_cast<Out>(cell[c]);
      }
      if (missing) [[unlikely]] {
        throw error{errc::missing_routing, who(options, i) + " (KV slot " + std::to_string(slot) +
                                             ") holds no routing for " + layers_.describe(s) +
                                             ": no step wrote it, or the step that did was refused"};
      }
    }
  }

  const layer_map& layers_;
  std::int32_t num_model_layers_;
  std::int32_t top_k_;
  std::int64_t num_slots_;
  std::int64_t row_elems_;  // L * K of the pool
  const Index* pool_ = nullptr;
  std::vector<bool> captured_;
  std::vector<std::int32_t> read_slot_;  // per model layer: its pool layer once captured, else -1
  layer_mask required_{};
};

}  // namespace detail
}  // namespace routing_replay
