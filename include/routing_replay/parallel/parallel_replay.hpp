/// @file
/// One rank of a parallel engine. Every rank runs the same binary, the same capture code and the
/// same CUDA graphs; the role is chosen at run time: the output rank holds an output side (a
/// RoutingReplay, or a packet_worker that ships rows to a scheduler process), every other rank
/// holds only a capture buffer. How rows reach the output rank is the parallel_scheme.
#pragma once

#include <routing_replay/backend.hpp>
#include <routing_replay/config.hpp>
#include <routing_replay/data_path/capture_buffer.hpp>
#include <routing_replay/detail/step_status.hpp>
#include <routing_replay/detail/validate_config.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/layer_map.hpp>
#include <routing_replay/parallel/communicator.hpp>
#include <routing_replay/parallel/rank_exchange.hpp>
#include <routing_replay/step_plan.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace routing_replay {

/// @brief What the output rank holds: RoutingReplay (files rows into host storage in this process)
/// or packet_worker (packs them for a scheduler process). Besides the capture paths it offers
/// end_step(compute, harvest), through which a parallel scheme gathers or merges other ranks' rows.
template <class O>
concept output_side = requires(O& o, const step_plan& plan, typename O::stream_ref s) {
  typename O::backend_type;
  typename O::index_type;
  typename O::layout_type;
  o.begin_step(plan, s);
  o.end_step(s);
  o.drain();
};

/// @brief Options of a parallel_replay rank.
struct parallel_options {
  /// @brief How this rank's rows reach the output rank.
  parallel_scheme scheme = parallel_scheme::replicated;
  /// @brief The rank that copies rows to the host and files (or packs) them.
  int output_rank = 0;
  /// @brief Pipeline: captured layers owned by each stage, in rank order (consecutive in
  /// replay_config::moe_layers order; they sum to L). Unused by the other schemes.
  std::vector<std::int32_t> stage_layers;
};

/// @brief One rank of a tensor-, sequence- or pipeline-parallel engine, with its role (output rank
/// or capture-only) chosen at run time from the communicator's rank.
///
/// All ranks call the same members with the same plans, in the same order (collectives are
/// matched in order): begin_step(), the capture paths, end_step(). Requests, extraction and
/// drafts go to output() on the output rank only.
///
/// A capture-only rank allocates D (on the device) and nothing on the host that grows with the KV
/// pool or the requests: no host storage, no pinned staging, no device-to-host copy. With
/// parallel_scheme::replicated its end_step() is one reset of the rows written.
/// @tparam Output the output rank's side (output_side): RoutingReplay<...> or packet_worker<...>
/// @tparam Comm the engine's communicator (communicator over Output's streams)
template <output_side Output, communicator<typename Output::stream_ref> Comm>
class parallel_replay {
  using Backend      = typename Output::backend_type;
  using Index        = typename Output::index_type;
  using Layout       = typename Output::layout_type;
  using local_buffer = capture_buffer<Backend, Index, Layout>;

 public:
  /// @brief Stream handle taken by every call that enqueues work.
  using stream_ref = typename Backend::stream_ref;
  /// @brief The output rank's side.
  using output_type = Output;
  /// @brief Trivially copyable device reference (capture path c).
  using ref_type = device_ref<Index, Layout>;
  /// @brief Per-layer [rows, K] view of D (capture path b).
  using layer_view_type = typename local_buffer::layer_view_type;

