/// @file
/// Data parallel with naive dispatch on a randomized schedule, for any backend: every DP rank runs
/// its own engine (its own requests), and the router output of every layer holds all ranks'
/// tokens, rank after rank. This rank's forward is recorded once (a CUDA graph on the GPU) with
/// capture_options::device_row_span, and replayed every step while the per-rank token counts
/// change; only the span in device memory says which rows are this rank's.
#pragma once

#include "deadline.hpp"
#include "harness.hpp"

#include <routing_replay/routing_replay.hpp>

#include <cstdint>
#include <functional>
#include <vector>

namespace rr_test {

/// @brief Records a forward for replay on the host backend: there are no graphs, so a replay runs
/// the same host calls with the same arguments, which is what a graph replay amounts to.
struct host_recorder {
  /// @brief The recorded forward: replay(stream) reruns it.
  template <class Forward, class Stream>
  std::function<void(Stream)> record(Forward forward, Stream)
  {
    return [forward](Stream) { forward(); };
  }
};

/// @brief Drives DP rank `rank` of `ranks` (a RoutingReplay `RR`) on the schedules of seeds
/// `seed`, `seed + 1`, ... (one engine per rank; the others only contribute tokens).
template <class RR>
class dp_driver {
  using backend = typename RR::backend_type;
  using index   = typename RR::index_type;

 public:
  dp_driver(int rank, int ranks, const sim_config& sim, const harness_shape& shape, std::uint64_t seed)
    : rank_(rank),
      sim_(sim),
      shape_(shape),
      lib_(make_replay_config(sim, shape)),
      model_(std::is_same_v<typename RR::storage_type, routing_replay::block_slot_storage>, shape.overwrite,
             sim.block_size, sim.num_blocks, static_cast<std::int64_t>(shape.moe_layers.size()) * shape.top_k),
      all_rows_(static_cast<std::int64_t>(ranks) * sim.max_tokens_per_step),
      io_(all_rows_, shape.top_k + shape.num_fused_shared_experts),
      span_host_(1),
      span_dev_(1)
  {
    for (int r = 0; r < ranks; ++r) { engines_.emplace_back(sim, seed + static_cast<std::uint64_t>(r)); }
  }

  /// @brief Records this rank's forward once (outside any step), then steps every engine until all
  /// are done, replaying it; checks this rank's requests bit-exact as they finish.
  template <class Recorder>
  void run(Recorder& recorder)
  {
    auto s      = io_.stream.ref();
    auto replay = recorder.record([this] { forward(); }, s);
    while (!all_done()) {
      std::vector<engine_sim::step> steps;
      steps.reserve(engines_.size());  // a step's plan points into its own slot lists: never copy one
      for (auto& e : engines_) { steps.push_back(e.next_step()); }
      auto& own = steps[static_cast<std::size_t>(rank_)];
      admit_step(lib_, model_, engines_[static_cast<std::size_t>(rank_)], own);
      // the router output: every rank's rows, rank after rank; padding past them
      std::int64_t at = 0, first = 0;
      for (std::size_t r = 0; r < steps.size(); ++r) {
        if (static_cast<int>(r) == rank_) { first = at; }
        for (const auto& m : steps[r].rows) { io_.meta_host[static_cast<std::size_t>(at++)] = m; }
      }
      for (std::int64_t i = at; i < all_rows_; ++i) { io_.meta_host[static_cast<std::size_t>(i)] = row_meta{-2, i, -1}; }
      span_host_[0] = {first, own.plan.num_rows()};
      own.plan.set_padded_rows(own.plan.num_rows());  // the replay writes exactly this rank's rows
      auto& now = progress();  // what a watchdog reports if this rank hangs
      now.at("begin_step", static_cast<std::int64_t>(serial_ + 1));
      lib_.begin_step(own.plan, s);
      model_.begin_step(own.plan);  // its fresh blocks
      backend::copy_async(backend::data(io_.meta_dev), backend::data(io_.meta_host), io_.meta_host.size() * sizeof(row_meta), s);
      backend::copy_async(backend::data(span_dev_), backend::data(span_host_), sizeof(routing_replay::row_span), s);
      now.at("the recorded forward (CUDA graph launch)", static_cast<std::int64_t>(serial_ + 1));
      replay(s);
      now.at("end_step", static_cast<std::int64_t>(serial_ + 1));
      lib_.end_step(s);
      now.at("stream synchronize after end_step", static_cast<std::int64_t>(serial_ + 1));
      backend::synchronize(s);
      ++serial_;
      now.at("settling the step (reference model, extractions)", static_cast<std::int64_t>(serial_));
      model_.file_step(own.plan, serial_, [&](std::int64_t row) { return routed_row<index>(own.rows[static_cast<std::size_t>(row)], shape_); });
      for (std::size_t r = 0; r < steps.size(); ++r) {
        const auto outcome = engines_[r].complete_step(steps[r]);
        if (static_cast<int>(r) == rank_) { settle(outcome); }
      }
    }
    progress().at("drain", static_cast<std::int64_t>(serial_));
    lib_.drain();
  }

