/// @file
/// The synthetic engine loop behind benchmarks/engine_loop, generic over a "platform" (the host
/// backend, or CUDA with device timers, CUDA graphs and a stand-in GEMM) so that one definition
/// compiles with g++ (engine_loop_main.cpp) and with nvcc (engine_loop_cuda_*.cu).
///
/// A platform provides: `backend`; `has_device_timing`, `has_graphs`; `timer` (start/stop on a
/// stream, elapsed_us() after the stream is synchronized, std::nullopt without device timing);
/// `graph` (constructed from a stream and a recording callable, launch(stream)); `gemm`
/// (constructed from hidden size and max rows; run(rows, stream)).
#pragma once

#include "../examples/common/synthetic_engine.hpp"
#include "engine_loop_results.hpp"
#include "engine_loop_scenarios.hpp"
#include "policies.hpp"

#include <routing_replay/routing_replay.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace rr_bench {

// ---- the synthetic model ------------------------------------------------------------------------

using rr_example::synthetic_id;
using rr_example::synthetic_router;
using rr_example::token_info;

/// @brief The router of capture path (c): writes its top-k ids as synthetic_router does and records
/// each one through the library's device reference in the same kernel (layer slot = layer).
template <class Ref>
struct recording_router {
  synthetic_router router;
  Ref ref;

  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t i) const noexcept
  {
    router(i);
    const auto row = static_cast<std::int32_t>(i / router.topk);
    const auto k   = static_cast<std::int32_t>(i % router.topk);
    ref.record(router.layer, row, k, router.topk_ids[i]);
  }
};

/// @brief Microseconds between two steady_clock readings.
inline double micros(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b)
{
  return std::chrono::duration<double, std::micro>(b - a).count();
}

/// @brief Rows a CUDA graph is recorded for: the next power of two, at most N_max (engines record
/// one graph per padded batch size and pad the batch up to it).
inline std::int64_t graph_bucket(std::int64_t rows, std::int64_t max_rows)
{
  std::int64_t b = 1;
  while (b < rows) { b *= 2; }
  return std::min(b, max_rows);
}

/// @brief Whether an extraction holds exactly the synthetic ids of `request`, positions
/// [0, expected_rows).
template <class Index>
bool extraction_matches(const rr::routed_experts<Index>& routed,
                        std::int64_t request,
                        std::int64_t expected_rows,
                        const loop_options& o)
{
  if (routed.num_rows() != expected_rows || routed.first_position() != 0 ||
      routed.num_layers() != o.layers || routed.top_k() != o.topk) {
    return false;
  }
  const Index* p = routed.flat().data();
  for (std::int64_t t = 0; t < expected_rows; ++t) {
    for (std::int32_t l = 0; l < o.layers; ++l) {
      for (std::int32_t k = 0; k < o.topk; ++k, ++p) {
        if (*p != static_cast<Index>(synthetic_id(request, t, l, k, o.experts))) { return false; }
      }
    }
  }
  return true;
}

// ---- one scenario with one policy ---------------------------------------------------------------

