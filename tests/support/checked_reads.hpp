/// @file
/// checked_reads: the calls of the contract checker that read the object (extract, extract_into,
/// recorded_rows, layer_slot), reset its buffer, move rows of whole blocks (export, import, copy),
/// or replace the object itself (moved, rebuilt), each checked against the reference model.
/// Derives from checked_oracle (checked_oracle.hpp); checked_replay (checked_replay.hpp) derives
/// from it.
#pragma once

#include "checked_oracle.hpp"

#include <routing_replay/routing_replay.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace rr_test {

/// @brief The fourth layer of checked_replay: reads, block transfers, the object (see the file
/// comment).
template <class RR>
class checked_reads : public checked_oracle<RR> {
  using oracle = checked_oracle<RR>;

 public:
  using typename oracle::engine;
  using typename oracle::index;
  using typename oracle::model_type;
  using typename oracle::outcome;
  using typename oracle::traits;
  using oracle::drain;
  using oracle::last;
  using oracle::model_rows;
  using oracle::slot_storage;
  using oracle::oracle;

  // ---- reading -----------------------------------------------------------------------------------

  void extract(routing_replay::request_key id, const routing_replay::extract_options& o)
  {
    trace("extract", id.to_string(), o.start_position, o.end_position, o.prompt_length, o.include_dense_layers);
    prepare_filing_call();
    remember(id);
    std::optional<typename RR::result_type> got;
    const std::size_t before = lib_->steps_in_flight();
    const auto snap          = snapshot(may_skip_snapshot(predict_read(id, o)));
    const outcome out        = invoke("extract", [&] { got.emplace(lib_->extract(id, o)); });
    if (account(before, 0, out)) { return; }
    const auto expect = predict_read(id, o);
    if (!settle(out, expect, snap, true, "extract")) { return; }
    const auto expected = expected_rows(id, o);
    const auto& r       = live_.at(id.to_string());
    const std::int64_t prompt = o.prompt_length >= 0 ? o.prompt_length : r.prompt_length;
    const std::int64_t layers = o.include_dense_layers ? config_.num_model_layers : layers_;
    if (got->num_rows() != expected.rows || got->first_position() != o.start_position ||
        got->num_layers() != layers || got->top_k() != config_.top_k || got->prompt_length() != prompt) {
      violation("extract(" + id.to_string() + "): shape or metadata differs from the model");
    }
    const std::int64_t split = prompt < 0 ? 0 : std::clamp<std::int64_t>(prompt - o.start_position, 0, expected.rows);
    if (got->prompt_rows().extent(0) != split || got->generation_rows().extent(0) != expected.rows - split) {
      violation("extract(" + id.to_string() + "): prompt/generation split differs");
    }
    compare_rows(id, o.start_position, layers, expected.ids, {got->flat().begin(), got->flat().end()});
    std::int64_t missing = 0;
    for (std::int64_t t = 0; t < expected.rows; ++t) {
      const auto first = expected.ids.begin() + t * layers * config_.top_k;
      missing += std::all_of(first, first + layers * config_.top_k, [](index v) { return v == traits::sentinel; }) ? 1 : 0;
    }
    if (!diverged_ && got->count_missing_rows() != missing) { violation("count_missing_rows differs"); }
  }

  /// @brief extract_into with a buffer `size_delta` elements larger (or smaller) than needed.
  void extract_into(routing_replay::request_key id, const routing_replay::extract_options& o,
                    std::int64_t size_delta)
  {
    trace("extract_into", id.to_string(), o.start_position, o.end_position, o.prompt_length, o.include_dense_layers,
          size_delta);
    prepare_filing_call();
    remember(id);
    const index canary = static_cast<index>(config_.num_experts + 1);
    const std::int64_t need = needed_elems(id, o);
    std::vector<index> buffer(static_cast<std::size_t>(std::max<std::int64_t>(need + size_delta, 0)), canary);
    std::int64_t written     = -1;
    const std::size_t before = lib_->steps_in_flight();
    const auto snap          = snapshot();
    const outcome out        = invoke("extract_into", [&] { written = lib_->extract_into(id, buffer, o); });
    if (account(before, 0, out)) { return; }
    auto expect = predict_read(id, o);
    if (expect.empty() && static_cast<std::int64_t>(buffer.size()) < need) {
      expect.insert(routing_replay::errc::invalid_argument);
    }
    const bool untouched = std::all_of(buffer.begin(), buffer.end(), [&](index v) { return v == canary; });
    if (!settle(out, expect, snap, true, "extract_into")) {
      if (!untouched) { violation("a refused extract_into wrote into the caller's buffer"); }
      return;
    }
    const auto expected = expected_rows(id, o);
    if (written != expected.rows) { violation("extract_into returned a different row count"); }
    const auto n = static_cast<std::size_t>(need);
    if (!std::all_of(buffer.begin() + static_cast<std::ptrdiff_t>(n), buffer.end(), [&](index v) { return v == canary; })) {
      violation("extract_into wrote past the rows it returned");
    }
    compare_rows(id, o.start_position, o.include_dense_layers ? config_.num_model_layers : layers_, expected.ids,
                 std::vector<index>(buffer.begin(), buffer.begin() + static_cast<std::ptrdiff_t>(n)));
  }

