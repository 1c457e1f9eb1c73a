/// @file
/// checked_predictions: what the contract says a call must do, from the checker's mirror alone: the
/// codes a plan, a read or a block transfer must be refused with, how per-request storage grows
/// (and so host_bytes), the rows an extraction must hold, the cells each write leaves in the open
/// step and the code a step must be reported with. Derives from checked_state (checked_state.hpp);
/// checked_oracle (checked_oracle.hpp) derives from it.
#pragma once

#include "checked_state.hpp"
#include "checked_writes.hpp"
#include "synthetic_router.hpp"

#include <routing_replay/routing_replay.hpp>

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <vector>

namespace rr_test {

/// @brief The second layer of checked_replay: predictions (see the file comment).
template <class RR>
class checked_predictions : public checked_state<RR> {
  using state = checked_state<RR>;

 public:
  using typename state::index;
  using typename state::traits;
  using state::slot_storage;
  using state::slots;
  using state::state;

 protected:
  using typename state::open_step;
  using state::cell_invalid;
  using state::cell_sentinel;
  using state::config_;
  using state::diverged_;
  using state::filed_through_;
  using state::layers_;
  using state::live_;
  using state::model_;
  using state::model_key;
  using state::oldest_pending;
  using state::open_;
  using state::parked_;
  using state::pending_segments_;
  using state::physical_entries;
  using state::row_elems_;
  using state::rows_compared_;
  using state::violation;

  struct growth {
    bool exact = false;
  };
  struct expected_read {
    std::int64_t rows = 0;
    std::vector<index> ids;
  };

  [[nodiscard]] std::size_t expected_host_bytes() const
  {
    if constexpr (slot_storage) {
      return static_cast<std::size_t>(slots() * row_elems_) * sizeof(index);
    } else {
      std::size_t bytes = 0;
      for (const auto& [name, r] : live_) { bytes += r.capacity_bytes; }
      for (const auto& p : pending_segments_) { bytes += p.first; }
      return bytes;
    }
  }

  // -- predictions ------------------------------------------------------------------------------

  [[nodiscard]] bool known_layer(std::int32_t model_layer) const
  {
    return std::find(config_.moe_layers.begin(), config_.moe_layers.end(), model_layer) != config_.moe_layers.end();
  }

  void check_cached(std::span<const std::int64_t> cached, std::set<routing_replay::errc>& expect) const
  {
    if (static_cast<std::int64_t>(cached.size()) > config_.max_model_len) {
      expect.insert(routing_replay::errc::position_out_of_range);
    }
    if (slot_storage) {
      for (const auto s : cached) {
        if (s < 0 || s >= slots()) { expect.insert(routing_replay::errc::slot_out_of_range); }
      }
    }
  }

  // Per-request storage (docs/design/host_storage.md, 3.5): a request with no rows yet takes over
  // the smallest parked range that holds them and no kernel writes any more; otherwise it grows by
  // a segment, after giving parked ranges back to the arena (oldest first) while the arena would
  // cross the limit.
  void grow_storage(std::size_t& capacity, std::int64_t rows, bool exact)
  {
    const std::size_t bytes = segment_bytes(capacity, rows, exact);
    if (bytes == 0) { return; }
    if (capacity == 0) {
      const auto row_bytes   = static_cast<std::size_t>(row_elems_) * sizeof(index);
      const std::size_t need = static_cast<std::size_t>(std::min(rows, config_.max_model_len)) * row_bytes;
      auto best              = parked_.end();
      for (auto p = parked_.begin(); p != parked_.end(); ++p) {
        if (p->second <= filed_through_ && p->first >= need && (best == parked_.end() || p->first < best->first)) {
          best = p;
        }
      }
      if (best != parked_.end()) {
        capacity = best->first;
        *best    = parked_.back();  // the store keeps no order among the rest but eviction's
        parked_.pop_back();
        return;
      }
    }
    const auto parked_bytes = [&] {
      std::size_t sum = 0;
      for (const auto& p : parked_) { sum += p.first; }
      return sum;
    };
    while (!parked_.empty() && expected_host_bytes() + parked_bytes() + bytes > config_.host_memory_limit) {
      if (parked_.front().second > filed_through_) { pending_segments_.push_back(parked_.front()); }
      parked_.erase(parked_.begin());
    }
    capacity += bytes;
  }

