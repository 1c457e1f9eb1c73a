/// @file
/// engine_loop on the host backend, layer_major half (g++; the other layout builds in parallel).
#include "engine_loop.hpp"

int rr_bench::run_host_layer_major(const loop_options& o)
{
  return run_layout<host_platform, rr::layer_major>(o);
}
