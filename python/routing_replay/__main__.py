"""``python -m routing_replay``: how this copy was built and what it can run here, in a few lines;
``--list`` adds every compiled policy combination of each backend."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import routing_replay as rr
from routing_replay import _build, _jit


def _cuda_lines() -> list[str]:
    """Where the CUDA module is and whether a device is usable, or why there is no module."""
    if "cuda" not in _build.BACKENDS:
        return [f"CUDA module: {_build.CUDA_NOTE}; device='cpu' runs on the host backend"]
    try:
        cuda = rr._cuda()
    except RuntimeError as e:
        return [f"CUDA module: {e}; device='cpu' runs on the host backend"]
    lines = [f"CUDA module: {cuda.__file__} ({_build.CUDA_NOTE})"]
    if not rr.cuda_available():
        lines.append("no CUDA device is usable here (no GPU, or no driver): device='cpu' runs on the host backend")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Prints the version, the backends, the CUDA module (and whether a device is usable) and the
    number of compiled combinations;
    with ``--list``, the combinations; with ``--flags``, the compiler flags."""
    parser = argparse.ArgumentParser(prog="python -m routing_replay", description=__doc__)
    parser.add_argument("--list", action="store_true", help="list every compiled policy combination of each backend")
    parser.add_argument("--flags", action="store_true", help="print the compiler flags the native modules were built with")
    args = parser.parse_args(argv)

    backends = rr.backends()
    print(f"routing_replay {rr.__version__} ({_build.BUILD_TYPE} build) in {os.path.dirname(rr.__file__)}")
    print(f"backends: {', '.join(backends)} (built: {', '.join(_build.BACKENDS)})")
    for line in _cuda_lines():
        print(line)
    combinations = {backend: rr.policies(backend) for backend in backends}
    counts = ", ".join(f"{backend} {len(found)}" for backend, found in combinations.items())
    units = ", ".join(unit.replace("/", " ") for unit in _build.AOT_UNITS)
    print(f"policy combinations compiled: {counts} (ahead of time: index and layout {units}, each with every "
          f"copy strategy and storage; the others compile on first use into {_jit.cache_dir()})"
          f"{'' if args.list else '; --list lists them'}")
    if args.flags:
        print(f"compiler flags: host module {_build.CXX_FLAGS or '(none)'}; "
              f"CUDA module {_build.CUDA_FLAGS or '(not built)'}")
    # The vLLM plugin's one warning (ROUTING_REPLAY_VLLM set, VLLM_PLUGINS leaving it out) is logged
    # when routing_replay.vllm is imported (it imports no vLLM): here, in line on stdout.
    logging.basicConfig(stream=sys.stdout, format="%(message)s", level=logging.WARNING)
    try:
        import routing_replay.vllm  # noqa: F401
    except ImportError as e:
        print(f"routing_replay.vllm does not import: {e}")
    if args.list:
        for backend, found in combinations.items():
            print(f"{backend} (index/layout/copy/storage):")
            for p in found:
                print(f"  {p['index']}/{p['layout']}/{p['copy']}/{p['storage']}")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except BrokenPipeError:  # `python -m routing_replay --list | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        raise SystemExit(1) from None
