/// @file
/// engine_loop on CUDA, token_major half (the other layout builds in parallel).
#include "engine_loop_cuda.cuh"

int rr_bench::run_cuda_token_major(const loop_options& o)
{
  return run_layout<cuda_platform, rr::token_major>(o);
}
