/// @file
/// A tiny replay (3 model layers of which 2 are MoE, K = 2, E = 8) with helpers to run a step from
/// explicit ids, for deterministic scenario and error tests on any backend.
#pragma once

#include <routing_replay/routing_replay.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace rr_test {

/// @brief The configuration of small_replay: model layer 0 is dense, 1 and 2 are MoE.
inline routing_replay::replay_config small_config(bool overwrite_recomputed_rows = false)
{
  routing_replay::replay_config c;
  c.overwrite_recomputed_rows = overwrite_recomputed_rows;
  c.num_experts              = 8;
  c.top_k                    = 2;
  c.num_fused_shared_experts = 1;
  c.max_tokens_per_step      = 8;
  c.max_model_len            = 32;
  c.moe_layers               = {1, 2};
  c.num_model_layers         = 3;
  c.block_size               = 4;
  c.num_blocks               = 8;
  // no worker thread mapping memory ahead: the fault sweeps built on this configuration count, and
  // fail, the backend operations and allocations of the engine's thread, in order
  c.host_memory_ahead = 0;
  return c;
}

/// @brief Default ids: distinct per (layer slot, row, column) and salt, always in [0, 8).
inline std::int64_t small_id(std::int32_t slot, std::int64_t row, std::int32_t k, std::int64_t salt)
{
  return (slot * 3 + row * 5 + k * 7 + salt) % 8;
}

/// @brief Owns a replay, a stream and staging for router outputs.
template <class RR>
class small_replay {
 public:
  using backend = typename RR::backend_type;
  using index   = typename RR::index_type;
  using id_fn   = std::function<std::int64_t(std::int32_t slot, std::int64_t row, std::int32_t k)>;

  explicit small_replay(routing_replay::replay_config config = small_config())
    : config_(config),
      rr_(config),
      stride_(config.top_k + config.num_fused_shared_experts),
      host_ids_(static_cast<std::size_t>(config.moe_layers.size()) * config.max_tokens_per_step * stride_),
      device_ids_(host_ids_.size())
  {
  }

  RR& rr() noexcept { return rr_; }
  typename backend::stream_ref stream() noexcept { return stream_.ref(); }

  /// @brief Writes router outputs for `rows` rows of every captured layer except `skip_slot`
  /// (which then stays unwritten) and captures them through capture().
  void forward(std::int64_t rows, const id_fn& id, std::int32_t skip_slot = -1)
  {
    const auto k = config_.top_k;
    for (std::size_t slot = 0; slot < config_.moe_layers.size(); ++slot) {
      for (std::int64_t r = 0; r < rows; ++r) {
        for (std::int64_t c = 0; c < stride_; ++c) {
          host_ids_[offset(slot) + static_cast<std::size_t>(r * stride_ + c)] =
            c < k ? id(static_cast<std::int32_t>(slot), r, static_cast<std::int32_t>(c)) : 99;
        }
      }
    }
    backend::copy_async(backend::data(device_ids_), backend::data(host_ids_),
                        host_ids_.size() * sizeof(std::int64_t), stream());
    for (std::size_t slot = 0; slot < config_.moe_layers.size(); ++slot) {
      if (static_cast<std::int32_t>(slot) == skip_slot) { continue; }
      rr_.capture(config_.moe_layers[slot], backend::data(device_ids_) + offset(slot), rows, stream());
    }
  }

  /// @brief begin_step, forward with small_id(salt), end_step, and the readback synchronize.
  void step(const routing_replay::step_plan& plan, std::int64_t salt)
  {
    rr_.begin_step(plan, stream());
    forward(plan.num_rows(), [&](std::int32_t s, std::int64_t r, std::int32_t k) {
      return small_id(s, r, k, salt);
    });
    end_step();
  }

  /// @brief end_step then the readback synchronize, even when end_step throws.
  void end_step()
  {
    try {
      rr_.end_step(stream());
    } catch (...) {
      backend::synchronize(stream());
      throw;
    }
    backend::synchronize(stream());
  }

  /// @brief end_step(), then files every step in flight (deferred strategies report a step's
  /// device-detected problems when they file it).
  void end_step_and_drain()
  {
    end_step();
    rr_.drain();
  }

  /// @brief A request's rows as a flat copy.
  std::vector<index> rows(routing_replay::request_key id)
  {
    const auto r = rr_.extract(id);
    return {r.flat().begin(), r.flat().end()};
  }

 private:
  [[nodiscard]] std::size_t offset(std::size_t slot) const
  {
    return slot * static_cast<std::size_t>(config_.max_tokens_per_step * stride_);
  }

  routing_replay::replay_config config_;
  RR rr_;
  typename backend::stream stream_;
  std::int64_t stride_;
  typename backend::template pinned_vector<std::int64_t> host_ids_;
  typename backend::template device_vector<std::int64_t> device_ids_;
};

/// @brief The expected flat row of a position written at `row` of a step with `salt`.
template <class Index>
std::vector<Index> small_row(std::int64_t row, std::int64_t salt)
{
  std::vector<Index> out;
  for (std::int32_t slot = 0; slot < 2; ++slot) {
    for (std::int32_t k = 0; k < 2; ++k) { out.push_back(static_cast<Index>(small_id(slot, row, k, salt))); }
  }
  return out;
}

}  // namespace rr_test