  /// @brief Rows compared.
  [[nodiscard]] std::int64_t rows_checked() const noexcept { return rows_checked_; }
  /// @brief Steps this rank ran with tokens of its own and with none.
  [[nodiscard]] std::int64_t steps() const noexcept { return serial_; }

 private:
  // The recorded forward: every layer's router output over all ranks' rows, and one capture of up
  // to N_max rows whose span comes from device memory. Nothing here changes from step to step.
  void forward()
  {
    const std::int64_t stride = shape_.top_k + shape_.num_fused_shared_experts;
    routing_replay::capture_options o;
    o.device_row_span = backend::data(span_dev_);
    for (std::size_t slot = 0; slot < shape_.moe_layers.size(); ++slot) {
      backend::bulk_async(all_rows_ * stride,
                          write_router_output<std::int32_t>{backend::data(io_.meta_dev), backend::data(io_.ids32), stride, shape_.top_k,
                                                            static_cast<std::int32_t>(slot), shape_.num_experts},
                          io_.stream.ref());
      lib_.capture(shape_.moe_layers[slot], static_cast<const std::int32_t*>(backend::data(io_.ids32)), sim_.max_tokens_per_step,
                   io_.stream.ref(), o);
    }
  }

  [[nodiscard]] bool all_done() const
  {
    for (const auto& e : engines_) {
      if (!e.done()) { return false; }
    }
    return true;
  }

  void settle(const engine_sim::outcome& outcome)
  {
    const auto& engine = engines_[static_cast<std::size_t>(rank_)];
    auto key           = [&](std::int32_t number) { return engine.requests()[static_cast<std::size_t>(number)].key(); };
    for (const auto& [number, accepted] : outcome.accepts) {
      lib_.accept_draft(key(number), accepted);
      model_.accept_draft(key(number), accepted);
    }
    for (const std::int32_t number : outcome.finished) {
      rows_checked_ += compare_extraction(lib_, model_, key(number), {}, [] { return true; });
      lib_.release(key(number));
      model_.remove(key(number));
    }
    for (const std::int32_t number : outcome.aborted) {
      lib_.abort(key(number));
      model_.remove(key(number));
    }
  }

  int rank_;
  sim_config sim_;
  harness_shape shape_;
  RR lib_;
  reference_model<index> model_;
  std::vector<engine_sim> engines_;  // one per DP rank
  std::int64_t all_rows_;            // ranks * N_max: the router output's rows
  router_scratch<backend> io_;  // every rank's rows
  typename backend::template pinned_vector<routing_replay::row_span> span_host_;
  typename backend::template device_vector<routing_replay::row_span> span_dev_;
  std::uint64_t serial_      = 0;
  std::int64_t rows_checked_ = 0;
};

}  // namespace rr_test