/// @brief Runs one scenario with one instantiation of the policies, eagerly or with the measured
/// steps replayed from CUDA graphs, and returns the medians.
///
/// Every measured step runs twice on the same rows: first without the library (the forward's
/// routers only: fwd0_gpu_us, step0_us), then with it (begin_step, capture per layer, end_step:
/// host_us, fwd_gpu_us, step_us). Each ends with a synchronize of the compute stream, standing for
/// the engine's readback of its sampled tokens.
template <class Platform, class Index, class Layout, class Copy, class Storage>
loop_result run_scenario(const loop_options& o, const scenario& s, bool graph_mode)
{
  using backend     = typename Platform::backend;
  using replay_type = rr::RoutingReplay<backend, Index, Layout, Copy, Storage>;
  using clock       = std::chrono::steady_clock;
  constexpr std::int64_t block_size = 16;

  loop_result result;
  result.policy   = policy_name<Index, Layout, Copy, Storage>();
  result.scenario = s.name;
  result.mode     = graph_mode ? "graph" : "eager";

  const std::int64_t blocks_per_request = (s.expected_rows + block_size - 1) / block_size;
  rr::replay_config config;
  config.num_experts         = o.experts;
  config.top_k               = o.topk;
  config.max_tokens_per_step = o.max_tokens;
  config.max_model_len       = o.max_model_len;
  config.moe_layers.resize(static_cast<std::size_t>(o.layers));
  std::iota(config.moe_layers.begin(), config.moe_layers.end(), 0);
  config.block_size = static_cast<std::int32_t>(block_size);
  config.num_blocks = s.num_requests * blocks_per_request;  // every request's KV at once
  config.host_memory_ahead = o.host_memory_ahead;
  replay_type replay{config};
  replay.wait_for_host_memory_ahead();  // as an engine at start-up: its first steps find memory ready

  const auto max_rows = static_cast<std::size_t>(o.max_tokens);
  typename backend::template pinned_vector<token_info> staging(max_rows);
  typename backend::template device_vector<token_info> tokens(max_rows);
  typename backend::template device_vector<std::int64_t> ids(max_rows * static_cast<std::size_t>(o.topk));
  token_info* staged        = backend::data(staging);
  token_info* tokens_device = backend::data(tokens);
  std::int64_t* ids_device  = backend::data(ids);
  typename Platform::gemm gemm{o.hidden, o.max_tokens};
  typename Platform::timer timer;
  // declared after every buffer its work touches, so that it is drained before they go
  typename backend::stream stream;
  const auto compute = stream.ref();

  // The forward of `rows` rows: token metadata up, then per layer the router [, the GEMM] and,
  // with the library, capture() or the router recording its choices itself.
  const bool record_in_router = o.capture_path == "record";
  auto forward = [&](std::int64_t rows, bool with_capture) {
    backend::copy_async(tokens_device, staged, static_cast<std::size_t>(rows) * sizeof(token_info), compute);
    for (std::int32_t layer = 0; layer < o.layers; ++layer) {
      const synthetic_router router{tokens_device, ids_device, layer, o.topk, o.experts};
      if (with_capture && record_in_router) {
        backend::bulk_async(rows * o.topk, recording_router<typename replay_type::ref_type>{router, replay.ref(rows)},
                            compute);
      } else {
        backend::bulk_async(rows * o.topk, router, compute);
      }
      gemm.run(rows, compute);
      if (with_capture && !record_in_router) { replay.capture(layer, ids_device, rows, compute); }
    }
  };

  // Graph mode: one pair of graphs (with and without the library) per padded row bucket of the
  // measured steps, recorded up front, outside any step (as engines do at start-up).
  struct graph_pair {
    std::unique_ptr<typename Platform::graph> with, without;
  };
  std::map<std::int64_t, graph_pair> graphs;
  if constexpr (Platform::has_graphs) {
    if (graph_mode) {
      for (const auto& step : s.steps) {
        const std::int64_t bucket = graph_bucket(step.rows, o.max_tokens);
        if (!step.measured || graphs.contains(bucket)) { continue; }
        forward(bucket, false);  // loads the forward's kernels before any capture begins
        backend::synchronize(compute);
        auto& g   = graphs[bucket];
        g.without = std::make_unique<typename Platform::graph>(compute, [&] { forward(bucket, false); });
        g.with    = std::make_unique<typename Platform::graph>(compute, [&] { forward(bucket, true); });
      }
    }
  }

  std::vector<double> host_us, fwd_us, fwd0_us, step_us, step0_us, eos_us, begin_us, overhead_us;
  typename Platform::timer end_of_step_timer;
  typename Platform::stream_gate gate;
  rr::step_plan plan;
  std::vector<std::int64_t> slots;
  std::vector<std::int64_t> fresh;
  std::vector<bool> admitted(static_cast<std::size_t>(s.num_requests), false);
  std::vector<rr::request_handle> handles(static_cast<std::size_t>(s.num_requests));
  auto slot_of = [&](std::int64_t request, std::int64_t position) {
    return (request * blocks_per_request + position / block_size) * block_size + position % block_size;
  };

  for (const auto& step : s.steps) {
    const bool use_graph = graph_mode && step.measured;
    const std::int64_t n = step.rows;
    const std::int64_t padded = use_graph ? graph_bucket(n, o.max_tokens) : n;
    // the engine's inputs for this step (padding rows repeat the first token, as padded batches do)
    std::int64_t row = 0;
    for (const auto& run : step.runs) {
      for (std::int32_t i = 0; i < run.num_tokens; ++i) { staged[row++] = {run.request, run.first_position + i}; }
    }
    for (; row < padded; ++row) { staged[row] = staged[0]; }

    if (step.measured) {  // the same step without the library
      const auto t0 = clock::now();
      timer.start(compute);
      if (use_graph) {
        graphs.at(padded).without->launch(compute);
      } else {
        forward(n, false);
      }
      timer.stop(compute);
      backend::synchronize(compute);
      step0_us.push_back(micros(t0, clock::now()));
      if (auto t = timer.elapsed_us()) { fwd0_us.push_back(*t); }
    }

    const auto t0 = clock::now();
    double library_before_forward_us = 0;
    plan.clear();
    slots.clear();
    fresh.clear();
    slots.reserve(static_cast<std::size_t>(n));  // the plan keeps spans into it: no reallocation
    for (const auto& run : step.runs) {
      if (!admitted[static_cast<std::size_t>(run.request)]) {
        const auto a0 = clock::now();
        handles[static_cast<std::size_t>(run.request)] = replay.add_request(run.request, {.prompt_length = s.prompt_length});
        library_before_forward_us += micros(a0, clock::now());
        admitted[static_cast<std::size_t>(run.request)] = true;
      }
      const std::size_t first = slots.size();
      for (std::int32_t i = 0; i < run.num_tokens; ++i) {
        const std::int64_t p = run.first_position + i;
        if (p % block_size == 0) { fresh.push_back(slot_of(run.request, p) / block_size); }
        slots.push_back(slot_of(run.request, p));
      }
      plan.schedule({.id               = handles[static_cast<std::size_t>(run.request)],  // no hashing per step
                     .first_position   = run.first_position,
                     .num_tokens       = run.num_tokens,
                     .num_draft_tokens = 0,
                     .slots            = std::span<const std::int64_t>{slots}.subspan(first)});
    }
    plan.add_fresh_blocks(fresh);
    if (use_graph) { plan.set_padded_rows(padded); }
    const auto b0 = clock::now();
    replay.begin_step(plan, compute);
    library_before_forward_us += micros(b0, clock::now());
    timer.start(compute);
    if (use_graph) {
      graphs.at(padded).with->launch(compute);
    } else {
      forward(n, true);
    }
    timer.stop(compute);
    if (o.sync_forward) { backend::synchronize(compute); }
    // With a side stream, end_step() never waits for the compute stream: hold the stream shut
    // while it enqueues, so eos_gpu_us is the end-of-step work alone (sync_copy waits for its own
    // copy, so its reading also holds the host's enqueue gaps).
    constexpr bool gated = replay_type::copy_type::uses_side_stream;
    if constexpr (gated) { gate.close(compute); }
    end_of_step_timer.start(compute);  // the timer's event records stay outside host_us
    const auto h0 = clock::now();
    replay.end_step(compute);
    const auto h1 = clock::now();
    end_of_step_timer.stop(compute);
    if constexpr (gated) { gate.open(); }
    backend::synchronize(compute);  // stands for the readback of the sampled tokens
    if (step.measured) {
      step_us.push_back(micros(t0, clock::now()));
      overhead_us.push_back(step_us.back() - step0_us.back());
      begin_us.push_back(library_before_forward_us);
      host_us.push_back(micros(h0, h1));
      if (auto t = timer.elapsed_us()) { fwd_us.push_back(*t); }
      if (auto t = end_of_step_timer.elapsed_us()) { eos_us.push_back(*t); }
    }
  }

  // Every request has finished: extract each one (timed), check it, release it.
  replay.drain();
  std::vector<double> extract_us;
  bool correct = true;
  for (std::int64_t r = 0; r < s.num_requests; ++r) {
    const auto t0    = clock::now();
    const auto rows  = replay.extract(r);
    const auto t1    = clock::now();
    extract_us.push_back(micros(t0, t1));
    correct = correct && extraction_matches(rows, r, s.expected_rows, o);
    replay.release(r);
  }
  backend::synchronize(compute);

  result.host_us     = median(host_us);
  result.fwd_gpu_us  = median(fwd_us);
  result.fwd0_gpu_us = median(fwd0_us);
  result.step_us     = median(step_us);
  result.step0_us    = median(step0_us);
  result.extract_us  = median(extract_us);
  result.eos_gpu_us  = median(eos_us);
  result.begin_us    = median(begin_us);
  result.overhead_us = median(overhead_us);
  result.correct     = correct;
  return result;
}