  void recorded_rows(routing_replay::request_key id)
  {
    trace("recorded_rows", id.to_string());
    prepare_filing_call();
    remember(id);
    std::set<routing_replay::errc> expect;
    if (live_.count(id.to_string()) == 0) { expect.insert(routing_replay::errc::unknown_request); }
    std::int64_t got         = -1;
    const std::size_t before = lib_->steps_in_flight();
    const auto snap          = snapshot(may_skip_snapshot(expect));
    const outcome out        = invoke("recorded_rows", [&] { got = lib_->recorded_rows(id); });
    if (account(before, 0, out)) { return; }
    if (!settle(out, expect, snap, true, "recorded_rows")) { return; }
    const std::int64_t want = model_rows(id);
    if (!diverged_ && got != want) {
      violation("recorded_rows(" + id.to_string() + ") = " + std::to_string(got) + ", the model has " +
                std::to_string(want));
    }
  }

  void layer_slot(std::int32_t model_layer)
  {
    trace("layer_slot", model_layer);
    std::int32_t got = -1;
    std::set<routing_replay::errc> expect;
    if (!known_layer(model_layer)) { expect.insert(routing_replay::errc::unknown_layer); }
    if (!run_checked("layer_slot", expect, false, [&] { got = lib_->layer_slot(model_layer); })) { return; }
    const auto at = std::find(config_.moe_layers.begin(), config_.moe_layers.end(), model_layer);
    if (got != static_cast<std::int32_t>(at - config_.moe_layers.begin())) { violation("layer_slot differs"); }
  }

  void reset_device_buffer()
  {
    trace("reset_device_buffer");
    std::set<routing_replay::errc> expect;
    if (open_) { expect.insert(routing_replay::errc::invalid_state); }
    run_checked("reset_device_buffer", expect, false, [&] { lib_->reset_device_buffer(stream_.ref()); });
  }

  // ---- block transfers (block-slot storage) ------------------------------------------------------

  void export_blocks(std::span<const std::int64_t> blocks, std::int64_t size_delta)
  {
    trace("export_blocks", blocks.size(), size_delta);
    if constexpr (slot_storage) {
      const auto need = static_cast<std::int64_t>(blocks.size()) * config_.block_size * row_elems_;
      std::vector<index> out(static_cast<std::size_t>(std::max<std::int64_t>(need + size_delta, 0)),
                             static_cast<index>(config_.num_experts + 1));
      auto expect = predict_transfer(blocks, static_cast<std::int64_t>(out.size()) < need);
      if (!transfer("export_blocks", expect, [&] { lib_->export_blocks(blocks, out); })) { return; }
      const auto want = model_.export_blocks(blocks);
      if (!diverged_ && !std::equal(want.begin(), want.end(), out.begin())) {
        violation("export_blocks differs from the model");
      }
      last_export_.assign(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(need));
    }
  }

