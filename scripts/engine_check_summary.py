"""The summary scripts/vllm_check.sh and scripts/sglang_check.sh print after their pytest run:
passed / skipped / failed per test file, the skip reasons counted, the peer lines of the run's
"peers" section; exits 1 where a case skipped for want of a peer (the run then compared against
less than it says). Usage: engine_check_summary.py JUNIT_XML PYTEST_LOG
"""

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
peers = re.findall(r"^\w+ peer: .*$", log, re.M)
wanting = re.search(r"^(\d+) of (\d+) skipped cases skipped for want of a peer", log, re.M)
print("\n".join(peers) if peers else "no peer line in the log")
if not wanting or int(wanting.group(1)):
    print(wanting.group(0) if wanting else "no count of skips for want of a peer in the log")
    sys.exit(1)
print(wanting.group(0))
