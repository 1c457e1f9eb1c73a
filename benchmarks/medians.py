#!/usr/bin/env python3
"""Medians over rounds of the benchmarks' JSON lines, per configuration and tree.

Usage: medians.py FILE.jsonl [FILE.jsonl ...]

Reads the lines of benchmarks/engine_loop (C++), benchmarks/python/engine_loop.py, the side by side
with a peer (engine_loop_vs_peer.py), its harness floor (benchmarks/python/harness_floor.py), and the
floor benchmarks (block_slot_floors, step_floors),
each optionally tagged with "round" and "tree" (benchmarks/tag_rounds.py), and prints one Markdown
table per kind: for each configuration and tree, the median over its lines of each figure, and the
number of lines. Figures that need a partner line of the same round and tree are paired first:
the step time an API of engine_loop.py adds is its step_us less api=none's; the side by side's
ratio is the drop-in's added step over the peer's of the same round. docs/performance.md ("How to
measure") says why figures are medians over alternating rounds.
"""

import collections
import json
import statistics
import sys


def median(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 2) if values else None


def read(paths):
    for path in paths:
        with open(path, encoding="utf-8") as lines:
            for text in lines:
                try:
                    record = json.loads(text)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    yield record


def classify(r):
    """(kind, configuration, figures) of a line, or None for lines that carry no figure."""
    if r.get("impl") == "routing_replay":
        fwd = None if r.get("fwd_gpu_us") is None or r.get("fwd0_gpu_us") is None else r["fwd_gpu_us"] - r["fwd0_gpu_us"]
        total = None if r.get("begin_us") is None else r["begin_us"] + r["host_us"]
        ahead = r.get("ahead") or ("" if (r.get("host_memory_ahead") or -1) < 0 else f"ahead {r['host_memory_ahead']}")
        return ("C++ engine loop", (r["policy"], r["scenario"], r["mode"]) + ((ahead,) if ahead else ()),
                {"begin_us": r.get("begin_us"), "host_us": r["host_us"], "begin+host": total,
                 "eos_gpu_us": r.get("eos_gpu_us"), "added_fwd_gpu_us": fwd, "extract_us": r.get("extract_us"),
                 "overhead_us": r.get("overhead_us"), "correct": r.get("correct")})
    if r.get("bench") == "python_engine_loop":
        if r.get("api") == "none":
            return None
        return ("Python engine loop", (r["api"], r["mode"], r["scenario"]),
                {"host_us": r.get("host_us"), "plan_us": r.get("plan_us"), "begin_us": r.get("begin_us"),
                 "end_us": r.get("end_us"), "capture_us": r.get("capture_us"), "extract_us": r.get("extract_us"),
                 "correct": r.get("correct")})
    if r.get("part") == "capture":
        return ("side by side: capture()", (r["impl"], r["rows"]), {"host_us_per_call": r["host_us_per_call"]})
    if r.get("part") == "steps":
        return ("side by side: steps", (r["impl"], r["mode"], r["scenario"]),
                {"host_path_us": r.get("host_path_us"), "added_step_us": r.get("added_step_us"),
                 "added_fwd_gpu_us": r.get("added_fwd_gpu_us"), "extract_us": r.get("extract_us"),
                 "correct": r.get("correct")})
    if "capturer" in r:
        return ("side-by-side harness floor", (r.get("copy", "-"), r["scenario"], r["capturer"]),
                {"host_path_us": r["host_path_us"]})
    kind = r.get("bench") or r.get("probe")
    if kind == "step_floor":
        return ("step floors", (r["order"], r["batch"]),
                {"begin_us": r["begin_us"], "begin_floor_us": r["begin_floor_us"], "end_us": r["end_us"],
                 "end_floor_us": r["end_floor_us"], "refused": r.get("refused")})
    if kind in ("block_slot_floor", "block_slot", "block_slot_prefill_floor"):
        scenario = r.get("scenario") or ("prefill_8k" if kind == "block_slot_prefill_floor" else f"decode_B{r.get('batch')}")
        return ("block-slot floors", (scenario,),
                {"begin_us": r["begin_us"], "floor_us": r.get("floor_us", r.get("floor_touch_us"))})
    return None


def main(paths):
    rows = collections.defaultdict(lambda: collections.defaultdict(list))  # (kind, config, tree) -> figure -> values
    none_step = {}  # (round, tree, mode, scenario) -> api=none's step_us
    python_step = collections.defaultdict(list)  # (kind, config, tree) -> [(round, step_us)]
    side = {}  # (round, tree, impl, mode, scenario) -> added_step_us
    copy = "-"  # harness_floor.py prints its copy strategy on a line of its own, before its lines
    for r in read(paths):
        tree, rnd = str(r.get("tree", "-")), r.get("round", 0)
        if "copy" in r and "scenario" not in r:
            copy = r["copy"]
        if "capturer" in r:
            r = {**r, "copy": copy}
        if r.get("bench") == "python_engine_loop" and r.get("api") == "none":
            none_step[(rnd, tree, r["mode"], r["scenario"])] = r.get("step_us")
        if r.get("part") == "steps":
            side[(rnd, tree, r["impl"], r["mode"], r["scenario"])] = r.get("added_step_us")
        found = classify(r)
        if found is None:
            continue
        kind, config, figures = found
        for name, value in figures.items():
            rows[(kind, config, tree)][name].append(value)
        if kind == "Python engine loop":
            python_step[(kind, config, tree)].append((rnd, r.get("step_us")))
    for (kind, config, tree), steps in python_step.items():
        api, mode, scenario = config
        rows[(kind, config, tree)]["added_step_us"] = [
            s - none_step[(rnd, tree, mode, scenario)] for rnd, s in steps
            if s is not None and none_step.get((rnd, tree, mode, scenario)) is not None]
    for (rnd, tree, impl, mode, scenario), added in side.items():
        peer = side.get((rnd, tree, "peer", mode, scenario))
        if impl != "peer" and added is not None and peer:
            rows[("side by side: steps", (impl, mode, scenario), tree)]["ratio_to_peer"].append(added / peer)
    kinds = []
    for kind, _, _ in rows:
        if kind not in kinds:
            kinds.append(kind)
    for kind in kinds:
        keys = sorted((k for k in rows if k[0] == kind), key=lambda k: (str(k[1]), k[2]))
        names = []
        for key in keys:
            names += [n for n in rows[key] if n not in names and n != "correct"]
        print(f"\n{kind} (medians)\n")
        print("| configuration | tree | lines | " + " | ".join(names) + " | correct |")
        print("|---" * (len(names) + 4) + "|")
        for key in keys:
            figures = rows[key]
            count = max(len(v) for v in figures.values())
            cells = [str(median(figures.get(n, [])) if median(figures.get(n, [])) is not None else "-") for n in names]
            correct = figures.get("correct")
            verdict = "-" if not correct or all(c is None for c in correct) else ("yes" if all(correct) else "**NO**")
            print(f"| {' / '.join(str(c) for c in key[1])} | {key[2]} | {count} | " + " | ".join(cells) + f" | {verdict} |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
