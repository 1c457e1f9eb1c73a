#!/usr/bin/env bash
# The vLLM tests against vLLM itself, on a machine without a GPU: a virtual environment with
# vllm==0.33.0 (about 9.5 GB; made once, then reused) and the package (host module only, one wheel
# for every environment: host_package_wheel in scripts/common.sh), then the plugin tests, the
# differential and upstream-restated tests against the installed vLLM's own classes
# (ROUTING_REPLAY_VLLM_PEER=installed: a run that cannot import vLLM stops), vLLM's real Scheduler
# driving its connector and ours (test_vllm_scheduler.py), the smoke tests and the route record in
# vLLM's routed_experts field (test_vllm_record.py: vLLM's OutputProcessor and serving modules). Ends with a summary
# (scripts/engine_check_summary.py): wall time, passed / skipped / failed per file, the skip
# reasons; fails where a case skipped for want of a peer. Not part of scripts/test.sh or CI (too
# heavy); docs/engines.md quotes its figures.
# Usage: scripts/vllm_check.sh [extra pytest arguments]
#   VLLM_CHECK_VENV=DIR   the environment to make or reuse (default build/vllm-venv)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/common.sh
start=$(date +%s)
venv="${VLLM_CHECK_VENV:-$PWD/build/vllm-venv}"
if "$venv/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '0.33.0')" >/dev/null 2>&1; then
  echo "== reusing $venv (vLLM 0.33.0)"
else
  echo "== making $venv: pip install vllm==0.33.0 (about 9.5 GB)"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q vllm==0.33.0
  echo "   installed in $(( $(date +%s) - start )) s"
fi
"$venv/bin/pip" install -q pytest
built=$(date +%s)
wheel=$(host_package_wheel)
"$venv/bin/pip" install -q --no-deps --force-reinstall "$wheel"
echo "== package (host module) built and installed in $(( $(date +%s) - built )) s: $(basename "$wheel")"

files=(python/tests/test_vllm_plugin.py python/tests/test_vllm_differential.py python/tests/test_vllm_upstream.py
       python/tests/test_vllm_beyond.py python/tests/test_vllm_scheduler.py python/tests/test_vllm_smoke.py
       python/tests/test_vllm_record.py)
report="$PWD/build/vllm-check"
mkdir -p "$report"
tests=$(date +%s)
set +e
# torch's and vLLM's import-time warnings (no GPU, no vllm._C) are left out of the log
ROUTING_REPLAY_VLLM_PEER=installed "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  --junitxml="$report/junit.xml" "${files[@]}" "$@" 2>&1 | grep -v -e '^W[0-9]\{4\} ' -e '^\[rank0\]:W' \
  | tee "$report/pytest.log"
status=${PIPESTATUS[0]}
set -e
echo "== summary (vLLM 0.33.0 at $venv; tests $(( $(date +%s) - tests )) s, all $(( $(date +%s) - start )) s)"
"$venv/bin/python" scripts/engine_check_summary.py "$report/junit.xml" "$report/pytest.log" || status=1
exit "$status"