  // Per-request storage grows a request by one segment of its arena (docs/design/host_storage.md,
  // 3.5): a page multiple of at least 16 rows times a power of two, at least doubling the request's
  // capacity (or, `exact`, the smallest that holds `rows`), never above the segment that holds
  // max_model_len rows.
  [[nodiscard]] std::size_t segment_bytes(std::size_t capacity, std::int64_t rows, bool exact) const
  {
    const auto row_bytes   = static_cast<std::size_t>(row_elems_) * sizeof(index);
    const auto page        = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    const std::size_t base = (16 * row_bytes + page - 1) / page * page;
    const auto order_for   = [base](std::size_t bytes) {
      return std::bit_width(std::bit_ceil(std::max<std::size_t>(1, (bytes + base - 1) / base))) - 1;
    };
    const std::size_t need = static_cast<std::size_t>(std::min(rows, config_.max_model_len)) * row_bytes;
    if (need <= capacity) { return 0; }
    const std::size_t increment = exact ? need - capacity : std::max(need - capacity, capacity);
    const auto max_order = order_for(static_cast<std::size_t>(config_.max_model_len) * row_bytes);
    return base << std::min(order_for(increment), max_order);
  }

  std::set<routing_replay::errc> predict_plan(const routing_replay::step_plan& plan, growth& g) const
  {
    namespace rr = routing_replay;
    if (open_) { return {rr::errc::invalid_state}; }
    std::set<rr::errc> expect;
    if (plan.num_rows() > config_.max_tokens_per_step) { expect.insert(rr::errc::too_many_tokens); }
    if (plan.padded_rows() > config_.max_tokens_per_step) { expect.insert(rr::errc::too_many_tokens); }
    std::set<std::string> seen;
    std::set<std::int64_t> used_slots;
    std::size_t grow  = 0;
    std::size_t exact = 0;
    for (const auto& e : plan.entries()) {
      const auto& s = e.request;
      if (s.num_tokens < 0) {
        expect.insert(rr::errc::invalid_plan);
        continue;
      }
      if (e.skipped) { continue; }
      const auto it = live_.find(s.id.to_string());
      if (it == live_.end()) {
        expect.insert(rr::errc::unknown_request);
        continue;
      }
      if (!seen.insert(s.id.to_string()).second) {
        expect.insert(rr::errc::duplicate_request);
        continue;
      }
      bool ok = true;
      if (s.first_position < 0 || s.first_position > config_.max_model_len - s.num_tokens) {
        expect.insert(rr::errc::position_out_of_range);
        ok = false;
      }
      if (s.num_draft_tokens < 0 || s.num_draft_tokens > s.num_tokens ||
          s.num_draft_tokens > routing_replay::max_draft_tokens) {
        expect.insert(rr::errc::invalid_plan);
        ok = false;
      }
      if (slot_storage) {
        if (s.slots.size() != static_cast<std::size_t>(s.num_tokens)) {
          expect.insert(rr::errc::slot_out_of_range);
          ok = false;
        }
        for (const auto slot : s.slots) {
          if (slot < 0 || slot >= slots() || !used_slots.insert(slot).second) {
            expect.insert(rr::errc::slot_out_of_range);
            ok = false;
          }
        }
      }
      if (ok && !slot_storage) {
        const std::size_t have  = it->second.capacity_bytes;
        const std::int64_t rows = s.first_position + s.num_tokens;
        grow += segment_bytes(have, rows, false);
        exact += segment_bytes(have, rows, true);
      }
    }
    if (slot_storage) {
      for (const auto b : plan.fresh_blocks()) {
        if (b < 0 || b >= config_.num_blocks) { expect.insert(rr::errc::slot_out_of_range); }
      }
    }
    if (!slot_storage) {
      const std::size_t in_use = expected_host_bytes();
      g.exact = in_use + grow > config_.host_memory_limit;
      if (g.exact && in_use + exact > config_.host_memory_limit) {
        expect.insert(rr::errc::host_memory_exhausted);
      }
    }
    return expect;
  }

  std::set<routing_replay::errc> predict_read(routing_replay::request_key id,
                                              const routing_replay::extract_options& o) const
  {
    namespace rr = routing_replay;
    const auto it = live_.find(id.to_string());
    if (it == live_.end()) { return {rr::errc::unknown_request}; }
    std::set<rr::errc> expect;
    if (oldest_pending(it->second) != nullptr) { expect.insert(rr::errc::draft_error); }
    const std::int64_t recorded = model_.recorded_rows(model_key(it->second));
    const std::int64_t end      = o.end_position < 0 ? recorded : o.end_position;
    if (o.start_position < 0 || o.start_position > end || end > recorded) {
      if (!diverged_) { expect.insert(rr::errc::position_out_of_range); }
    }
    return expect;
  }

