/// @file
/// Data path, part 6: the row reader. Hands a request's filed rows back: its length as readers see
/// it, the range an extraction selects, and the rows themselves, as a view of the host store where
/// they are contiguous and a gathered copy otherwise (optionally with dense layers, as sentinel).
#pragma once

#include <routing_replay/config.hpp>
#include <routing_replay/data_path/request_registry.hpp>
#include <routing_replay/data_path/step_record.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/index_type.hpp>
#include <routing_replay/layer_map.hpp>
#include <routing_replay/routed_experts.hpp>
#include <routing_replay/step_plan.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace routing_replay {

/// @brief Reads requests' rows out of a host store (`Store`, owned by the row filer).
/// `ClaimsWhenPlanned`: the filer claims a step's rows when it begins, so they count in a
/// request's T at once, but are not readable before the step is filed.
template <expert_index Index, class Store, bool ClaimsWhenPlanned>
class row_reader {
  using traits = index_traits<Index>;

 public:
  /// @brief A reader for a validated configuration.
  row_reader(const replay_config& config, const layer_map& layers)
    : layers_(layers),
      top_k_(config.top_k),
      row_elems_(static_cast<std::int64_t>(layers.num_layers()) * config.top_k)
  {
  }

  /// @brief T of request `h` as readers see it: one past its highest committed position, without
  /// the rows of `open_step` (the step in progress, or nullptr), which are not readable yet.
  [[nodiscard]] std::int64_t readable_rows(std::uint32_t h,
                                           const request_registry& requests,
                                           const step_record<Index>* open_step) const noexcept
  {
    const auto& r = requests[h];
    if constexpr (ClaimsWhenPlanned) {
      if (open_step != nullptr && r.open_step == open_step->serial) {
        for (const auto& run : open_step->runs) {
          if (run.handle == h) { return run.recorded_before; }
        }
      }
    }
    return r.recorded_rows;
  }

  /// @brief Positions [begin, end) that `options` select from request `h` (`id`).
  /// @throws error draft_error (unresolved drafts), position_out_of_range
  [[nodiscard]] std::pair<std::int64_t, std::int64_t> extraction_range(request_key id,
                                                                       std::uint32_t h,
                                                                       const extract_options& options,
                                                                       const request_registry& requests,
                                                                       const step_record<Index>* open_step) const
  {
    for (const auto& g : requests[h].drafts) {
      if (g.accepted < 0) {
        throw error{errc::draft_error, "request " + id.to_string() + " has " + std::to_string(g.count) +
                                         " unresolved draft token(s) from step " + std::to_string(g.step_serial) +
                                         "; call accept_draft first"};
      }
    }
    const std::int64_t recorded = readable_rows(h, requests, open_step);
    const std::int64_t end      = options.end_position < 0 ? recorded : options.end_position;
    if (options.start_position < 0 || options.start_position > end || end > recorded) {
      throw error{errc::position_out_of_range, "request " + id.to_string() + ": rows [" +
                                                 std::to_string(options.start_position) + ", " + std::to_string(end) +
                                                 ") requested, " + std::to_string(recorded) + " recorded"};
    }
    return {options.start_position, end};
  }

  /// @brief Ids per output row: L * K, or every model layer's K with include_dense_layers.
  [[nodiscard]] std::int64_t output_row_elems(const extract_options& options) const noexcept
  {
    return static_cast<std::int64_t>(options.include_dense_layers ? layers_.num_model_layers()
                                                                  : layers_.num_layers()) * top_k_;
  }

  /// @brief Positions [begin, end) of request `h`, checked by extraction_range(): a view of the
  /// store where its rows are contiguous (and no dense layers are asked for), else a gathered copy.
  /// Missing or stale rows hold the sentinel.
  [[nodiscard]] routed_experts<Index> extract(Store& store,
                                              std::uint32_t h,
                                              std::int64_t begin,
                                              std::int64_t end,
                                              std::int64_t prompt_length,
                                              const extract_options& options)
  {
    if (!options.include_dense_layers) {
      if (const Index* rows = store.contiguous(h, begin, end - begin)) {
        return {rows, end - begin, layers_.num_layers(), top_k_, begin, prompt_length};
      }
    }
    // every id is written below: no zero-fill first
    auto copy = std::make_unique_for_overwrite<Index[]>(static_cast<std::size_t>((end - begin) * output_row_elems(options)));
    copy_rows(store, h, begin, end, options, copy.get());
    const std::int64_t layers = options.include_dense_layers ? layers_.num_model_layers() : layers_.num_layers();
    return {std::move(copy), end - begin, layers, top_k_, begin, prompt_length};
  }

  /// @brief As copy_rows(), into a caller buffer checked first.
  /// @throws error invalid_argument if `out` is too small
  void copy_rows_into(Store& store,
                      request_key id,
                      std::uint32_t h,
                      std::int64_t begin,
                      std::int64_t end,
                      const extract_options& options,
                      std::span<Index> out)
  {
    const std::int64_t need = (end - begin) * output_row_elems(options);
    if (static_cast<std::int64_t>(out.size()) < need) {
      throw error{errc::invalid_argument, "extract_into: request " + id.to_string() + " needs " +
                                            std::to_string(need) + " elements, the buffer has " +
                                            std::to_string(out.size())};
    }
    copy_rows(store, h, begin, end, options, out.data());
  }

  /// @brief Copies positions [begin, end) of request `h` to `out` (output_row_elems() per row).
  void copy_rows(Store& store,
                 std::uint32_t h,
                 std::int64_t begin,
                 std::int64_t end,
                 const extract_options& options,
                 Index* out)
  {
    if (!options.include_dense_layers) {
      if (const Index* rows = store.contiguous(h, begin, end - begin)) {
        std::memcpy(out, rows, static_cast<std::size_t>((end - begin) * row_elems_) * sizeof(Index));
      } else {
        store.read_rows(h, begin, end - begin, out);
      }
      return;
    }
    std::vector<Index> row(static_cast<std::size_t>(row_elems_));
    const auto k = static_cast<std::size_t>(top_k_);
    for (std::int64_t p = begin; p < end; ++p) {
      const bool present = store.read(h, p, row.data());
      for (std::int32_t m = 0; m < layers_.num_model_layers(); ++m, out += k) {
        const std::int32_t slot = layers_.slot_or_none(m);
        if (slot < 0 || !present) {
          std::fill_n(out, k, traits::sentinel);
        } else {
          std::memcpy(out, row.data() + static_cast<std::size_t>(slot) * k, k * sizeof(Index));
        }
      }
    }
  }

 private:
  layer_map layers_;
  std::int32_t top_k_;
  std::int64_t row_elems_;
};

}  // namespace routing_replay