// ---- dispatch -----------------------------------------------------------------------------------

/// @brief Runs every selected (index, copy, storage, scenario, mode) for one layout; prints one
/// JSON line per run. Returns how many runs were not correct.
template <class Platform, class Layout>
int run_layout(const loop_options& o)
{
  if (!selected(o.layouts, name_of<Layout>())) { return 0; }
  std::vector<scenario> scenarios;
  for (const auto& name : o.scenarios) { scenarios.push_back(make_scenario(name, o)); }
  int incorrect = 0;
  for_each_type(index_types{}, [&](auto index) {
    using Index = typename decltype(index)::type;
    if (!selected(o.indexes, name_of<Index>())) { return; }
    for_each_type(copy_types{}, [&](auto copy) {
      using Copy = typename decltype(copy)::type;
      if (!selected(o.copies, name_of<Copy>())) { return; }
      for_each_type(storage_types{}, [&](auto storage) {
        using Storage = typename decltype(storage)::type;
        if (!selected(o.storages, name_of<Storage>())) { return; }
        for (const auto& s : scenarios) {
          for (const bool graph_mode : {false, true}) {
            if (!(graph_mode ? o.graph && Platform::has_graphs : o.eager)) { continue; }
            const auto r = run_scenario<Platform, Index, Layout, Copy, Storage>(o, s, graph_mode);
            print_json_line(r, o);
            incorrect += r.correct ? 0 : 1;
          }
        }
      });
    });
  });
  return incorrect;
}

