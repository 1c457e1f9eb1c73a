#!/usr/bin/env bash
# The vLLM tests against vLLM itself, on a machine without a GPU: a virtual environment with
# vllm==0.33.0 (about 9.5 GB; made once, then reused) and the package (host module only), then the
# plugin tests, the differential and upstream-restated tests against the installed vLLM's own
# classes (ROUTING_REPLAY_VLLM_PEER=installed: a run that cannot import vLLM stops), vLLM's real
# Scheduler driving its connector and ours (test_vllm_scheduler.py) and the smoke tests. Ends with a
# summary: wall time, and passed / skipped / failed per file; fails where a case skipped for want
# of a peer. Not part of scripts/test.sh or CI (too heavy); docs/engines.md quotes its figures.
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
       python/tests/test_vllm_beyond.py python/tests/test_vllm_scheduler.py python/tests/test_vllm_smoke.py)
report="$PWD/build/vllm-check"
mkdir -p "$report"
tests=$(date +%s)
status=0
ROUTING_REPLAY_VLLM_PEER=installed "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  --junitxml="$report/junit.xml" "${files[@]}" "$@" 2>&1 | grep -v -e '^W[0-9]\{4\} ' -e '^\[rank0\]:W' \
  | tee "$report/pytest.log" || true
status=${PIPESTATUS[0]}
test_seconds=$(( $(date +%s) - tests ))

echo "== summary (vLLM 0.33.0 at $venv; tests $test_seconds s, all $(( $(date +%s) - start )) s)"
"$venv/bin/python" - "$report/junit.xml" "$report/pytest.log" <<'PY' || status=1
import collections, re, sys, xml.etree.ElementTree as ET

counts = collections.defaultdict(collections.Counter)
reasons = collections.Counter()
for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    found = re.search(r"test_\w+", case.get("classname", ""))
    name = (found.group(0) if found else "?") + ".py"
    outcome = "passed"
    for child in case:
        if child.tag in ("failure", "error"):
            outcome = "failed"
        elif child.tag == "skipped":
            outcome = "skipped"
            reasons[re.sub(r"^Skipped: ", "", child.get("message", ""))] += 1
    counts[name][outcome] += 1
total = collections.Counter()
for name, c in counts.items():
    total += c
    print(f"{name:30s} {c['passed']:4d} passed {c['skipped']:4d} skipped {c['failed']:3d} failed")
print(f"{'all':30s} {total['passed']:4d} passed {total['skipped']:4d} skipped {total['failed']:3d} failed")
for reason, n in reasons.most_common():
    print(f"  skipped {n:3d}: {reason}")
log = open(sys.argv[2]).read()
peer = re.search(r"^vLLM peer: .*$", log, re.M)
wanting = re.search(r"^(\d+) of (\d+) skipped cases skipped for want of a peer", log, re.M)
print(peer.group(0) if peer else "no peer line in the log")
if not wanting or int(wanting.group(1)):
    print(wanting.group(0) if wanting else "no count of skips for want of a peer in the log")
    sys.exit(1)
print(wanting.group(0))
PY
exit "$status"
