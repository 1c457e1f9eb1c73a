/// @file
/// One rank of a parallel engine on a randomized schedule, for any backend and communicator: the
/// host tests run the ranks as threads (thread_communicator), the 2-GPU test as processes (NCCL).
/// Every rank runs the same simulated engine from the same seed, so all ranks plan the same steps;
/// each captures its part (every row, a shard of rows, or a stage's layers); the output rank checks
/// every extraction bit-exact against the reference model.
#pragma once

#include "deadline.hpp"
#include "harness.hpp"

#include <routing_replay/parallel/parallel_replay.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <random>
#include <vector>

namespace rr_test {

/// @brief How the output rank's requests are filed besides the replay's own calls: in-process
/// (nothing to add). The worker/scheduler split plans and files packets in these hooks.
struct in_process_filing {
  /// @brief The step is about to begin on the ranks.
  void planned(const routing_replay::step_plan&) {}
  /// @brief The step has ended on the ranks (its forward is done).
  void ended() {}
  /// @brief Something reads a request's rows next.
  void before_read() {}
};

/// @brief Expert parallel with EPLB: `replicas` logical experts 0, 2, 4, ... have two extra
/// physical replicas each, E + j and E + replicas + j for logical 2j; every other physical id is
/// its logical id. Several physical ids map to one logical id.
struct replication_map {
  std::int64_t num_experts = 0;
  std::int64_t replicas    = 0;

  /// @brief Physical experts: E + 2 * replicas.
  [[nodiscard]] ROUTING_REPLAY_HOST_DEVICE std::int64_t num_physical() const noexcept { return num_experts + 2 * replicas; }
  /// @brief physical -> logical, as capture_options::physical_to_logical takes it.
  [[nodiscard]] std::vector<std::int32_t> physical_to_logical() const
  {
    std::vector<std::int32_t> map(static_cast<std::size_t>(num_physical()));
    for (std::int64_t p = 0; p < num_physical(); ++p) {
      map[static_cast<std::size_t>(p)] =
        static_cast<std::int32_t>(p < num_experts ? p : 2 * ((p - num_experts) % replicas));
    }
    return map;
  }
};

/// @brief Path (a) under EPLB: the router output holds physical ids, one of each logical id's
/// replicas picked by the row (as a load balancer would spread them).
template <class Source>
struct write_physical_output {
  const row_meta* meta;
  Source* out;
  std::int64_t stride;
  std::int32_t top_k;
  std::int32_t layer;
  replication_map map;

  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t i) const noexcept
  {
    const std::int64_t row = i / stride;
    const auto column      = static_cast<std::int32_t>(i % stride);
    if (column >= top_k) {
      out[i] = static_cast<Source>(map.num_physical() + 5);  // fused shared experts: skipped
      return;
    }
    const std::int64_t logical = routed_expert(meta[row], layer, column, map.num_experts);
    const std::int64_t pick    = (meta[row].position + column) % 3;
    const bool replicated      = logical % 2 == 0 && logical / 2 < map.replicas;
    out[i] = static_cast<Source>(!replicated || pick == 0 ? logical
                                                          : map.num_experts + (pick - 1) * map.replicas + logical / 2);
  }
};

/// @brief Drives one rank (`Replay`, a parallel_replay) through a randomized schedule.
template <class Replay>
class rank_driver {
  using backend = typename Replay::output_type::backend_type;
  using index   = typename Replay::output_type::index_type;

 public:
  /// @brief `map`: capture physical ids through capture() with this EPLB map (nullptr: the three
  /// capture paths at random, logical ids).
  rank_driver(Replay& replay, const sim_config& sim, const harness_shape& shape, std::uint64_t seed,
              const replication_map* map = nullptr)
    : replay_(replay),
      sim_(sim),
      shape_(shape),
      engine_(sim, seed),
      shared_rng_(seed * 7919 + 17),
      rank_rng_(seed * 31 + static_cast<std::uint64_t>(replay.rank())),
      io_(sim.max_tokens_per_step, shape.top_k + shape.num_fused_shared_experts)
  {
    first_slot_ = 0;
    num_slots_  = static_cast<std::int32_t>(shape.moe_layers.size());
    if (replay.options().scheme == routing_replay::parallel_scheme::pipeline) {
      const auto& stages = replay.options().stage_layers;
      for (int r = 0; r < replay.rank(); ++r) { first_slot_ += stages[static_cast<std::size_t>(r)]; }
      num_slots_ = stages[static_cast<std::size_t>(replay.rank())];
    }
    if (map != nullptr) {
      map_ = *map;
      const auto table = map->physical_to_logical();
      physical_.assign(table.begin(), table.end());
    }
  }