// ---- entry points, one translation unit each (engine_loop_{host,cuda}_*.{cpp,cu}) -------------

/// @brief Runs the selected policies with layer_major / token_major on the host backend (g++).
int run_host_layer_major(const loop_options& o);
int run_host_token_major(const loop_options& o);  ///< @copydoc run_host_layer_major
/// @brief Runs the selected policies with layer_major / token_major on CUDA (nvcc).
int run_cuda_layer_major(const loop_options& o);
int run_cuda_token_major(const loop_options& o);  ///< @copydoc run_cuda_layer_major
/// @brief Whether a usable CUDA device is present; `description` names it, or says why not.
bool cuda_device_available(std::string& description);

// ---- the host platform --------------------------------------------------------------------------

/// @brief The host backend: no device timing, no graphs, no GEMM.
struct host_platform {
  using backend = rr::host_backend;
  static constexpr bool has_device_timing = false;
  static constexpr bool has_graphs        = false;

  /// @brief Nothing to hold shut: there is no device timing.
  struct stream_gate {
    void close(rr::host_stream_ref) {}
    void open() {}
  };
  /// @brief Device timing does not exist here: every reading is null.
  struct timer {
    void start(rr::host_stream_ref) {}
    void stop(rr::host_stream_ref) {}
    [[nodiscard]] std::optional<double> elapsed_us() const { return std::nullopt; }
  };
  /// @brief Never constructed (has_graphs is false).
  struct graph {
    template <class F>
    graph(rr::host_stream_ref, F&&)
    {
      throw std::logic_error{"the host backend records no graphs"};
    }
    void launch(rr::host_stream_ref) {}
  };
  /// @brief The stand-in GEMM is CUDA only; the command line refuses --hidden on the host.
  struct gemm {
    gemm(std::int32_t hidden, std::int32_t)
    {
      if (hidden != 0) { throw usage_error{"--hidden needs --backend cuda"}; }
    }
    void run(std::int64_t, rr::host_stream_ref) {}
  };
};

}  // namespace rr_bench

