"""Medians over rounds of this folder's JSON lines (call3.sh's, or call 1's when given its files):
step_floor_probe, the C++ engine loop and the Python engine loop, per tree, with the share of rounds
in which head read lower than base.

Usage: python3 summary.py FOLDER   (reads step_floor_probe.jsonl, engine_loop_cpp.jsonl,
python_engine_loop.jsonl where present)
"""

import collections
import json
import os
import statistics
import sys


def load(folder, name):
    path = os.path.join(folder, name)
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def report(rows, key, fields):
    groups = collections.defaultdict(list)
    for r in rows:
        groups[key(r) + (r.get("tree", "head"),)].append(r)
    for k in sorted(groups):
        v = groups[k]
        meds = []
        for f in fields:
            xs = [r[f] for r in v if r.get(f) is not None]
            meds.append(f"{f} {round(statistics.median(xs), 1) if xs else '-'}")
        ok = all(r.get("correct") is not False and not r.get("refused") for r in v)
        print(*k, *meds, "ok" if ok else "NOT OK", "rounds", len(v))
    # head lower than base, round by round, in the first field
    trees = {r.get("tree") for r in rows}
    if {"base", "head"} <= trees:
        by = collections.defaultdict(dict)
        for r in rows:
            by[key(r)][(r["round"], r["tree"])] = r[fields[0]]
        for k in sorted(by):
            rounds = sorted({rd for rd, _ in by[k]})
            pairs = [(by[k].get((rd, "base")), by[k].get((rd, "head"))) for rd in rounds]
            pairs = [(b, h) for b, h in pairs if b is not None and h is not None]
            print("  head lower in", sum(h < b for b, h in pairs), "of", len(pairs), ":", *k, fields[0])


def main():
    folder = sys.argv[1]
    report(load(folder, "step_floor_probe.jsonl"), lambda r: ("step_floor", r["order"], r["batch"]),
           ("end_us", "end_floor_us", "begin_us", "begin_floor_us"))
    report(load(folder, "engine_loop_cpp.jsonl"), lambda r: ("cpp", r["policy"].split("/")[-1], r["mode"], r["scenario"]),
           ("host_us", "begin_us"))
    report(load(folder, "python_engine_loop.jsonl"), lambda r: ("py", r["api"], r["mode"], r["scenario"]),
           ("host_us", "plan_us", "begin_us", "end_us", "capture_us"))


if __name__ == "__main__":
    main()
