#!/usr/bin/env bash
# vLLM 0.33's routed-experts worker connector and routing_replay.vllm on a GPU machine (carry
# .peers: a copy of ../shared/peers): builds the package with its CUDA module, runs the vLLM interop
# tests on both backends with the CUDA cases required, then the side by side in ROUNDS rounds
# (default 2), every line tagged with its round. Files under $OUT (default build/vllm_side_by_side):
# machine.txt, tests.log, side_by_side.jsonl, table.md.
# Usage (repository root): OUT=... ROUNDS=2 benchmarks/python/vllm_side_by_side_gpu/run.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/vllm_side_by_side}
here=$(dirname "$0")
mkdir -p "$out"
export PYTHONUNBUFFERED=1
start=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log -1 --format=%H; nproc; } >"$out/machine.txt" 2>&1
site="$PWD/build/python-gpu-site"
if [ "${SKIP_BUILD:-0}" != 1 ] || [ ! -d "$site/routing_replay" ]; then
  rm -rf "$site"
  python3 -m pip install -q --no-build-isolation --no-deps --target "$site" ./python >"$out/build.log" 2>&1 \
    || { tail -n 40 "$out/build.log"; exit 1; }
  echo "package built in $(( $(date +%s) - start )) s"
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
ROUTING_REPLAY_REQUIRE_CUDA=1 ROUTING_REPLAY_PEERS="$PWD/.peers" ROUTING_REPLAY_VLLM_TRACES=${TRACES:-480} \
  python3 -m pytest -q -rs -p no:cacheprovider python/tests/test_vllm_differential.py python/tests/test_vllm_upstream.py \
  python/tests/test_vllm_beyond.py python/tests/test_vllm_plugin.py >"$out/tests.log" 2>&1
echo "tests exit $? at $(( $(date +%s) - start )) s"; tail -n 3 "$out/tests.log"
for round in $(seq 1 "${ROUNDS:-2}"); do
  python3 benchmarks/python/vllm_side_by_side.py --device cuda --peers .peers \
    | python3 benchmarks/tag_rounds.py round="$round" tree="$(git rev-parse --short HEAD)" >>"$out/side_by_side.jsonl"
  echo "round $round done at $(( $(date +%s) - start )) s"
done
python3 "$here/table.py" "$out/side_by_side.jsonl" | tee "$out/table.md"
