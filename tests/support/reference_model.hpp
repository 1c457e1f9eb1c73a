/// @file
/// The plain reference model of the storage contract: maps, no layouts, no devices, no asynchrony.
/// Every policy combination must extract exactly what this model extracts.
#pragma once

#include <routing_replay/index_type.hpp>
#include <routing_replay/step_plan.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace rr_test {

/// @brief The contract, stated as directly as possible:
/// - per-request storage: a request's row at a position is the first routing filed for it (the
///   latest with overwrite); positions never filed are missing;
/// - block-slot storage: rows live at slots; a request maps each position to the slot (and the
///   block generation) it was filed or prefix-hit at; a block declared fresh forgets its rows and
///   makes every older mapping stale (missing); a row already at a slot in this generation stays;
///   otherwise a recomputed position keeps its first valid row, which follows it to its new slot;
/// - drafts: tentative rows yield to any later write of their position; accept_draft keeps the
///   accepted prefix and forgets the rest; a discarded step files nothing.
template <class Index>
class reference_model {
 public:
  using row = std::vector<Index>;

  reference_model(bool slot_storage, bool overwrite, std::int64_t block_size, std::int64_t num_blocks,
                  std::int64_t row_size)
    : slot_storage_(slot_storage),
      overwrite_(overwrite),
      block_size_(block_size),
      row_size_(row_size),
      generation_(static_cast<std::size_t>(std::max<std::int64_t>(num_blocks, 0)), 0),
      // sized with either storage: a plan's fresh blocks clear their slots whatever the storage
      slot_rows_(static_cast<std::size_t>(std::max<std::int64_t>(num_blocks, 0) * block_size))
  {
  }

  void add_request(routing_replay::request_key id, std::int64_t prompt_length,
                   std::span<const std::int64_t> cached)
  {
    auto& r         = requests_[id.to_string()];
    r               = request{};
    r.prompt_length = prompt_length;
    add_cached_prefix(id, cached);
  }

  void add_cached_prefix(routing_replay::request_key id, std::span<const std::int64_t> cached)
  {
    auto& r = requests_.at(id.to_string());
    if (slot_storage_) {
      for (std::size_t p = 0; p < cached.size(); ++p) {
        const auto pos = static_cast<std::int64_t>(p);
        if (!r.at.count(pos) || !valid(r.at[pos])) { r.at[pos] = at_slot(cached[p]); }
      }
    }
    r.recorded = std::max(r.recorded, static_cast<std::int64_t>(cached.size()));
  }

  /// @brief A step begins: the blocks it declares fresh belong to the engine from now on, whether
  /// or not the step's rows are ever filed (the library applies them in begin_step).
  void begin_step(const routing_replay::step_plan& plan) { refresh(plan.fresh_blocks()); }

  /// @brief Files a step, after its begin_step, whose rows are `expected(plan_row)`. A step the
  /// library discards is simply never filed.
  void file_step(const routing_replay::step_plan& plan, std::uint64_t serial,
                 const std::function<row(std::int64_t)>& expected)
  {
    for (const auto& e : plan.entries()) {
      if (e.skipped) { continue; }
      auto& r               = requests_.at(e.request.id.to_string());
      const auto& s         = e.request;
      const std::int32_t committed = s.num_tokens - s.num_draft_tokens;
      std::optional<group> g;
      if (s.num_draft_tokens > 0) {
        g = group{serial, s.first_position + committed, s.num_draft_tokens, {}, {}};
      }
      for (std::int32_t i = 0; i < s.num_tokens; ++i) {
        const std::int64_t pos  = s.first_position + i;
        const std::int64_t slot = slot_storage_ ? s.slots[static_cast<std::size_t>(i)] : -1;
        const bool tentative    = i >= committed;
        bool replace            = overwrite_;
        for (auto& other : r.drafts) {
          if (other.owned.erase(pos) != 0) { replace = true; }  // a later write takes over
        }
        if (write(r, pos, slot, expected(e.first_row + i), replace) && tentative) {
          g->owned.insert(pos);
          g->slots[pos] = slot;
        }
        if (!tentative) { r.recorded = std::max(r.recorded, pos + 1); }
      }
      if (g) { r.drafts.push_back(*g); }
    }
  }

  void accept_draft(routing_replay::request_key id, std::int32_t accepted)
  {
    auto& r = requests_.at(id.to_string());
    group g = r.drafts.front();
    r.drafts.erase(r.drafts.begin());
    for (const std::int64_t pos : g.owned) {
      if (pos - g.first >= accepted) { erase(r, pos, g.slots.at(pos)); }
    }
    if (accepted > 0) { r.recorded = std::max(r.recorded, g.first + accepted); }
  }

  void remove(routing_replay::request_key id) { requests_.erase(id.to_string()); }

  [[nodiscard]] std::int64_t recorded_rows(routing_replay::request_key id) const
  {
    return requests_.at(id.to_string()).recorded;
  }

  [[nodiscard]] std::int64_t prompt_length(routing_replay::request_key id) const
  {
    return requests_.at(id.to_string()).prompt_length;
  }

  /// @brief Block-slot storage: the rows of whole blocks, block after block, as export_blocks()
  /// returns them (the sentinel where a slot holds no row of its block's current generation).
  [[nodiscard]] std::vector<Index> export_blocks(std::span<const std::int64_t> blocks) const
  {
    std::vector<Index> out;
    for (const std::int64_t b : blocks) {
      for (std::int64_t slot = b * block_size_; slot < (b + 1) * block_size_; ++slot) {
        if (const auto& held = slot_row(slot)) {
          out.insert(out.end(), held->begin(), held->end());
        } else {
          out.insert(out.end(), static_cast<std::size_t>(row_size_), routing_replay::index_traits<Index>::sentinel);
        }
      }
    }
    return out;
  }

