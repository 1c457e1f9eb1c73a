"""The medians quoted in docs/performance.md section 9.10, from this folder's round-tagged lines.

engine_loop.py: per (api, mode, scenario), the median over every round of the calls named of host_us,
plan/begin/end, capture_us, and of the step time the api adds (its step_us less api=none's step_us
of the same round and call: the rounds move the machine's speed by up to 2x, so only figures of one
round are subtracted). The side by side: per (impl, mode, scenario), medians of host_path_us and
added_step_us, and the median over rounds of the drop-in's added step over the peer's.
Usage: python3 medians.py [call2 call3 ...]   (default: call2 call3, the lines with launch_floor)
"""

import collections
import json
import statistics
import sys
from pathlib import Path

here = Path(__file__).resolve().parent
calls = sys.argv[1:] or ["call2", "call3"]


def med(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 1) if xs else None


loop = collections.defaultdict(list)
for call in calls:
    for text in open(here / f"{call}_python_engine_loop_rounds.jsonl"):
        r = json.loads(text)
        if r.get("bench") == "python_engine_loop":
            loop[(call, r["round"], r["api"], r["mode"], r["scenario"])].append(r)

print("engine_loop.py, medians over rounds of", ", ".join(calls), "(us)")
print(f"{'api':12} {'mode':5} {'scenario':12} {'host':>6} {'plan':>5} {'begin':>6} {'end':>5} {'capture':>7} "
      f"{'added':>6} rounds correct")
keys = sorted({k[2:] for k in loop}, key=lambda k: (["none", "replay", "dropin", "launch_floor"].index(k[0]), k[1],
                                                   k[2]))
for api, mode, scenario in keys:
    rows, added = [], []
    for (call, rnd, a, m, s), rs in loop.items():
        if (a, m, s) != (api, mode, scenario):
            continue
        rows += rs
        base = loop.get((call, rnd, "none", m, s))
        if base and api != "none":
            added.append(rs[0]["step_us"] - base[0]["step_us"])
    print(f"{api:12} {mode:5} {scenario:12} {str(med([r['host_us'] for r in rows])):>6} "
          f"{str(med([r.get('plan_us') for r in rows])):>5} {str(med([r.get('begin_us') for r in rows])):>6} "
          f"{str(med([r.get('end_us') for r in rows])):>5} {str(med([r['capture_us'] for r in rows])):>7} "
          f"{str(med(added)):>6} {len(rows):>6} {sorted({str(r['correct']) for r in rows})}")

side = collections.defaultdict(list)
for call in calls:
    for text in open(here / f"{call}_peer_side_by_side_device_scatter_rounds.jsonl"):
        r = json.loads(text)
        if r.get("part") in ("capture", "steps"):
            side[(call, r["round"])].append(r)

print("\nside by side (../shared/peers/engine_loop_vs_peer.py --copy device_scatter), medians over rounds (us)")
cap = collections.defaultdict(list)
steps = collections.defaultdict(list)
ratios = collections.defaultdict(list)
for (call, rnd), rs in side.items():
    by = {}
    for r in rs:
        if r["part"] == "capture":
            cap[r["impl"]].append(r["host_us_per_call"])
        else:
            steps[(r["impl"], r["mode"], r["scenario"])].append(r)
            by[(r["impl"], r["mode"], r["scenario"])] = r
    for (impl, mode, scenario), r in by.items():
        peer = by.get(("peer", mode, scenario))
        if impl == "dropin" and peer and peer["added_step_us"] > 0:
            ratios[(mode, scenario)].append(r["added_step_us"] / peer["added_step_us"])
print("capture() host us/call:", {k: (min(v), med(v), max(v)) for k, v in cap.items()})
for (impl, mode, scenario), rs in sorted(steps.items()):
    ratio = ratios.get((mode, scenario)) if impl == "dropin" else None
    print(f"{impl:6} {mode:5} {scenario:12} host_path {med([r['host_path_us'] for r in rs]):>7}  added_step "
          f"{med([r['added_step_us'] for r in rs]):>7}"
          + (f"  dropin/peer {round(statistics.median(ratio), 2)} ({', '.join(f'{x:.2f}' for x in ratio)})"
             if ratio else "")
          + f"  correct {sorted({r['correct'] for r in rs})}")
