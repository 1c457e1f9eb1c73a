/// @file
/// Drives a RoutingReplay of any policy combination and the reference model through the same
/// simulated engine, and checks every extraction bit-exact. Backend-generic: the router and the
/// three capture paths run as bulk "kernels" on the backend's stream.
#pragma once

#include "engine_sim.hpp"
#include "reference_model.hpp"
#include "synthetic_router.hpp"

#include <routing_replay/routing_replay.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace rr_test {

/// @brief Shape of the replay under test (small, so many schedules run quickly).
struct harness_shape {
  std::int32_t num_experts              = 120;
  std::int32_t top_k                    = 4;
  std::int32_t num_fused_shared_experts = 1;
  std::vector<std::int32_t> moe_layers  = {1, 2, 4};
  std::int32_t num_model_layers         = 5;
  bool overwrite                        = false;
  std::int32_t max_padding              = 8;  ///< extra rows written past N, as CUDA-graph padding
};

/// @brief The capture path a layer uses in a step.
enum class capture_path { capture_int64, capture_int32, capture_int16, layer_view, device_ref };

/// @brief What a simulated forward uses on the device: its stream, the rows' metadata (pinned for
/// the copy, and on the device) and a router output of each source id type.
template <class Backend>
struct router_scratch {
  /// @brief For forwards of up to `rows` rows of router outputs `stride` ids wide.
  router_scratch(std::int64_t rows, std::int64_t stride)
    : meta_host(static_cast<std::size_t>(rows)),
      meta_dev(static_cast<std::size_t>(rows)),
      ids64(static_cast<std::size_t>(rows * stride)),
      ids32(static_cast<std::size_t>(rows * stride)),
      ids16(static_cast<std::size_t>(rows * stride))
  {
  }
  typename Backend::stream stream;
  typename Backend::template pinned_vector<row_meta> meta_host;
  typename Backend::template device_vector<row_meta> meta_dev;
  typename Backend::template device_vector<std::int64_t> ids64;
  typename Backend::template device_vector<std::int32_t> ids32;
  typename Backend::template device_vector<std::int16_t> ids16;
};

/// @brief The replay_config of a simulated engine and a replay shape.
inline routing_replay::replay_config make_replay_config(const sim_config& sim, const harness_shape& shape)
{
  routing_replay::replay_config c;
  c.num_experts              = shape.num_experts;
  c.top_k                    = shape.top_k;
  c.num_fused_shared_experts = shape.num_fused_shared_experts;
  c.max_tokens_per_step      = sim.max_tokens_per_step;
  c.max_model_len            = sim.max_model_len;
  c.moe_layers               = shape.moe_layers;
  c.num_model_layers         = shape.num_model_layers;
  c.block_size               = sim.block_size;
  c.num_blocks               = sim.num_blocks;
  c.overwrite_recomputed_rows = shape.overwrite;
  return c;
}

/// @brief The row the synthetic router produces for `m`: every captured layer's K ids (the same
/// values as routed_expert() cell by cell, with the row's hash computed once and a mask instead of
/// a division where E is a power of two: the reference model builds every filed row, which
/// dominated the CUDA soak's host time at L 48, K 8).
template <class Index>
[[nodiscard]] std::vector<Index> routed_row(const row_meta& m, const harness_shape& shape)
{
  const auto layers     = static_cast<std::int32_t>(shape.moe_layers.size());
  const std::uint64_t h = routed_row_hash(m);
  const auto e          = static_cast<std::uint64_t>(shape.num_experts);
  std::vector<Index> row(static_cast<std::size_t>(layers) * static_cast<std::size_t>(shape.top_k));
  auto fill = [&](auto reduce) {
    std::size_t i = 0;
    for (std::int32_t slot = 0; slot < layers; ++slot) {
      for (std::int32_t k = 0; k < shape.top_k; ++k) { row[i++] = static_cast<Index>(reduce(routed_mix(h, slot, k))); }
    }
  };
  if ((e & (e - 1)) == 0) {
    fill([mask = e - 1](std::uint64_t x) { return x & mask; });
  } else {
    fill([e](std::uint64_t x) { return x % e; });
  }
  return row;
}

