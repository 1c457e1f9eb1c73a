"""Medians of run_gpu.sh's round-tagged lines, this tree ("head") against the baseline ("base").

engine_loop.py: per (api, mode, scenario) and tree, the median over rounds of host_us, plan, begin,
end and capture_us, and of the step time the api adds (its step_us less api=none's of the same
round and tree: rounds move the machine's speed by up to 2x). The side by side: per (impl, mode,
scenario) and tree, medians of host_path_us and added_step_us, and the median over rounds of the
drop-in's added step over the peer's of the same round.
Usage: python3 medians.py [DIR]   (default: this folder)
"""

import collections
import json
import statistics
import sys
from pathlib import Path

here = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent


def med(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 1) if xs else None


def lines(name):
    path = here / name
    if not path.exists():
        return []
    out = []
    for text in open(path):
        try:
            out.append(json.loads(text))
        except ValueError:
            pass
    return out


loop = collections.defaultdict(list)
for r in lines("python_engine_loop.jsonl"):
    if r.get("bench") == "python_engine_loop":
        loop[(r["round"], r["tree"], r["api"], r["mode"], r["scenario"])].append(r)
print("engine_loop.py: medians over rounds (us)")
print(f"{'api':7} {'mode':5} {'scenario':12} {'tree':4} {'host':>6} {'plan':>5} {'begin':>6} {'end':>5} "
      f"{'capture':>7} {'added':>6} rounds correct")
keys = sorted({k[2:] for k in loop}, key=lambda k: (["none", "replay", "dropin"].index(k[0]), k[1], k[2]))
for api, mode, scenario in keys:
    for tree in ("base", "head"):
        rows, added = [], []
        for (rnd, t, a, m, s), rs in loop.items():
            if (t, a, m, s) != (tree, api, mode, scenario):
                continue
            rows += rs
            base = loop.get((rnd, t, "none", m, s))
            if base and api != "none" and rs[0].get("step_us") and base[0].get("step_us"):
                added.append(rs[0]["step_us"] - base[0]["step_us"])
        if not rows:
            continue
        print(f"{api:7} {mode:5} {scenario:12} {tree:4} {str(med([r['host_us'] for r in rows])):>6} "
              f"{str(med([r.get('plan_us') for r in rows])):>5} {str(med([r.get('begin_us') for r in rows])):>6} "
              f"{str(med([r.get('end_us') for r in rows])):>5} {str(med([r.get('capture_us') for r in rows])):>7} "
              f"{str(med(added)):>6} {len(rows):>6} {sorted({str(r.get('correct')) for r in rows})}")

side = collections.defaultdict(list)
for r in lines("peer_side_by_side_device_scatter.jsonl"):
    if r.get("part") == "steps":
        side[(r["round"], r["tree"], r["impl"], r["mode"], r["scenario"])].append(r)
    elif r.get("part") == "capture":
        side[(r["round"], r["tree"], r["impl"], "capture", str(r["rows"]))].append(r)
print("\nside by side: medians over rounds (us); ratio: drop-in / peer of the same round")
keys = sorted({k[2:] for k in side})
for impl, mode, scenario in keys:
    for tree in ("base", "head"):
        rs = [x for (rnd, t, i, m, s), v in side.items() if (t, i, m, s) == (tree, impl, mode, scenario) for x in v]
        if not rs:
            continue
        if mode == "capture":
            print(f"{impl:6} capture rows {scenario:>5} {tree:4} host {med([r['host_us_per_call'] for r in rs])} "
                  f"us/call  gpu {med([r['gpu_us_per_call'] for r in rs])} us/call")
            continue
        ratios = []
        if impl == "dropin":
            for (rnd, t, i, m, s), v in side.items():
                if (t, i, m, s) == (tree, impl, mode, scenario):
                    peer = side.get((rnd, "head", "peer", m, s))
                    if peer and peer[0].get("added_step_us"):
                        ratios.append(v[0]["added_step_us"] / peer[0]["added_step_us"])
        print(f"{impl:6} {mode:5} {scenario:12} {tree:4} host_path {med([r.get('host_path_us') for r in rs])}  "
              f"added_step {med([r.get('added_step_us') for r in rs])}  ratio {round(statistics.median(ratios), 2) if ratios else '-'}  "
              f"correct {sorted({str(r.get('correct')) for r in rs})}")
