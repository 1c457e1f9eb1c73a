// CUDA consumer: nvcc, CUDA backend. Building it is the test; without a GPU it exits 77 (skipped).
#include <routing_replay/routing_replay.cuh>

#include "one_step.hpp"

int main()
{
  if (!routing_replay::cuda_backend::available()) {
    std::puts("no CUDA device: built, not run");
    return 77;
  }
  return run_one_step<routing_replay::cuda_backend>();
}
