#!/usr/bin/env bash
# vLLM 0.33's routed-experts worker connector and routing_replay.vllm on a GPU machine (carry
# .peers: a copy of ../shared/peers): builds the package with its CUDA module, runs the vLLM interop
# tests on both backends with the CUDA cases required (TESTS=0 skips them), then in ROUNDS rounds
# (default 2), every line tagged with its round: the side by side with outputs dropped (every
# scenario) and kept until each request finishes (decode B1 to B1024, prefill 8k), and the PR 39917
# drop-in and Replay (engine_loop.py, eager: prefill 8k with requests kept to the end and finished in
# the next step, decode B64 and B1024; prefill 8k kept to the end with 64 MiB of row memory ahead).
# Files under $OUT (default build/vllm_side_by_side): machine.txt, tests.log, side_by_side.jsonl,
# dropin.jsonl, table.md.
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
if [ "${TESTS:-1}" != 0 ]; then
  ROUTING_REPLAY_REQUIRE_CUDA=1 ROUTING_REPLAY_PEERS="$PWD/.peers" ROUTING_REPLAY_VLLM_TRACES=${TRACES:-480} \
    python3 -m pytest -q -rs -p no:cacheprovider python/tests/test_vllm_differential.py python/tests/test_vllm_upstream.py \
    python/tests/test_vllm_beyond.py python/tests/test_vllm_plugin.py python/tests/test_vllm_kept_outputs.py \
    >"$out/tests.log" 2>&1
  echo "tests exit $? at $(( $(date +%s) - start )) s"; tail -n 3 "$out/tests.log"
fi
tree=$(git rev-parse --short HEAD)
tag() { python3 benchmarks/tag_rounds.py round="$1" tree="$tree"; }
for round in $(seq 1 "${ROUNDS:-2}"); do
  python3 benchmarks/python/vllm_side_by_side.py --device cuda --peers .peers --outputs dropped | tag "$round" >>"$out/side_by_side.jsonl"
  python3 benchmarks/python/vllm_side_by_side.py --device cuda --peers .peers --outputs kept \
    --scenarios decode_B1,decode_B64,decode_B256,decode_B1024,prefill_8k | tag "$round" >>"$out/side_by_side.jsonl"
  for finish in end next; do
    python3 benchmarks/python/engine_loop.py --device cuda --api dropin,replay --modes eager --finish "$finish" \
      --scenarios decode_B64,decode_B1024,prefill_8k | tag "$round" >>"$out/dropin.jsonl"
  done
  # the same growth with the run's row memory (8 steps of 6 MiB) made ahead at start-up: the budget case
  python3 benchmarks/python/engine_loop.py --device cuda --api dropin,replay --modes eager --finish end \
    --host-memory-ahead $((64 << 20)) --scenarios prefill_8k | tag "$round" >>"$out/dropin.jsonl"
  echo "round $round done at $(( $(date +%s) - start )) s"
done
python3 "$here/table.py" "$out/side_by_side.jsonl" "$out/dropin.jsonl" | tee "$out/table.md"
