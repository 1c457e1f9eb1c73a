#!/usr/bin/env bash
# Call 2 of this folder, a fresh machine (carry .deps .baseline .peers; .baseline = ece01a8): more
# alternating rounds of the Python engine loop and the side by side with vLLM PR 39917's capturer
# (h200-2026-11-25-fused/run_gpu.sh builds both packages, then rounds until ROUND_BUDGET_S), call 1
# having met a slow phase in its first round.
# Usage (repository root): OUT=... benchmarks/results/h200-2026-11-26-host-inline/call2.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-build/host_inline_2} ROUND_BUDGET_S=${ROUND_BUDGET_S:-470} \
  SCENARIOS=${SCENARIOS:-decode_B1,decode_B64,decode_B256,decode_B1024,prefill_8k} \
  benchmarks/results/h200-2026-11-25-fused/run_gpu.sh 8