/// @brief Registers the requests a step admits, and the cached prefixes it serves, with the library
/// (`lib`: a RoutingReplay, or any host side) and the reference model alike.
template <class Lib, class Index>
void admit_step(Lib& lib, reference_model<Index>& model, const engine_sim& engine, const engine_sim::step& step)
{
  for (const auto& [number, cached] : step.prefixes) {
    const auto& r = engine.requests()[static_cast<std::size_t>(number)];
    if (std::find(step.added.begin(), step.added.end(), number) != step.added.end()) {
      lib.add_request(r.key(), {r.prompt_len, cached});
      model.add_request(r.key(), r.prompt_len, cached);
    } else {
      lib.add_cached_prefix(r.key(), cached);
      model.add_cached_prefix(r.key(), cached);
    }
  }
}

/// @brief Path (a): the synthetic router writes layer slot `slot`'s output for `rows` rows of
/// `meta` into `ids` (a device vector of any id type), and `lib` captures it as `model_layer`.
template <class Backend, class Lib, class Vector>
void capture_router_output(Lib& lib, Vector& ids, const row_meta* meta, const harness_shape& shape, std::int32_t slot,
                           std::int32_t model_layer, std::int64_t rows, typename Backend::stream_ref stream)
{
  using source              = typename Vector::value_type;
  const std::int64_t stride = shape.top_k + shape.num_fused_shared_experts;
  source* out               = Backend::data(ids);
  Backend::bulk_async(rows * stride, write_router_output<source>{meta, out, stride, shape.top_k, slot, shape.num_experts},
                      stream);
  lib.capture(model_layer, static_cast<const source*>(out), rows, stream);
}

/// @brief Extracts `key` from `lib` (a RoutingReplay, or any host side) and checks it bit-exact
/// against the reference model; `also_copy()` says whether extract_into() is checked too. Returns
/// the rows compared.
template <class Lib, class Index, class AlsoCopy>
std::int64_t compare_extraction(Lib& lib, const reference_model<Index>& model, routing_replay::request_key key,
                                const routing_replay::extract_options& o, AlsoCopy also_copy)
{
  const std::int64_t recorded = model.recorded_rows(key);
  REQUIRE(lib.recorded_rows(key) == recorded);
  const std::int64_t end = o.end_position < 0 ? recorded : o.end_position;
  const auto expected    = model.extract(key, o.start_position, end);
  const auto got         = lib.extract(key, o);
  REQUIRE(got.num_rows() == end - o.start_position);
  REQUIRE(got.first_position() == o.start_position);
  REQUIRE(got.prompt_length() == model.prompt_length(key));
  const auto flat = got.flat();
  REQUIRE(flat.size() == expected.size());
  const std::int64_t row_size = lib.row_size();
  // one pass over the whole extraction; only a mismatch is located cell by cell (for its message)
  const bool same = std::equal(expected.begin(), expected.end(), flat.begin());
  for (std::size_t i = 0; !same && i < expected.size(); ++i) {
    if (flat[i] != expected[i]) {
      std::ostringstream where;
      where << "request " << key.to_string() << " position "
            << o.start_position + static_cast<std::int64_t>(i) / row_size << " element "
            << static_cast<std::int64_t>(i) % row_size << ": got " << +flat[i] << ", expected " << +expected[i];
      FAIL(where.str());
    }
  }
  if (also_copy()) {  // the copying path agrees with the view
    std::vector<Index> copy(expected.size());
    REQUIRE(lib.extract_into(key, copy, o) == end - o.start_position);
    REQUIRE(copy == expected);
  }
  return end - o.start_position;
}

/// @brief Where a harness's steps spend their wall time, by phase (seconds, summed over steps). The
/// soak prints it, so a slow run says whether the library, the simulated engine or the check is slow.
struct step_phases {
  double plan    = 0;  ///< the simulated engine schedules the step; requests and prefixes admitted
  double begin   = 0;  ///< library and model begin_step
  double forward = 0;  ///< the router and the capture paths enqueued (on the host backend, run on its worker)
  double end     = 0;  ///< library end_step (sync_copy: waits for the copy and files)
  double sync    = 0;  ///< the engine waits for its stream (the device finishes the step)
  double model   = 0;  ///< the reference model files the step's expected rows
  double outcome = 0;  ///< drafts accepted, requests released and aborted (library and model)
  double check   = 0;  ///< extractions compared with the model
  std::int64_t rows_filed = 0;  ///< plan rows of the steps (what the model files)
  [[nodiscard]] double total() const noexcept { return plan + begin + forward + end + sync + model + outcome + check; }
};

