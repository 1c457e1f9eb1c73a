"""Medians over rounds of the C++ engine loop's JSON lines (one file, lines tagged with `round` and
`tree`), per storage, scenario, mode and tree: `begin_us`, `host_us`, their sum per round, and in how
many rounds head's sum was lower than base's of the same round.
Usage: python3 summary_cpp.py engine_loop_cpp.jsonl"""
import collections
import json
import statistics
import sys

lines = [json.loads(t) for t in open(sys.argv[1])]
by = collections.defaultdict(dict)
for r in lines:
    storage = r["policy"].split("/")[-1]
    by[(storage, r["scenario"], r["mode"], r["tree"])][r["round"]] = r
for key in sorted(by):
    rounds = by[key]
    med = lambda f: round(statistics.median(r[f] for r in rounds.values()), 2)
    sums = [r["begin_us"] + r["host_us"] for r in rounds.values()]
    line = [*key, "begin_us", med("begin_us"), "host_us", med("host_us"), "sum", round(statistics.median(sums), 2),
            "rounds", len(rounds), "correct", all(r["correct"] for r in rounds.values())]
    if key[3] == "head":
        base = by.get((*key[:3], "base"), {})
        pairs = [(r, base[n]) for n, r in rounds.items() if n in base]
        lower = sum(h["begin_us"] + h["host_us"] < b["begin_us"] + b["host_us"] for h, b in pairs)
        line += ["head sum lower in", f"{lower} of {len(pairs)}"]
    print(*line)
