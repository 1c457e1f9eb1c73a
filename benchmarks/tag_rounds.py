"""Tags benchmark JSON lines with their round and tree: each JSON object read from stdin is printed
again with the fields given as arguments (KEY=VALUE; an integer VALUE stays an integer) in front;
lines that are not JSON (a program's progress output) are dropped.

Usage: program | python3 benchmarks/tag_rounds.py round=2 tree=$(git rev-parse --short HEAD) >> results.jsonl
benchmarks/medians.py then prints medians over rounds per configuration and tree.
"""

import json
import sys


def main() -> None:
    tags = {}
    for arg in sys.argv[1:]:
        key, _, value = arg.partition("=")
        tags[key] = int(value) if value.lstrip("-").isdigit() else value
    for line in sys.stdin:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            print(json.dumps({**tags, **record}), flush=True)


if __name__ == "__main__":
    main()
