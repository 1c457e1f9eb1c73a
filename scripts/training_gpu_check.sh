#!/usr/bin/env bash
# The trainer hand-off (docs/training.md) on a GPU machine: megatron-core from the wheels in .whl/
# (scripts/stage_training_wheels.sh) into /tmp/site, the package as scripts/python_gpu_check.sh
# built it into build/python-gpu-site (nothing is built here), then
#   1. the training tests: numpy layouts, transformers routers, megatron-core's RouterReplay with a
#      whole forward on CUDA (a skipped case fails the run);
#   2. examples/python/r3_closed_loop.py on the GPU (output in build/r3_closed_loop_out).
# Prints one PASS/FAIL line for each; exit status 0 when both pass. About a minute on an H200.
# Usage: scripts/training_gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
site="$PWD/build/python-gpu-site"
if [ ! -d "$site/routing_replay" ]; then
  echo "FAIL: no routing_replay in $site: run scripts/python_gpu_check.sh first"; exit 2
fi
if ! ls .whl/megatron_core-*.whl >/dev/null 2>&1; then
  echo "FAIL: no megatron_core wheel in .whl/: run scripts/stage_training_wheels.sh where pip can reach PyPI"; exit 2
fi
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="$site:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
status=0
start=$(date +%s)
log=build/training_gpu_tests.log
python3 -m pytest -q -rs -p no:cacheprovider python/tests/test_training.py python/tests/test_training_hf.py \
  python/tests/test_training_megatron.py 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
summary=$(tail -n 1 "$log")
if [ "$rc" -eq 0 ] && ! grep -q skipped <<<"$summary"; then
  echo "PASS training tests (megatron-core $(python3 -c 'import megatron.core as m; print(m.__version__)'), CUDA forward included): $summary ($(( $(date +%s) - start )) s)"
else
  echo "FAIL training tests (rc $rc; a skip counts as a failure here): $summary"; status=1
fi
start=$(date +%s)
if python3 examples/python/r3_closed_loop.py --device cuda --out build/r3_closed_loop_out; then
  echo "PASS r3_closed_loop on the GPU ($(( $(date +%s) - start )) s; build/r3_closed_loop_out/summary.json)"
else
  echo "FAIL r3_closed_loop on the GPU (rc $?)"; status=1
fi
exit $status