  /// @brief This rank of the engine: `config` is the whole model's (all layers, the step's N_max),
  /// `comm` the engine's communicator (the library never creates one). On the output rank the
  /// output side is constructed from `config` and `output_args` (e.g. a copy stream).
  /// @throws error invalid_config (bad options, bad stages), as the output side's constructor
  template <class... OutputArgs>
  parallel_replay(replay_config config, parallel_options options, Comm comm, OutputArgs&&... output_args)
    : config_(detail::validated_config<Index>(std::move(config))), options_(std::move(options)), comm_(comm)
  {
    if (options_.output_rank < 0 || options_.output_rank >= comm_.size()) {
      throw error{errc::invalid_config, "output_rank " + std::to_string(options_.output_rank) + " is not a rank of " +
                                          std::to_string(comm_.size())};
    }
    replay_config local = config_;
    if (options_.scheme == parallel_scheme::sequence) {
      sequence_.emplace(config_.max_tokens_per_step, static_cast<std::int64_t>(config_.moe_layers.size()) * config_.top_k,
                        comm_.size());
      local.max_tokens_per_step = static_cast<std::int32_t>(sequence_->max_shard_rows());
    } else if (options_.scheme == parallel_scheme::pipeline) {
      if (static_cast<int>(options_.stage_layers.size()) != comm_.size()) {
        throw error{errc::invalid_config, "pipeline: stage_layers names " + std::to_string(options_.stage_layers.size()) +
                                            " stages for " + std::to_string(comm_.size()) + " ranks"};
      }
      stages_.emplace(config_, options_.stage_layers, comm_.rank(), options_.output_rank);
      local = decltype(stages_)::value_type::stage_config(config_, options_.stage_layers, comm_.rank());
    }
    if (is_output_rank()) {
      output_.emplace(config_, std::forward<OutputArgs>(output_args)...);
    } else {
      local_.emplace(local, layer_map{local});
      scratch_status_.resize(1);
    }
  }

  /// @brief Whether this rank copies rows to the host and files them.
  [[nodiscard]] bool is_output_rank() const noexcept { return comm_.rank() == options_.output_rank; }
  /// @brief This rank.
  [[nodiscard]] int rank() const noexcept { return comm_.rank(); }
  /// @brief Ranks of the engine.
  [[nodiscard]] int size() const noexcept { return comm_.size(); }
  /// @brief The options this rank runs with.
  [[nodiscard]] const parallel_options& options() const noexcept { return options_; }

  /// @brief The output side, for requests, drafts and extraction (output rank only; steps and
  /// capture go through this object, never through the output side directly).
  /// @throws error invalid_state on a capture-only rank
  [[nodiscard]] Output& output()
  {
    if (!output_) {
      throw error{errc::invalid_state, "rank " + std::to_string(rank()) + " is capture-only; rank " +
                                         std::to_string(options_.output_rank) + " holds the output side"};
    }
    return *output_;
  }

  /// @brief Sequence parallel: this rank's shard of a step (its capture calls take
  /// shard.shard_rows rows: the step's rows [shard.first_row, shard.first_row + shard.shard_rows)).
  [[nodiscard]] sequence_shard shard(const step_plan& plan) const noexcept
  {
    return sequence_shard::of(plan.num_rows(), plan.padded_rows(), comm_.rank(), comm_.size());
  }

  /// @name Steps (every rank, same plans, same order)
  /// @{

  /// @brief Opens a step: on the output rank as its output side does (validation, storage); on a
  /// capture-only rank the plan's row counts only.
  /// @throws error too_many_tokens, invalid_state; on the output rank as its begin_step()
  void begin_step(const step_plan& plan, stream_ref compute)
  {
    if (std::max(plan.num_rows(), plan.padded_rows()) > config_.max_tokens_per_step) {
      throw error{errc::too_many_tokens, "step plan runs " + std::to_string(std::max(plan.num_rows(), plan.padded_rows())) +
                                           " rows, more than max_tokens_per_step " +
                                           std::to_string(config_.max_tokens_per_step)};
    }
    if (output_) {
      output_->begin_step(plan, compute);
      return;
    }
    if (open_) { throw error{errc::invalid_state, "begin_step: a step is still open; call end_step first"}; }
    rows_   = plan.num_rows();
    padded_ = plan.padded_rows();
    const std::int64_t local_rows = options_.scheme == parallel_scheme::sequence ? shard(plan).shard_rows : rows_;
    local_->begin_step(local_rows, compute);
    open_ = true;
  }

