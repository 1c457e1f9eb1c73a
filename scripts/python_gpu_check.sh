#!/usr/bin/env bash
# The Python package on a GPU machine (torch, transformers, numpy, nanobind, scikit-build-core,
# pytest, matplotlib and CUDA 13 with nvcc installed; no internet needed): builds both modules
# with the image's build tools (--no-build-isolation), then runs the whole suite with the CUDA cases
# required (a skipped CUDA case fails the run), then example (a) on the GPU.
# Usage: scripts/python_gpu_check.sh [extra pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/common.sh
venv=build/python-gpu-venv
rm -rf "$venv"
python3 -m venv --system-site-packages "$venv"  # the image's torch, transformers, nanobind...
start=$(date +%s)
"$venv/bin/pip" install -q --no-build-isolation --no-deps ./python
echo "== built and installed in $(( $(date +%s) - start )) s"
"$venv/bin/python" -m routing_replay
ROUTING_REPLAY_REQUIRE_CUDA=1 "$venv/bin/python" -m pytest -rs -p no:cacheprovider python/tests "$@"
echo "== example (a): a random Qwen3-MoE through transformers, on the GPU"
"$venv/bin/python" examples/python/hf_qwen3_moe.py --device cuda --out build/hf_qwen3_moe_out