  // What extract_into needs, as the prediction sees it before the call (0 if the read is refused).
  [[nodiscard]] std::int64_t needed_elems(routing_replay::request_key id,
                                          const routing_replay::extract_options& o) const
  {
    const auto it = live_.find(id.to_string());
    if (it == live_.end()) { return 0; }
    const std::int64_t recorded = model_.recorded_rows(model_key(it->second));
    const std::int64_t end      = o.end_position < 0 ? recorded : o.end_position;
    if (o.start_position < 0 || o.start_position > end || end > recorded) { return 0; }
    return (end - o.start_position) * (o.include_dense_layers ? config_.num_model_layers : layers_) * config_.top_k;
  }

  [[nodiscard]] expected_read expected_rows(routing_replay::request_key id,
                                            const routing_replay::extract_options& o) const
  {
    const auto& r              = live_.at(id.to_string());
    const std::int64_t recorded = model_.recorded_rows(model_key(r));
    const std::int64_t end      = o.end_position < 0 ? recorded : o.end_position;
    expected_read out;
    out.rows       = end - o.start_position;
    const auto ids = model_.extract(model_key(r), o.start_position, end);
    if (!o.include_dense_layers) {
      out.ids = ids;
      return out;
    }
    const auto k = static_cast<std::size_t>(config_.top_k);
    for (std::int64_t t = 0; t < out.rows; ++t) {
      for (std::int32_t m = 0; m < config_.num_model_layers; ++m) {
        const auto at = std::find(config_.moe_layers.begin(), config_.moe_layers.end(), m);
        if (at == config_.moe_layers.end()) {
          out.ids.insert(out.ids.end(), k, traits::sentinel);
        } else {
          const auto from = ids.begin() + static_cast<std::ptrdiff_t>(
                                            (t * layers_ + (at - config_.moe_layers.begin())) * config_.top_k);
          out.ids.insert(out.ids.end(), from, from + static_cast<std::ptrdiff_t>(k));
        }
      }
    }
    return out;
  }

  void compare_rows(routing_replay::request_key id, std::int64_t first, std::int64_t layers,
                    const std::vector<index>& want, const std::vector<index>& got)
  {
    if (diverged_) { return; }
    if (want.size() != got.size()) {
      violation("request " + id.to_string() + ": " + std::to_string(got.size()) + " ids, the model has " +
                std::to_string(want.size()));
    }
    const std::int64_t row = layers * config_.top_k;
    for (std::size_t i = 0; i < want.size(); ++i) {
      if (want[i] != got[i]) {
        std::ostringstream s;
        s << "request " << id.to_string() << " position " << first + static_cast<std::int64_t>(i) / row
          << " element " << static_cast<std::int64_t>(i) % row << ": got " << +got[i] << ", the model has "
          << +want[i];
        violation(s.str());
      }
    }
    rows_compared_ += row == 0 ? 0 : static_cast<std::int64_t>(want.size()) / row;
  }

  std::set<routing_replay::errc> predict_transfer(std::span<const std::int64_t> blocks, bool too_small) const
  {
    namespace rr = routing_replay;
    if (open_) { return {rr::errc::invalid_state}; }
    std::set<rr::errc> expect;
    for (const auto b : blocks) {
      if (b < 0 || b >= config_.num_blocks) { expect.insert(rr::errc::slot_out_of_range); }
    }
    if (too_small) { expect.insert(rr::errc::invalid_argument); }
    return expect;
  }

  // -- writes -----------------------------------------------------------------------------------

  [[nodiscard]] std::int64_t cell_of(const write_spec& w) const noexcept
  {
    return w.bad == write_spec::defect::none || w.bad == write_spec::defect::out_of_bounds ? -1 : w.bad_cell;
  }

  [[nodiscard]] std::int64_t bad_value(const write_spec& w) const noexcept
  {
    switch (w.bad) {
      case write_spec::defect::above_range: return w.physical ? physical_entries() - 1 : config_.num_experts;
      case write_spec::defect::negative: return -2;
      case write_spec::defect::wide: return (std::int64_t{1} << 16) + config_.num_experts / 2;
      default: return 0;
    }
  }