  /// @brief Imports the rows of the last export (or synthetic rows, some missing) into `blocks`.
  void import_blocks(std::span<const std::int64_t> blocks, std::int64_t size_delta, std::uint32_t salt)
  {
    trace("import_blocks", blocks.size(), size_delta);
    if constexpr (slot_storage) {
      const auto need = static_cast<std::int64_t>(blocks.size()) * config_.block_size * row_elems_;
      std::vector<index> rows(static_cast<std::size_t>(std::max<std::int64_t>(need + size_delta, 0)));
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const auto row = static_cast<std::int64_t>(i) / row_elems_;
        rows[i] = i < last_export_.size() && salt % 2 == 0
                    ? last_export_[i]
                    : (row % 5 == 3 ? traits::sentinel
                                    : static_cast<index>(routed_expert(
                                        row_meta{static_cast<std::int64_t>(salt), row, 0}, 0,
                                        static_cast<std::int32_t>(i % static_cast<std::size_t>(row_elems_)),
                                        config_.num_experts)));
      }
      auto expect = predict_transfer(blocks, static_cast<std::int64_t>(rows.size()) < need);
      if (!transfer("import_blocks", expect, [&] { lib_->import_blocks(blocks, rows); })) { return; }
      const std::vector<std::int64_t> b(blocks.begin(), blocks.end());
      const std::vector<index> r(rows.begin(), rows.begin() + static_cast<std::ptrdiff_t>(need));
      apply([b, r](model_type& m) { m.import_blocks(b, r); });
    }
  }

  void copy_blocks(std::span<const std::int64_t> source, std::span<const std::int64_t> destination)
  {
    trace("copy_blocks", source.size(), destination.size());
    if constexpr (slot_storage) {
      std::set<routing_replay::errc> expect;
      bool both = false;
      for (const auto d : destination) { both |= std::find(source.begin(), source.end(), d) != source.end(); }
      if (source.size() != destination.size() || both) {
        expect.insert(routing_replay::errc::invalid_argument);
      } else {
        expect = predict_transfer(source, false);
        for (const auto c : predict_transfer(destination, false)) { expect.insert(c); }
      }
      if (!transfer("copy_blocks", expect, [&] { lib_->copy_blocks(source, destination); })) { return; }
      const std::vector<std::int64_t> s(source.begin(), source.end());
      const std::vector<std::int64_t> d(destination.begin(), destination.end());
      apply([s, d](model_type& m) { m.import_blocks(d, m.export_blocks(s)); });
    }
  }

  // ---- the object itself -------------------------------------------------------------------------

  /// @brief Moves the object out and back (move construction, then move assignment over the
  /// moved-from object): nothing observable may change, steps in flight and the open step included.
  void move_round_trip()
  {
    trace("move_round_trip");
    const auto before = counters();
    {
      fault_injector::call_scope call{"move"};
      RR moved{std::move(*lib_)};
      *lib_ = std::move(moved);
    }
    if (counters() != before) { violation("moving the object changed its counters"); }
  }

  /// @brief Assigns a new object over this one: its steps in flight are dropped, everything starts
  /// afresh. Constructing the new one may fail (fault sweeps): then nothing changes.
  void replace()
  {
    trace("replace");
    synchronize_engine();  // the engine's own forwards write into the object's buffers
    const auto before = counters();
    const outcome out = invoke("replace", [&] { *lib_ = make_library(); });
    if (out.threw) {
      if (!out.faulted) { violation("constructing a replacement threw " + describe(out)); }
      if (counters() != before) { violation("a failed replacement changed the object"); }
      return;
    }
    live_.clear();
    flights_.clear();
    pending_segments_.clear();
    parked_.clear();
    filed_through_ = 0;
    open_.reset();
    serial_ = 0;
    log_.clear();
    discarded_.clear();
    model_    = new_model();
    diverged_ = false;
  }

  /// @brief Files everything, then compares every request and the whole pool with the model.
  void check_everything()
  {
    while (lib_->steps_in_flight() > 0) { drain(); }  // each drain files at least one step
    const auto snap = full_snapshot();
    check_counters();
    if (diverged_) { return; }
    for (const auto& [name, rows] : snap.rows) {
      const auto& r = live_.at(name);
      const auto want = model_.extract(model_key(r), 0, model_.recorded_rows(model_key(r)));
      compare_rows(r.id.key(), 0, layers_, want, rows);
    }
    for (const auto& [name, recorded] : snap.recorded) {
      if (recorded != model_.recorded_rows(model_key(live_.at(name)))) {
        violation("recorded_rows(" + name + ") differs from the model");
      }
    }
    if constexpr (slot_storage) {
      if (!open_) {
        std::vector<std::int64_t> all(static_cast<std::size_t>(config_.num_blocks));
        for (std::size_t b = 0; b < all.size(); ++b) { all[b] = static_cast<std::int64_t>(b); }
        const auto want = model_.export_blocks(all);
        const auto diff = std::mismatch(want.begin(), want.end(), snap.pool.begin()).first - want.begin();
        if (static_cast<std::size_t>(diff) < want.size()) {
          violation("the block pool differs from the model at slot " + std::to_string(diff / row_elems_) +
                    ", element " + std::to_string(diff % row_elems_) + ": got " +
                    std::to_string(+snap.pool[static_cast<std::size_t>(diff)]) + ", the model has " +
                    std::to_string(+want[static_cast<std::size_t>(diff)]));
        }
      }
    }
  }

 protected:
  using typename oracle::flight;
  using oracle::account;
  using oracle::apply;
  using oracle::check_counters;
  using oracle::compare_rows;
  using oracle::config_;
  using oracle::counters;
  using oracle::describe;
  using oracle::discarded_;
  using oracle::diverged_;
  using oracle::expected_rows;
  using oracle::filed_through_;
  using oracle::flights_;
  using oracle::full_snapshot;
  using oracle::invoke;
  using oracle::known_layer;
  using oracle::last_export_;
  using oracle::layers_;
  using oracle::lib_;
  using oracle::live_;
  using oracle::log_;
  using oracle::make_library;
  using oracle::may_skip_snapshot;
  using oracle::model_;
  using oracle::model_key;
  using oracle::needed_elems;
  using oracle::new_model;
  using oracle::open_;
  using oracle::parked_;
  using oracle::pending_segments_;
  using oracle::predict_read;
  using oracle::predict_transfer;
  using oracle::prepare_filing_call;
  using oracle::remember;
  using oracle::row_elems_;
  using oracle::run_checked;
  using oracle::serial_;
  using oracle::settle;
  using oracle::snapshot;
  using oracle::stream_;
  using oracle::synchronize_engine;
  using oracle::trace;
  using oracle::transfer;
  using oracle::violation;
};

}  // namespace rr_test