  /// @brief Steps until every request is done (or `max_steps`). `host` is the object requests go
  /// to on the output rank (output() or a scheduler), nullptr elsewhere.
  template <class Host, class Filing = in_process_filing>
  void run(Host* host, Filing&& filing = {}, std::int32_t max_steps = 400)
  {
    if (host != nullptr) {
      model_.emplace(std::is_same_v<typename Host::storage_type, routing_replay::block_slot_storage>,
                     shape_.overwrite, sim_.block_size, sim_.num_blocks,
                     static_cast<std::int64_t>(shape_.moe_layers.size()) * shape_.top_k);
    }
    for (std::int32_t step = 0; step < max_steps && !engine_.done(); ++step) { one_step(host, filing); }
    progress().at("drain", static_cast<std::int64_t>(serial_));
    replay_.drain();
    if (host != nullptr) { filing.before_read(); }
    for (const std::int32_t number : engine_.abort_all()) {
      if (host != nullptr) { forget(host, number, /*finished=*/false); }
    }
    if (host != nullptr) { CHECK(host->num_requests() == 0); }
  }

  /// @brief Rows the output rank compared (0 elsewhere).
  [[nodiscard]] std::int64_t rows_checked() const noexcept { return rows_checked_; }
  /// @brief Steps run.
  [[nodiscard]] std::int64_t steps() const noexcept { return serial_; }

 private:
  template <class Host, class Filing>
  void one_step(Host* host, Filing& filing)
  {
    auto step = engine_.next_step();
    if (host != nullptr) { admit_step(*host, *model_, engine_, step); }
    const std::int64_t n = step.plan.num_rows();
    std::int64_t padded  = std::min<std::int64_t>(n + uniform(shared_rng_, 0, shape_.max_padding), sim_.max_tokens_per_step);
    if (padded > n && uniform(shared_rng_, 0, 1) == 1) {
      step.plan.set_padded_rows(padded);
    }
    std::int64_t first = 0;  // the step rows this rank's forward runs: [first, first + rows)
    std::int64_t rows  = padded;
    if (replay_.options().scheme == routing_replay::parallel_scheme::sequence) {
      const auto shard = replay_.shard(step.plan);
      first            = shard.first_row;
      rows             = shard.shard_rows;
    }
    for (std::int64_t i = 0; i < rows; ++i) {
      const std::int64_t g = first + i;
      io_.meta_host[static_cast<std::size_t>(i)] = g < n ? step.rows[static_cast<std::size_t>(g)] : row_meta{-2, g, -1};
    }
    filing.planned(step.plan);
    auto s    = io_.stream.ref();
    auto& now = progress();  // what a watchdog reports if this rank hangs
    now.at("begin_step", static_cast<std::int64_t>(serial_ + 1));
    replay_.begin_step(step.plan, s);
    if (host != nullptr) { model_->begin_step(step.plan); }  // its fresh blocks
    ++serial_;
    backend::copy_async(backend::data(io_.meta_dev), backend::data(io_.meta_host), static_cast<std::size_t>(rows) * sizeof(row_meta), s);
    for (std::int32_t l = 0; l < num_slots_; ++l) {
      now.at("capture", static_cast<std::int64_t>(serial_), first_slot_ + l);
      forward_layer(first_slot_ + l, rows);
    }
    now.at("end_step (the step's gather, stage merge or copy)", static_cast<std::int64_t>(serial_));
    replay_.end_step(s);
    now.at("stream synchronize after end_step", static_cast<std::int64_t>(serial_));
    backend::synchronize(s);  // the engine reads back its sampled tokens
    now.at("filing the step (packets, reference model)", static_cast<std::int64_t>(serial_));
    filing.ended();
    if (host != nullptr) {
      model_->file_step(step.plan, serial_, [&](std::int64_t row) {
        return routed_row<index>(step.rows[static_cast<std::size_t>(row)], shape_);
      });
    }
    const auto outcome = engine_.complete_step(step);
    if (host == nullptr) { return; }
    for (const auto& [number, accepted] : outcome.accepts) {
      const auto key = engine_.requests()[static_cast<std::size_t>(number)].key();
      host->accept_draft(key, accepted);
      model_->accept_draft(key, accepted);
    }
    for (const std::int32_t number : outcome.finished) {
      filing.before_read();
      compare(host, number, {});
      forget(host, number, /*finished=*/true);
    }
    for (const std::int32_t number : outcome.aborted) { forget(host, number, /*finished=*/false); }
    if (uniform(output_rng_, 0, 9) < 3) {  // mid-flight extraction of a live request, from an offset
      for (const auto& r : engine_.requests()) {
        if (!r.added || !host->contains(r.key()) || uniform(output_rng_, 0, 3) != 0) { continue; }
        const std::int64_t recorded = model_->recorded_rows(r.key());
        routing_replay::extract_options o;
        o.start_position = uniform(output_rng_, 0, recorded);
        o.end_position   = uniform(output_rng_, o.start_position, recorded);
        filing.before_read();
        compare(host, r.number, o);
        break;
      }
    }
  }