  // The id a write puts at (row, column), as its kernels compute it.
  [[nodiscard]] std::int64_t predicted(const write_spec& w, std::int64_t row, std::int32_t column,
                                       std::int64_t modulo, std::int64_t bad) const noexcept
  {
    return routed_or_bad(row_meta{static_cast<std::int64_t>(w.salt), row, 0}, w.layer, row, column, config_.top_k,
                         modulo, cell_of(w), bad);
  }

  // The cells a write leaves in the open step, and what it reports.
  void predict_cells(const write_spec& w, std::int64_t rows, std::int64_t bad)
  {
    auto& s            = *open_;
    const auto k       = config_.top_k;
    const auto e       = config_.num_experts;
    auto cell          = [&](std::int32_t slot, std::int64_t row, std::int32_t c) -> std::int64_t& {
      return s.cells[static_cast<std::size_t>((row * layers_ + slot) * k + c)];
    };
    auto narrow = [&](std::int64_t v) -> std::int64_t {  // the source type's view of an id
      switch (w.source_bits) {
        case 16: return static_cast<std::int16_t>(v);
        case 32: return static_cast<std::int32_t>(v);
        default: return v;
      }
    };
    auto record = [&](std::int32_t slot, std::int64_t row, std::int32_t c, std::int64_t id) {
      if (id >= 0 && id < e) {
        cell(slot, row, c) = id;
      } else {
        cell(slot, row, c) = cell_sentinel;
        s.invalid_id       = true;
      }
    };
    switch (w.via) {
      case write_spec::path::capture: {
        const auto slot = static_cast<std::int32_t>(
          std::find(config_.moe_layers.begin(), config_.moe_layers.end(), w.layer) - config_.moe_layers.begin());
        const std::int64_t modulo = w.physical ? physical_entries() - 1 : e;
        for (std::int64_t r = 0; r < rows; ++r) {
          for (std::int32_t c = 0; c < k; ++c) {
            std::int64_t id = narrow(predicted(w, r, c, modulo, bad));
            if (w.physical) {
              id = id >= 0 && id < physical_entries()
                     ? (id + 1 < physical_entries() ? (id * 7 + 3) % e : -1)
                     : -1;
            }
            record(slot, r, c, id);
          }
        }
        break;
      }
      case write_spec::path::layer_view: {
        const auto slot = static_cast<std::int32_t>(
          std::find(config_.moe_layers.begin(), config_.moe_layers.end(), w.layer) - config_.moe_layers.begin());
        for (std::int64_t r = 0; r < rows; ++r) {
          for (std::int32_t c = 0; c < k; ++c) {
            const auto v = static_cast<index>(predicted(w, r, c, e, bad));
            cell(slot, r, c) = v == traits::sentinel ? cell_sentinel
                                                     : (traits::is_valid(static_cast<std::int64_t>(v), e)
                                                          ? static_cast<std::int64_t>(v)
                                                          : cell_invalid);
          }
        }
        break;
      }
      case write_spec::path::device_ref: {
        if (rows > 0 && (w.layer < 0 || w.layer >= layers_)) { s.out_of_bounds = true; }
        if (w.bad == write_spec::defect::out_of_bounds) { s.out_of_bounds = true; }
        if (w.layer < 0 || w.layer >= layers_) { break; }
        for (std::int64_t r = 0; r < rows; ++r) {
          for (std::int32_t c = 0; c < k; ++c) {
            record(w.layer, r, c, predicted(w, r, c, e, bad));
          }
        }
        break;
      }
    }
  }

  // The code a closed step must be reported with, by priority (docs/errors.md), or none.
  [[nodiscard]] std::optional<routing_replay::errc> classify(const open_step& s) const
  {
    namespace rr = routing_replay;
    const auto n = static_cast<std::size_t>(s.num_rows * row_elems_);
    const auto first = s.cells.begin();
    if (s.invalid_id || std::find(first, first + static_cast<std::ptrdiff_t>(n), cell_invalid) != first + static_cast<std::ptrdiff_t>(n)) {
      return rr::errc::invalid_expert_id;
    }
    if (s.out_of_bounds) { return rr::errc::invalid_argument; }
    if (std::find(first, first + static_cast<std::ptrdiff_t>(n), cell_sentinel) != first + static_cast<std::ptrdiff_t>(n)) {
      return rr::errc::missing_routing;
    }
    return std::nullopt;
  }
};

}  // namespace rr_test
