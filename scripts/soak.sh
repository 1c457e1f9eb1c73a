#!/usr/bin/env bash
# Soak: one RoutingReplay per copy strategy (both storages between them) runs an endless realistic
# engine schedule (chunked prefill, decode, drafts, preemption, prefix hits, aborts) against the
# reference model for STEPS steps in all (default 1000000), every finished request and many live
# ones checked bit-exact; resident memory is sampled and must stay flat after warm-up. Prints one
# JSON line per strategy (steps/s, rows checked, memory after warm-up and at the end, growth).
#
#   scripts/soak.sh [STEPS] [--max-growth-kib K]      host backend, eight combinations (CI runs 100000)
#   scripts/soak.sh [STEPS] --scale [--concurrent]    the same at the CUDA soak's scale (N_max 8192,
#                                                     L 48, K 8) on the host backend
#   scripts/soak.sh [STEPS] --cuda                    CUDA backend at N_max 8192, L 48, K 8 (GPU):
#                                                     STEPS per combination, all eight at once
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/common.sh
steps=${1:-1000000}
shift || true
apt_install cmake ninja-build g++ doctest-dev

# the CI build of the CUDA targets and the short soak (scripts/test.sh), -O1
cmake -S . -B build/ci -G Ninja -DCMAKE_BUILD_TYPE= -DCMAKE_CXX_FLAGS="-O1" -DCMAKE_CUDA_FLAGS="-O1" >/dev/null
if [ "${1:-}" = "--cuda" ]; then
  shift
  cmake --build build/ci -j "$(build_jobs)" --target gpu_tests
  echo "== CUDA soak: ${steps} steps per combination, the eight at once (one thread each)"
  ROUTING_REPLAY_SOAK_STEPS="$steps" build/ci/tests/gpu_tests --no-skip -tc="CUDA concurrent soak*" "$@"
else
  cmake --build build/ci -j "$(build_jobs)" --target soak
  echo "== host soak: ${steps} steps in all"
  build/ci/tests/soak --steps "$steps" "$@"
fi
