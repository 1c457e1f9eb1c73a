#!/usr/bin/env bash
# The Python package on a GPU machine whose python3 has torch, transformers, numpy, nanobind,
# scikit-build-core, pytest and matplotlib, with CUDA 13 (nvcc) and CMake >= 3.25; no internet
# needed. Builds both modules, every policy combination ahead of time, with the environment's
# build tools (--no-build-isolation) into build/python-gpu-site (the environment itself is left
# alone), then runs the whole suite with the CUDA cases required (a skipped CUDA case fails the
# run), then example (a) on the GPU.
# Usage: scripts/python_gpu_check.sh [extra pytest arguments]
# PY_GPU_SKIP_BUILD=1 tests the package scripts/python_gpu_bench.sh built there instead of
# building it again.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/common.sh
site="$PWD/build/python-gpu-site"
if [ "${PY_GPU_SKIP_BUILD:-0}" = 1 ] && [ -d "$site/routing_replay" ]; then
  echo "== testing the package already built in $site"
else
  rm -rf "$site"
  start=$(date +%s)
  # every combination ahead of time: the suite runs all 64 on both backends (a default build would
  # compile the other 56 on first use, on the GPU machine's cores; test_jit.py tests that path)
  python3 -m pip install -q --no-build-isolation --no-deps --target "$site" ./python \
    -C cmake.define.ROUTING_REPLAY_PYTHON_ALL_COMBINATIONS=ON
  echo "== built and installed in $(( $(date +%s) - start )) s"
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
python3 -m routing_replay
ROUTING_REPLAY_REQUIRE_CUDA=1 python3 -m pytest -rs -p no:cacheprovider python/tests "$@"
echo "== example (a): a random Qwen3-MoE through transformers, on the GPU"
python3 examples/python/hf_qwen3_moe.py --device cuda --out build/hf_qwen3_moe_out
