"""``python -m routing_replay``: how this copy was built and what it can run here."""

from __future__ import annotations

import routing_replay as rr
from routing_replay import _build


def main() -> int:
    """Prints the version, the backends built and importable, their compiler flags, and the compiled
    instantiations."""
    print(f"routing_replay {rr.__version__} ({_build.BUILD_TYPE} build)")
    print(f"backends built: {', '.join(_build.BACKENDS)}; importable here: {', '.join(rr.backends())}")
    print(f"CUDA module: {_build.CUDA_NOTE}; a CUDA device usable: {rr.cuda_available()}")
    print(f"compiler flags: host module {_build.CXX_FLAGS or '(none)'}; "
          f"CUDA module {_build.CUDA_FLAGS or '(not built)'}")
    print(f"index types compiled, each with every layout, copy strategy and storage: {', '.join(_build.INDEX_TYPES)}")
    for backend in rr.backends():
        names = [f"{p['index']}/{p['layout']}/{p['copy']}/{p['storage']}" for p in rr.policies(backend)]
        print(f"{backend}: {len(names)} instantiations (index/layout/copy/storage):")
        for name in names:
            print(f"  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
