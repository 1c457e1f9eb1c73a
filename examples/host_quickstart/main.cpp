/// @file
/// A first program on the host backend (plain C++20, no GPU, no nvcc): a model of 3 MoE layers,
/// top-2 of 8 experts, runs four engine steps for two requests (a chunked prefill, then decode),
/// extracts one request and reads its routing element by element with rows()(t, l, k).
///
/// Build and run from a configured build of this repository:
///   cmake --build build/demo --target host_quickstart && build/demo/examples/host_quickstart
/// Exit status 0 when every id reads back as the router wrote it.
#include <routing_replay/npy.hpp>
#include <routing_replay/routing_replay.hpp>

#include <cuda/std/array>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <vector>

namespace rr = routing_replay;
using backend = rr::host_backend;

namespace {

constexpr std::int32_t num_experts = 8;
constexpr std::int32_t top_k       = 2;
constexpr std::int32_t max_rows    = 8;  // N_max: the most tokens of one step

/// The synthetic router: the k-th expert of request r at a position in a layer (distinct in k).
std::int32_t router(std::int64_t request, std::int64_t position, std::int32_t layer, std::int32_t k)
{
  return static_cast<std::int32_t>((request * 5 + position * 3 + layer + k) % num_experts);
}

/// One scheduled slice of a step: the request, its first position and how many tokens.
struct scheduled {
  std::int64_t request;
  std::int64_t first_position;
  std::int32_t num_tokens;
};

int run()
{
  rr::replay_config config;
  config.num_experts         = num_experts;
  config.top_k               = top_k;
  config.max_tokens_per_step = max_rows;
  config.max_model_len       = 64;
  config.moe_layers          = {1, 2, 3};  // model layer 0 is dense
  const auto num_layers      = static_cast<std::int32_t>(config.moe_layers.size());

  // The policies spelled out (these are the defaults but for the backend).
  rr::RoutingReplay<backend, std::int16_t, rr::layer_major, rr::sync_copy, rr::per_request_storage> replay{config};

  // Request 1: a 6-token prompt prefilled in two chunks; request 2: a 4-token prompt in one.
  replay.add_request(1, {.prompt_length = 6});
  replay.add_request(2, {.prompt_length = 4});
  const std::vector<std::vector<scheduled>> steps = {
    {{1, 0, 4}, {2, 0, 4}},  // prefill: request 1's first chunk, request 2's whole prompt
    {{1, 4, 2}, {2, 4, 1}},  // request 1's last chunk; request 2 decodes
    {{1, 6, 1}, {2, 5, 1}},  // both decode
    {{1, 7, 1}},             // request 2 finished; request 1 decodes once more
  };

  // What an engine owns: its compute stream, and the router's output on the "device" (for the host
  // backend, host memory that the stream's worker thread reads in stream order). The router here
  // writes each layer's ids on the host into a buffer of its own, copied in stream order as a
  // kernel's output would be; one device buffer serves every layer, since the stream orders each
  // capture's read before the next layer's copy.
  backend::stream stream;
  backend::device_vector<std::int32_t> topk_ids(max_rows * top_k);
  std::vector<backend::pinned_vector<std::int32_t>> router_output(num_layers,
                                                                  backend::pinned_vector<std::int32_t>(max_rows * top_k));

  rr::step_plan plan;  // kept, and cleared every step
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const auto& step = steps[i];
    plan.clear();
    std::printf("step %zu:", i + 1);
    for (const auto& s : step) {
      plan.schedule({.id = s.request, .first_position = s.first_position, .num_tokens = s.num_tokens});
      if (s.num_tokens == 1) {
        std::printf(" request %lld decodes position %lld;", static_cast<long long>(s.request),
                    static_cast<long long>(s.first_position));
      } else {
        std::printf(" request %lld prefills positions %lld-%lld;", static_cast<long long>(s.request),
                    static_cast<long long>(s.first_position),
                    static_cast<long long>(s.first_position + s.num_tokens - 1));
      }
    }
    std::printf(" %lld row%s\n", static_cast<long long>(plan.num_rows()), plan.num_rows() == 1 ? "" : "s");
    replay.begin_step(plan, stream.ref());
    for (std::int32_t l = 0; l < num_layers; ++l) {
      // The "forward": this layer's router writes [num_rows, K] ids, in the plan's row order.
      std::int64_t row = 0;
      for (const auto& s : step) {
        for (std::int64_t p = s.first_position; p < s.first_position + s.num_tokens; ++p, ++row) {
          for (std::int32_t k = 0; k < top_k; ++k) { router_output[l][row * top_k + k] = router(s.request, p, l, k); }
        }
      }
      backend::copy_async(backend::data(topk_ids), backend::data(router_output[l]),
                          static_cast<std::size_t>(row * top_k) * sizeof(std::int32_t), stream.ref());
      replay.capture(config.moe_layers[l], backend::data(topk_ids), plan.num_rows(), stream.ref());
    }
    // sync_copy: end_step waits for the stream, so the router buffers are free again after it
    replay.end_step(stream.ref());  // checks the ids, copies and files the step
  }

  // Request 2 finished after step 3: hand back its routing, then release it.
  {
    const auto routing = replay.extract(2);
    std::printf("request 2: [%lld, %lld, %lld] int16, %zu bytes as .npy; released\n", static_cast<long long>(routing.num_rows()),
                static_cast<long long>(routing.num_layers()), static_cast<long long>(routing.top_k()),
                rr::to_npy(routing).size());
  }
  replay.release(2);

  // Request 1: 8 positions went through the model (6 prompt, 2 generated).
  const auto routing = replay.extract(1);  // a view of the host storage, no copy
  const auto rows    = routing.rows();     // cuda::std::mdspan [T, L, K]
  std::printf("request 1: [%lld, %lld, %lld] int16, %s (%lld prompt rows, %lld generated)\n",
              static_cast<long long>(rows.extent(0)), static_cast<long long>(rows.extent(1)),
              static_cast<long long>(rows.extent(2)), routing.is_view() ? "a view" : "a copy",
              static_cast<long long>(routing.prompt_rows().extent(0)),
              static_cast<long long>(routing.generation_rows().extent(0)));

  // Element access: rows(t, l, k), where l is the capture index (model layer config.moe_layers[l]).
  // Not rows[t, l, k]: libcu++'s mdspan offers operator() for several indices (C++20 has no
  // multidimensional operator[]); rows[cuda::std::array{t, l, k}] is the standard spelling.
  std::int64_t wrong = 0;
  for (std::int64_t t = 0; t < rows.extent(0); ++t) {
    for (std::int32_t l = 0; l < num_layers; ++l) {
      for (std::int32_t k = 0; k < top_k; ++k) {
        wrong += rows(t, l, k) == router(1, routing.first_position() + t, l, k) ? 0 : 1;
      }
    }
  }
  const std::int64_t last = rows.extent(0) - 1;
  const cuda::std::array<std::int64_t, 3> second{last, 0, 1};
  std::printf("request 1, position %lld, model layer %d: experts %d and %d\n",
              static_cast<long long>(routing.first_position() + last), config.moe_layers[0],
              static_cast<int>(rows(last, 0, 0)), static_cast<int>(rows[second]));
  std::printf("%s: %lld ids read with rows(t, l, k)\n", wrong == 0 ? "every id as the router wrote it" : "MISMATCH",
              static_cast<long long>(rows.size()));
  replay.release(1);
  return wrong == 0 ? 0 : 1;
}

}  // namespace

int main()
{
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "host_quickstart: %s\n", e.what());
    return 1;
  }
}
