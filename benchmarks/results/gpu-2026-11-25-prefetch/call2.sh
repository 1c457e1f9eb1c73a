#!/usr/bin/env bash
# The stop's checks and A/B on one GPU call (carry .deps .baseline; .baseline staged with
# scripts/stage_baseline.sh 44e1e0a): h100-2026-11-25-lazy/final_call.sh with a 300 s budget for
# the C++ rounds and no begin_probe part (the package builds while scripts/gpu_check.sh runs; the
# C++ engine-loop rounds, head against .baseline; then scripts/python_gpu_check.sh).
# Usage (repository root): OUT=... benchmarks/results/gpu-2026-11-25-prefetch/call2.sh
cd "$(dirname "$0")/../../.."
ROUND_BUDGET_S=${ROUND_BUDGET_S:-300} PROBE_AFTER_S=0 exec benchmarks/results/h100-2026-11-25-lazy/final_call.sh
