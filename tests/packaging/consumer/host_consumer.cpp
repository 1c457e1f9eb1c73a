// Host-only consumer: plain C++20 (g++), host backend.
#include "one_step.hpp"

int main() { return run_one_step<routing_replay::host_backend>(); }
