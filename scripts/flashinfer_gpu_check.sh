#!/usr/bin/env bash
# FlashInfer's fused_topk_deepseek writing routing into the library's views
# (python/tests/test_flashinfer.py), on a GPU machine without internet whose python3 has torch with
# CUDA 13, nanobind, scikit-build-core, pytest and ninja, with nvcc and CMake >= 3.25:
#   1. unpacks .flashinfer/flashinfer-site.tar.gz (scripts/stage_flashinfer.sh: FlashInfer 0.7.2.post1
#      trimmed to what this kernel's JIT build reads, and apache-tvm-ffi) into build/flashinfer-site;
#   2. builds the package (host and CUDA modules) for the int16 index type only, all that the test
#      uses, into build/flashinfer-gpu-site (build folder build/flashinfer-gpu-build), while FlashInfer
#      JIT-compiles fused_topk_deepseek's module (dsv3_fused_routing, for this GPU's architecture)
#      into build/flashinfer-jit; both are kept for the next run on a machine that stays warm;
#   3. runs the test with -v, the CUDA and FlashInfer cases required (a skip fails the run).
# Writes build.log, jit.log, pytest.log and summary.txt to $OUT where it is set (a device machine's
# output folder), else to build/flashinfer-gpu-logs. Prints one PASS/FAIL line per part; exit
# status 0 when all pass. About two minutes on an H200 machine from a bare checkout.
# Usage: scripts/flashinfer_gpu_check.sh [extra pytest arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/common.sh
logs="${OUT:-$PWD/build/flashinfer-gpu-logs}"
mkdir -p "$logs"
summary="$logs/summary.txt"
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }
archive=.flashinfer/flashinfer-site.tar.gz
if [ ! -f "$archive" ]; then
  say "FAIL: no $archive: run scripts/stage_flashinfer.sh where pip reaches PyPI, and carry .flashinfer"; exit 2
fi
fi_site="$PWD/build/flashinfer-site"
rr_site="$PWD/build/flashinfer-gpu-site"
rm -rf "$fi_site" && mkdir -p "$fi_site" && tar -xzf "$archive" -C "$fi_site"

# FlashInfer's JIT: its workspace (the built module lands in
# $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/<version>/<arch>/cached_ops/) and tvm-ffi's cache in
# the checkout, not in $HOME; this GPU's architecture (9.0 on an H200: sm_90a); ninja from the
# interpreter's folder (the ninja package) where PATH has none; nvcc jobs for the cores.
export FLASHINFER_WORKSPACE_BASE="$PWD/build/flashinfer-jit"
export TVM_FFI_CACHE_DIR="$PWD/build/flashinfer-jit/tvm-ffi"
FLASHINFER_CUDA_ARCH_LIST=$(python3 -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())') || {
  say "FAIL: torch sees no CUDA device"; exit 2; }
export FLASHINFER_CUDA_ARCH_LIST
export PATH="$PATH:$(dirname "$(python3 -c 'import sys; print(sys.executable)')")"
export MAX_JOBS="$(build_jobs)"

python3 -c 'import torch; print(f"== {torch.cuda.get_device_name()}, torch {torch.__version__}")' | tee -a "$summary"
start=$(date +%s)
(
  rm -rf "$rr_site"
  python3 -m pip install -q --no-build-isolation --no-deps --target "$rr_site" ./python \
    -C build-dir="$PWD/build/flashinfer-gpu-build" -C cmake.define.ROUTING_REPLAY_PYTHON_INDEX_TYPES=int16
) >"$logs/build.log" 2>&1 &
build_pid=$!
PYTHONPATH="$fi_site" python3 -c '
import time
start = time.time()
import flashinfer
from flashinfer.fused_moe.fused_routing_dsv3 import get_dsv3_fused_routing_module
from flashinfer.jit import gen_dsv3_fused_routing_module
get_dsv3_fused_routing_module()
print(f"flashinfer {flashinfer.__version__}: {gen_dsv3_fused_routing_module().jit_library_path} "
      f"ready in {time.time() - start:.0f} s")
' >"$logs/jit.log" 2>&1 &
jit_pid=$!
wait "$build_pid"; build_rc=$?
wait "$jit_pid"; jit_rc=$?
status=0
if [ "$build_rc" -eq 0 ]; then
  say "PASS build: routing_replay (int16) in $rr_site, $(( $(date +%s) - start )) s with the JIT beside it"
else
  say "FAIL build (rc $build_rc): tail of $logs/build.log:"; tail -n 30 "$logs/build.log"; status=1
fi
if [ "$jit_rc" -eq 0 ]; then
  say "PASS jit: $(tail -n 1 "$logs/jit.log")"
else
  say "FAIL jit (rc $jit_rc): tail of $logs/jit.log:"; tail -n 30 "$logs/jit.log"; status=1
fi
[ "$status" -eq 0 ] || exit "$status"

start=$(date +%s)
PYTHONPATH="$rr_site:$fi_site" ROUTING_REPLAY_REQUIRE_CUDA=1 ROUTING_REPLAY_REQUIRE_FLASHINFER=1 \
  python3 -m pytest -v -rs -p no:cacheprovider python/tests/test_flashinfer.py "$@" 2>&1 | tee "$logs/pytest.log"
rc=${PIPESTATUS[0]}
count() { grep -cE "::test_[a-z_]+\[[^]]*$1[^]]*\] $2" "$logs/pytest.log"; }
kernel="$(count flashinfer-cuda PASSED) passed, $(count flashinfer-cuda FAILED) failed, $(count flashinfer-cuda SKIPPED) skipped"
host="$(count reference-host PASSED) passed, $(count reference-host FAILED) failed"
line="FlashInfer kernel cases (flashinfer-cuda): $kernel; host reference cases: $host; $(tail -n 1 "$logs/pytest.log")"
if [ "$rc" -eq 0 ] && [ "$(count flashinfer-cuda PASSED)" -gt 0 ] && [ "$(count flashinfer-cuda SKIPPED)" -eq 0 ]; then
  say "PASS test_flashinfer.py ($(( $(date +%s) - start )) s): $line"
else
  say "FAIL test_flashinfer.py (rc $rc): $line"; status=1
fi
exit "$status"
