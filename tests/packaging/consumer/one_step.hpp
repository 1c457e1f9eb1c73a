// What both consumer translation units run: one engine step of a two-layer, top-2 model through
// RoutingReplay<Backend>, then a check that the request's routing reads back exactly.
#pragma once

#include <routing_replay/routing_replay.hpp>

#include <cstdint>
#include <cstdio>
#include <vector>

template <class Backend>
int run_one_step()
{
  namespace rr = routing_replay;
  rr::replay_config config;
  config.num_experts         = 8;
  config.top_k               = 2;
  config.max_tokens_per_step = 4;
  config.max_model_len       = 16;
  config.moe_layers          = {0, 1};
  rr::RoutingReplay<Backend> replay{config};

  // Router output of one layer: 3 tokens, top-2 ids each, the same for both layers.
  const std::vector<std::int32_t> ids = {1, 2, 3, 4, 5, 6};
  typename Backend::template pinned_vector<std::int32_t> staging(ids.begin(), ids.end());
  typename Backend::template device_vector<std::int32_t> topk(ids.size());
  typename Backend::stream stream;

  replay.add_request("r", {.prompt_length = 3});
  rr::step_plan plan;
  plan.schedule({.id = "r", .first_position = 0, .num_tokens = 3});
  replay.begin_step(plan, stream.ref());
  Backend::copy_async(Backend::data(topk), Backend::data(staging), ids.size() * sizeof(ids[0]),
                      stream.ref());
  for (int layer : config.moe_layers) { replay.capture(layer, Backend::data(topk), 3, stream.ref()); }
  replay.end_step(stream.ref());
  Backend::synchronize(stream.ref());

  // [T = 3, L = 2, K = 2]: each token's two ids, once per layer.
  const auto routing = replay.extract("r");
  const std::vector<std::int16_t> expected = {1, 2, 1, 2, 3, 4, 3, 4, 5, 6, 5, 6};
  const bool ok = std::vector<std::int16_t>(routing.flat().begin(), routing.flat().end()) == expected;
  std::printf("%s backend: %s\n", Backend::name, ok ? "ok" : "MISMATCH");
  return ok ? 0 : 1;
}