/// @brief Adds the time since the previous lap (or construction) to a phase.
class phase_clock {
 public:
  void lap(double& phase) noexcept
  {
    const auto now = std::chrono::steady_clock::now();
    phase += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
};

/// @brief Runs one randomized schedule; throws doctest failures on the first mismatch.
template <class RR>
class replay_harness {
 public:
  using backend = typename RR::backend_type;
  using index   = typename RR::index_type;
  static constexpr bool slot_storage = std::is_same_v<typename RR::storage_type,
                                                      routing_replay::block_slot_storage>;

  replay_harness(const sim_config& sim, const harness_shape& shape, std::uint64_t seed)
    : sim_cfg_(sim),
      shape_(shape),
      config_(make_replay_config(sim, shape)),
      lib_(config_),
      model_(slot_storage, shape.overwrite, sim.block_size, sim.num_blocks,
             static_cast<std::int64_t>(shape.moe_layers.size()) * shape.top_k),
      engine_(sim, seed),
      rng_(seed * 7919 + 17),
      io_(sim.max_tokens_per_step, shape.top_k + shape.num_fused_shared_experts)
  {
  }

  /// @brief Replaces the per-step forward (the CUDA-graph test replays a recorded one).
  void set_forward(std::function<void(std::int64_t)> forward) { forward_ = std::move(forward); }

  /// @brief Steps the engine until every request is done (or `max_steps`), checking as it goes.
  void run(std::int32_t max_steps = 400)
  {
    run_steps(max_steps);
    finish();
  }

  /// @brief Up to `steps` more steps (fewer if every request is done); returns how many ran.
  std::int64_t run_steps(std::int64_t steps)
  {
    std::int64_t ran = 0;
    for (; ran < steps && !engine_.done(); ++ran) { one_step(); }
    return ran;
  }

  /// @brief Aborts what is still live and checks that nothing is left.
  void finish()
  {
    for (const std::int32_t number : engine_.abort_all()) {
      const auto key = engine_.requests()[static_cast<std::size_t>(number)].key();
      lib_.abort(key);
      model_.remove(key);
    }
    CHECK(lib_.num_requests() == 0);
    CHECK(rows_checked_ > 0);
  }

  /// @brief Records `num_rows` rows of every layer, each layer through a randomly chosen path.
  void forward_layers(std::int64_t num_rows)
  {
    for (std::size_t slot = 0; slot < shape_.moe_layers.size(); ++slot) {
      forward_layer(static_cast<std::int32_t>(slot), random_path(), num_rows);
    }
  }

  /// @brief Records one layer through one path.
  void forward_layer(std::int32_t slot, capture_path path, std::int64_t num_rows)
  {
    const std::int32_t model_layer = shape_.moe_layers[static_cast<std::size_t>(slot)];
    const std::int32_t k           = shape_.top_k;
    const std::int64_t e           = shape_.num_experts;
    const row_meta* meta           = backend::data(io_.meta_dev);
    auto s                         = stream_ref();
    switch (path) {
      case capture_path::capture_int64: capture_through(io_.ids64, slot, model_layer, num_rows); break;
      case capture_path::capture_int32: capture_through(io_.ids32, slot, model_layer, num_rows); break;
      case capture_path::capture_int16: capture_through(io_.ids16, slot, model_layer, num_rows); break;
      case capture_path::layer_view: {
        auto view = lib_.layer_view(model_layer, num_rows);
        backend::bulk_async(num_rows * k, write_layer_view<decltype(view)>{meta, view, k, slot, e}, s);
        break;
      }
      case capture_path::device_ref: {
        auto ref = lib_.ref(num_rows);
        backend::bulk_async(num_rows * k, record_through_ref<decltype(ref)>{meta, ref, k, slot, e}, s);
        break;
      }
    }
  }

  /// @brief The library under test.
  RR& library() noexcept { return lib_; }
  /// @brief The stream every step runs on.
  typename backend::stream_ref stream_ref() noexcept { return io_.stream.ref(); }
  /// @brief Rows compared so far.
  [[nodiscard]] std::int64_t rows_checked() const noexcept { return rows_checked_; }
  /// @brief Where the steps so far spent their time.
  [[nodiscard]] const step_phases& phases() const noexcept { return phases_; }

 private:
  capture_path random_path()
  {
    return static_cast<capture_path>(std::uniform_int_distribution<int>{0, 4}(rng_));
  }

  template <class Vector>
  void capture_through(Vector& ids, std::int32_t slot, std::int32_t model_layer, std::int64_t num_rows)
  {
    capture_router_output<backend>(lib_, ids, backend::data(io_.meta_dev), shape_, slot, model_layer, num_rows, stream_ref());
  }

