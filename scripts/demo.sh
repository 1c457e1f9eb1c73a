#!/usr/bin/env bash
# Builds and runs the demo: a synthetic engine (L = 48, K = 8, E = 128) whose routing the library
# captures; one .npy per request. Runs on CUDA when a GPU is present, on the host backend otherwise.
# Installs what it and the check of its files need (cmake, ninja, g++; numpy, for
# examples/engine_loop/verify_npy.py). build/demo then also builds the host example:
# cmake --build build/demo --target host_quickstart.
# Usage: scripts/demo.sh [engine_loop flags, e.g. --out DIR --storage block_slot]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/common.sh
apt_install cmake ninja-build g++
pip_install numpy numpy  # for verify_npy.py, the check of the demo's files
cmake -S . -B build/demo -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DROUTING_REPLAY_BUILD_TESTS=OFF -DROUTING_REPLAY_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build build/demo --target engine_loop -j "$(build_jobs)"
exec build/demo/examples/engine_loop --out build/routing_out "$@"
