#!/usr/bin/env bash
# Block-slot begin_step at decode B1024 (host backend) against the floor of its memory accesses
# (block_slot_floor_probe.cpp), the staged baseline (.baseline/, scripts/stage_baseline.sh) against
# this tree, alternating rounds. Prints JSON lines tagged with the tree.
# Usage: benchmarks/results/h200-2026-11-25-floors/run_probe.sh [rounds]
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
cuda=$(dirname "$(dirname "$(command -v nvcc)")")
cc="g++ -std=c++20 -O3 -DNDEBUG -pthread -I$cuda/include/cccl -isystem $cuda/include -I$root/benchmarks"
tmp=$(mktemp -d)
$cc -I"$root/.baseline/include" "$here/block_slot_floor_probe.cpp" -o "$tmp/probe_base" &
$cc -I"$root/include" "$here/block_slot_floor_probe.cpp" -o "$tmp/probe_head" &
wait
base=$(cat "$root/.baseline/REVISION" 2>/dev/null || echo baseline)
for i in $(seq "${1:-4}"); do
  "$tmp/probe_base" | sed "s/^{/{\"tree\":\"$base\",\"round\":$i,/"
  "$tmp/probe_head" | sed "s/^{/{\"tree\":\"head\",\"round\":$i,/"
done
rm -rf "$tmp"