  template <class Host>
  void compare(Host* host, std::int32_t number, const routing_replay::extract_options& o)
  {
    const auto key = engine_.requests()[static_cast<std::size_t>(number)].key();
    progress().at("extract (files the steps in flight)", static_cast<std::int64_t>(serial_));
    rows_checked_ += compare_extraction(*host, *model_, key, o, [&] { return uniform(output_rng_, 0, 3) == 0; });
  }

  template <class Host>
  void forget(Host* host, std::int32_t number, bool finished)
  {
    const auto key = engine_.requests()[static_cast<std::size_t>(number)].key();
    if (finished) {
      host->release(key);
    } else {
      host->abort(key);
    }
    model_->remove(key);
  }

  // One layer of this rank's forward over `rows` rows: every path at random, or physical ids
  // through capture() under EPLB. The router's value depends on the layer slot of the whole model.
  void forward_layer(std::int32_t slot, std::int64_t rows)
  {
    const std::int32_t model_layer = shape_.moe_layers[static_cast<std::size_t>(slot)];
    const std::int32_t k           = shape_.top_k;
    const std::int64_t stride      = k + shape_.num_fused_shared_experts;
    const row_meta* meta           = backend::data(io_.meta_dev);
    auto s                         = io_.stream.ref();
    if (map_.num_experts > 0) {
      backend::bulk_async(rows * stride, write_physical_output<std::int32_t>{meta, backend::data(io_.ids32), stride, k, slot, map_}, s);
      routing_replay::capture_options o;
      o.physical_to_logical  = backend::data(physical_);
      o.num_physical_experts = map_.num_physical();
      replay_.capture(model_layer, static_cast<const std::int32_t*>(backend::data(io_.ids32)), rows, s, o);
      return;
    }
    const std::int64_t e = shape_.num_experts;
    switch (uniform(rank_rng_, 0, 4)) {
      case 0: capture_through(io_.ids64, slot, model_layer, rows); break;
      case 1: capture_through(io_.ids32, slot, model_layer, rows); break;
      case 2: capture_through(io_.ids16, slot, model_layer, rows); break;
      case 3: {
        auto view = replay_.layer_view(model_layer, rows);
        backend::bulk_async(rows * k, write_layer_view<decltype(view)>{meta, view, k, slot, e}, s);
        break;
      }
      default: {
        auto ref = replay_.ref(rows);
        backend::bulk_async(rows * k, record_through_ref<decltype(ref)>{meta, ref, k, slot, e, replay_.layer_slot(model_layer)}, s);
        break;
      }
    }
  }

  template <class Vector>
  void capture_through(Vector& ids, std::int32_t slot, std::int32_t model_layer, std::int64_t rows)
  {
    capture_router_output<backend>(replay_, ids, backend::data(io_.meta_dev), shape_, slot, model_layer, rows, io_.stream.ref());
  }

  static std::int64_t uniform(std::mt19937_64& rng, std::int64_t lo, std::int64_t hi)
  {
    return std::uniform_int_distribution<std::int64_t>{lo, hi}(rng);
  }

  Replay& replay_;
  sim_config sim_;
  harness_shape shape_;
  engine_sim engine_;
  std::mt19937_64 shared_rng_;               // decisions every rank makes alike (padding)
  std::mt19937_64 rank_rng_;                 // this rank's own (capture paths)
  std::mt19937_64 output_rng_{12345};        // the output rank's (extractions)
  std::optional<reference_model<index>> model_;  // output rank
  std::int32_t first_slot_ = 0, num_slots_ = 0;  // the layer slots this rank captures
  replication_map map_{};
  router_scratch<backend> io_;
  typename backend::template device_vector<std::int32_t> physical_;
  std::uint64_t serial_      = 0;
  std::int64_t rows_checked_ = 0;
};

}  // namespace rr_test