  /// @brief Closes the step on every rank, once the forward is enqueued on `compute`: a
  /// capture-only rank resets what it wrote (replicated), or contributes its shard or slab to the
  /// step's one exchange (sequence, pipeline), on `compute`; the output rank gathers or merges them
  /// and copies and files as its output side does.
  /// @throws error invalid_state; on the output rank as its end_step()
  void end_step(stream_ref compute)
  {
    if (output_) {
      end_output_step(compute);
      return;
    }
    if (!open_) { throw error{errc::invalid_state, "end_step without an open step; call begin_step first"}; }
    open_ = false;
    switch (options_.scheme) {
      case parallel_scheme::replicated:  // the output rank checks the same routing: reset only
        local_->end_step(nullptr, Backend::data(scratch_status_), 0, padded_ >= 0 ? std::max(rows_, padded_) : -1,
                         compute);
        break;
      case parallel_scheme::sequence: {
        const auto s = sequence_shard::of(rows_, padded_, comm_.rank(), comm_.size());
        sequence_->exchange_async(*local_, s, rows_, comm_, nullptr, nullptr, compute);
        break;
      }
      case parallel_scheme::pipeline: stages_->send_async(*local_, rows_, padded_, comm_, compute); break;
    }
  }

  /// @brief Output rank: files every step in flight (output side's drain()); nothing elsewhere.
  void drain()
  {
    if (output_) { output_->drain(); }
  }
  /// @}

  /// @name Capture paths (as RoutingReplay's; D is this rank's: a shard of rows, or a stage's layers)
  /// @{

  /// @brief (a) Records a layer's router output on `stream` (RoutingReplay::capture()).
  /// @throws error unknown_layer, too_many_tokens, invalid_argument
  template <source_index Source>
  void capture(std::int32_t model_layer, const Source* topk_ids, std::int64_t num_tokens, stream_ref stream,
               const capture_options& options = {})
  {
    if (output_) {
      output_->capture(model_layer, topk_ids, num_tokens, stream, options);
    } else {
      local_->capture(model_layer, topk_ids, num_tokens, stream, options);
    }
  }
  /// @brief (b) The [num_rows, K] slab of D for a model layer (RoutingReplay::layer_view()).
  /// @throws error unknown_layer, too_many_tokens
  [[nodiscard]] layer_view_type layer_view(std::int32_t model_layer, std::int64_t num_rows)
  {
    return output_ ? output_->layer_view(model_layer, num_rows) : local_->layer_view(model_layer, num_rows);
  }
  /// @brief (c) A trivially copyable device reference (RoutingReplay::ref()).
  /// @throws error too_many_tokens
  [[nodiscard]] ref_type ref(std::int64_t num_rows) { return output_ ? output_->ref(num_rows) : local_->ref(num_rows); }
  /// @brief The layer slot of a model layer in this rank's D, for ref().record().
  /// @throws error unknown_layer
  [[nodiscard]] std::int32_t layer_slot(std::int32_t model_layer) const
  {
    return output_ ? output_->layer_slot(model_layer) : local_->layers().slot(model_layer);
  }
  /// @}

 private:
  void end_output_step(stream_ref compute)
  {
    const int rank = comm_.rank(), ranks = comm_.size();
    switch (options_.scheme) {
      case parallel_scheme::replicated: output_->end_step(compute); break;
      case parallel_scheme::sequence:
        output_->end_step(compute, [&](auto& d, const auto& step, Index* snapshot, detail::step_status* status, stream_ref s) {
          const auto shard = sequence_shard::of(step.num_rows, step.padded_rows, rank, ranks);
          sequence_->exchange_async(d, shard, step.num_rows, comm_, snapshot, status, s);
        });
        break;
      case parallel_scheme::pipeline:
        output_->end_step(compute, [&](auto& d, const auto& step, Index* snapshot, detail::step_status* status, stream_ref s) {
          stages_->harvest_async(d, step.num_rows, step.padded_rows, comm_, snapshot, status, s);
        });
        break;
    }
  }

  replay_config config_;
  parallel_options options_;
  Comm comm_;
  std::optional<sequence_exchange<Backend, Index>> sequence_;
  std::optional<stage_exchange<Backend, Index, Layout>> stages_;
  std::optional<local_buffer> local_;  // capture-only ranks: D
  typename Backend::template device_vector<detail::step_status> scratch_status_;  // replicated resets
  std::int64_t rows_ = 0, padded_ = -1;
  bool open_ = false;
  // Last: destroyed first, it waits for its copies while the exchange buffers still exist.
  std::optional<Output> output_;
};

}  // namespace routing_replay
