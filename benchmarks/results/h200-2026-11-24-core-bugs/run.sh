#!/usr/bin/env bash
# begin_step/end_step host cost (host backend), 6fc67ee vs this tree, alternating rounds
set -u
cd "$(dirname "$0")"
cuda=$(dirname "$(dirname "$(command -v nvcc)")")
cc="g++ -std=c++20 -O3 -DNDEBUG -pthread -I$cuda/include/cccl -isystem $cuda/include"
$cc -Iinclude_base -I. begin_probe.cpp -o probe_base &
$cc -I../../include -I../../benchmarks begin_probe.cpp -o probe_head &
wait
for i in 1 2 3 4; do
  ./probe_base | sed 's/^{/{"tree":"6fc67ee",/'
  ./probe_head | sed 's/^{/{"tree":"head",/'
done
