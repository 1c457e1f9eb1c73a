"""Medians of the C++ engine loop's lines of one call, per (storage, scenario, ahead, mode) and tree:
`begin_us` and `begin_us + host_us` over the rounds, with the number of rounds; a cell is marked
when a line's `correct` field is false. Trees print in the order base, a, b, head, then any other.

Usage: python3 cpp_medians.py callN_engine_loop_cpp.jsonl
"""

import collections
import json
import statistics
import sys


def main() -> None:
    cells = collections.defaultdict(lambda: collections.defaultdict(list))
    trees = []
    with open(sys.argv[1], encoding="utf-8") as lines:
        for line in lines:
            r = json.loads(line)
            if "scenario" not in r:
                continue
            if r["tree"] not in trees:
                trees.append(r["tree"])
            key = (r["policy"].split("/")[-1], r["scenario"], r.get("ahead", ""), r["mode"])
            cells[key][r["tree"]].append((r["begin_us"], r["begin_us"] + r["host_us"], r["correct"]))
    order = [t for t in ("base", "a", "b", "head") if t in trees] + [t for t in trees if t not in ("base", "a", "b", "head")]
    print("| storage | scenario | ahead | mode | " + " | ".join(f"{t}: begin / begin+host (rounds)" for t in order) + " |")
    print("|---" * (4 + len(order)) + "|")
    for key in sorted(cells):
        row = []
        for t in order:
            v = cells[key][t]
            if not v:
                row.append("-")
                continue
            begin = statistics.median(x[0] for x in v)
            total = statistics.median(x[1] for x in v)
            mark = "" if all(x[2] for x in v) else " NOT CORRECT"
            row.append(f"{begin:.1f} / {total:.1f} ({len(v)}){mark}")
        print("| " + " | ".join(str(k) for k in key) + " | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
