// Host-only: the package's headers compile with the host compiler and a replay can be built.
#include <routing_replay/npy.hpp>
#include <routing_replay/routing_replay.hpp>

#include <iostream>

int main()
{
  namespace rr = routing_replay;
  rr::replay_config config;
  config.num_experts         = 8;
  config.top_k               = 2;
  config.max_tokens_per_step = 4;
  config.max_model_len       = 16;
  config.moe_layers          = {0};
  rr::RoutingReplay<rr::host_backend> replay{config};
  replay.add_request("r");
  // Nothing was recorded yet: T = 0 rows, encoded as vLLM's routed_experts field.
  const auto field = rr::to_base64_npy(replay.extract("r"));
  std::cout << "routing-replay: empty request encodes to " << field.size() << " base64 chars\n";
  return field.empty() ? 1 : 0;
}
