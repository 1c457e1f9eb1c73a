// Must not compile: device_scatter writes rows in place from a kernel, and per-request storage
// moves rows when it grows. CTest builds this and expects the library's explanation.
#include <routing_replay/routing_replay.hpp>

int main()
{
  namespace rr = routing_replay;
  rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major, rr::device_scatter<2>,
                    rr::per_request_storage>
    replay{rr::replay_config{}};
  return static_cast<int>(replay.num_layers());
}