  void one_step()
  {
    phase_clock clock;
    auto step = engine_.next_step();
    admit_step(lib_, model_, engine_, step);

    const std::int64_t n = step.plan.num_rows();
    std::int64_t padded  = n;
    if (shape_.max_padding > 0) {
      padded = std::min<std::int64_t>(n + std::uniform_int_distribution<std::int64_t>{0, shape_.max_padding}(rng_),
                                      sim_cfg_.max_tokens_per_step);
    }
    if (padded > n && engine_.chance(0.5)) { step.plan.set_padded_rows(padded); }
    for (std::int64_t i = 0; i < padded; ++i) {
      io_.meta_host[static_cast<std::size_t>(i)] =
        i < n ? step.rows[static_cast<std::size_t>(i)] : row_meta{-2, i, -1};  // padding rows
    }
    clock.lap(phases_.plan);
    auto s = stream_ref();
    lib_.begin_step(step.plan, s);
    model_.begin_step(step.plan);
    ++serial_;
    clock.lap(phases_.begin);
    backend::copy_async(backend::data(io_.meta_dev), backend::data(io_.meta_host),
                        static_cast<std::size_t>(padded) * sizeof(row_meta), s);
    if (forward_) {
      forward_(padded);
    } else {
      forward_layers(padded);
    }
    clock.lap(phases_.forward);
    lib_.end_step(s);
    clock.lap(phases_.end);
    backend::synchronize(s);  // the engine reads back its sampled tokens
    clock.lap(phases_.sync);
    model_.file_step(step.plan, serial_, [&](std::int64_t row) { return expected_row(step.rows[static_cast<std::size_t>(row)]); });
    phases_.rows_filed += n;
    clock.lap(phases_.model);

    const auto outcome = engine_.complete_step(step);
    for (const auto& [number, accepted] : outcome.accepts) {
      const auto key = engine_.requests()[static_cast<std::size_t>(number)].key();
      lib_.accept_draft(key, accepted);
      model_.accept_draft(key, accepted);
    }
    for (const std::int32_t number : outcome.finished) {
      const auto key = engine_.requests()[static_cast<std::size_t>(number)].key();
      clock.lap(phases_.outcome);
      compare(key, routing_replay::extract_options{});
      clock.lap(phases_.check);
      lib_.release(key);
      model_.remove(key);
    }
    for (const std::int32_t number : outcome.aborted) {
      const auto key = engine_.requests()[static_cast<std::size_t>(number)].key();
      lib_.abort(key);
      model_.remove(key);
    }
    clock.lap(phases_.outcome);
    if (engine_.chance(0.3)) {  // mid-flight extraction of a live request, from an offset
      const std::int32_t number = engine_.some_running();
      if (number >= 0) {
        const auto key           = engine_.requests()[static_cast<std::size_t>(number)].key();
        const std::int64_t rows  = model_.recorded_rows(key);
        routing_replay::extract_options o;
        o.start_position = engine_.uniform(0, rows);
        o.end_position   = engine_.uniform(o.start_position, rows);
        compare(key, o);
      }
    }
    clock.lap(phases_.check);
  }

  [[nodiscard]] std::vector<index> expected_row(const row_meta& m) const { return routed_row<index>(m, shape_); }

  void compare(routing_replay::request_key key, const routing_replay::extract_options& o)
  {
    rows_checked_ += compare_extraction(lib_, model_, key, o, [&] { return engine_.chance(0.25); });
  }

  sim_config sim_cfg_;
  harness_shape shape_;
  routing_replay::replay_config config_;
  RR lib_;
  reference_model<index> model_;
  engine_sim engine_;
  std::mt19937_64 rng_;
  router_scratch<backend> io_;
  std::function<void(std::int64_t)> forward_;
  std::uint64_t serial_       = 0;
  std::int64_t rows_checked_  = 0;
  step_phases phases_;
};

/// @brief Runs one randomized schedule per seed: seeds divisible by 4 use the contended KV pool
/// (schedule_for_seed), seed 3 runs with overwrite_recomputed_rows.
template <class RR>
void check_randomized_schedules(std::initializer_list<std::uint64_t> seeds)
{
  for (const std::uint64_t seed : seeds) {
    CAPTURE(seed);
    harness_shape shape;
    shape.overwrite = seed == 3;
    replay_harness<RR> harness{schedule_for_seed(seed), shape, seed};
    harness.run();
  }
}

}  // namespace rr_test