  /// @brief Block-slot storage: the blocks become fresh, then take the given rows in order (a row
  /// whose first id is the sentinel holds nothing; a block listed twice keeps its last rows).
  void import_blocks(std::span<const std::int64_t> blocks, std::span<const Index> rows)
  {
    refresh(blocks);
    auto at = rows.begin();
    for (const std::int64_t b : blocks) {
      for (std::int64_t slot = b * block_size_; slot < (b + 1) * block_size_; ++slot, at += row_size_) {
        if (*at != routing_replay::index_traits<Index>::sentinel) {
          slot_row(slot) = row(at, at + row_size_);
        } else {
          slot_row(slot).reset();
        }
      }
    }
  }

  /// @brief Rows [begin, end) flattened, sentinel where missing.
  [[nodiscard]] std::vector<Index> extract(routing_replay::request_key id, std::int64_t begin,
                                           std::int64_t end) const
  {
    const auto& r = requests_.at(id.to_string());
    std::vector<Index> out;
    out.reserve(static_cast<std::size_t>(std::max<std::int64_t>(end - begin, 0) * row_size_));
    for (std::int64_t pos = begin; pos < end; ++pos) {
      const row* found = nullptr;
      if (slot_storage_) {
        const auto it = r.at.find(pos);
        if (it != r.at.end() && valid(it->second)) { found = &*slot_row(it->second.slot); }
      } else if (const auto it = r.rows.find(pos); it != r.rows.end()) {
        found = &it->second;
      }
      if (found != nullptr) {
        out.insert(out.end(), found->begin(), found->end());
      } else {
        out.insert(out.end(), static_cast<std::size_t>(row_size_),
                   routing_replay::index_traits<Index>::sentinel);
      }
    }
    return out;
  }

 private:
  struct slot_at {
    std::int64_t slot;
    std::uint32_t generation;
  };
  struct group {
    std::uint64_t serial;
    std::int64_t first;
    std::int32_t count;
    std::set<std::int64_t> owned;
    std::map<std::int64_t, std::int64_t> slots;
  };
  struct request {
    std::map<std::int64_t, row> rows;    // per-request storage
    std::map<std::int64_t, slot_at> at;  // block-slot storage
    std::vector<group> drafts;
    std::int64_t recorded      = 0;
    std::int64_t prompt_length = -1;
  };

  [[nodiscard]] std::size_t block_of(std::int64_t slot) const
  {
    return static_cast<std::size_t>(slot / block_size_);
  }
  [[nodiscard]] slot_at at_slot(std::int64_t slot) const { return {slot, generation_[block_of(slot)]}; }
  [[nodiscard]] bool valid(const slot_at& a) const
  {
    return generation_[block_of(a.slot)] == a.generation && slot_row(a.slot).has_value();
  }

  [[nodiscard]] std::optional<row>& slot_row(std::int64_t slot) { return slot_rows_[static_cast<std::size_t>(slot)]; }
  [[nodiscard]] const std::optional<row>& slot_row(std::int64_t slot) const
  {
    return slot_rows_[static_cast<std::size_t>(slot)];
  }

  void refresh(std::span<const std::int64_t> blocks)
  {
    for (const std::int64_t b : blocks) {
      ++generation_[static_cast<std::size_t>(b)];
      for (std::int64_t s = b * block_size_; s < (b + 1) * block_size_; ++s) { slot_row(s).reset(); }
    }
  }

  // true when this write's own row landed (so a tentative write owns it). `value` is moved into
  // place, and a prior row followed by pointer: at L 48, K 8 a row is 768 bytes, and copying it
  // twice per filed row was most of the model's time in the CUDA soak.
  bool write(request& r, std::int64_t pos, std::int64_t slot, row value, bool replace)
  {
    if (!slot_storage_) {
      if (!replace && r.rows.count(pos) != 0) { return false; }
      r.rows[pos] = std::move(value);
      return true;
    }
    const row* prior = nullptr;  // map nodes stay put while other keys are inserted
    if (const auto it = r.at.find(pos); it != r.at.end() && valid(it->second)) {
      prior = &*slot_row(it->second.slot);
    }
    r.at[pos] = at_slot(slot);
    if (replace) {
      slot_row(slot) = std::move(value);
      return true;
    }
    auto& here = slot_row(slot);
    if (here) { return false; }
    if (prior != nullptr) {
      row kept = *prior;  // prior is another slot's row (this slot held none)
      here = std::move(kept);
      return false;
    }
    here = std::move(value);
    return true;
  }

  void erase(request& r, std::int64_t pos, std::int64_t slot)
  {
    if (!slot_storage_) {
      r.rows.erase(pos);
      return;
    }
    const auto it = r.at.find(pos);
    if (it != r.at.end() && it->second.slot == slot && valid(it->second)) { slot_row(slot).reset(); }
    r.at.erase(pos);
  }

  bool slot_storage_;
  bool overwrite_;
  std::int64_t block_size_;
  std::int64_t row_size_;
  std::vector<std::uint32_t> generation_;
  // block-slot storage: the row at each slot of the pool, if any (indexed by slot: a map of 98,304
  // slots at the soak's scale cost a tree walk per filed and extracted row)
  std::vector<std::optional<row>> slot_rows_;
  std::map<std::string, request> requests_;
};

}  // namespace rr_test
