"""Shared fixtures: the backends this machine can run, and arrays on them.

The suite runs on the host backend everywhere. The CUDA backend is added where its module was
built, a GPU is usable and torch is importable (CUDA arrays are torch tensors); otherwise its tests
are skipped, with the reason.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest

import routing_replay as rr

if importlib.util.find_spec("routing_replay._core") is None:  # pragma: no cover - a setup error
    pytest.exit(f"routing_replay at {os.path.dirname(rr.__file__)} has no native module: install the package "
                "(pip install ./python) and run pytest from outside python/", returncode=4)

HAVE_TORCH = importlib.util.find_spec("torch") is not None


def cuda_skip_reason() -> str | None:
    """Why the CUDA backend cannot be tested here, or None."""
    if "cuda" not in rr.backends():
        return f"the CUDA backend module was not built ({rr._CUDA_NOTE})"
    if not rr.cuda_available():
        return "no CUDA device"
    if not HAVE_TORCH:
        return "torch is not installed (the CUDA tests make their device arrays with torch)"
    return None


CUDA_SKIP = cuda_skip_reason()
if CUDA_SKIP is not None and os.environ.get("ROUTING_REPLAY_REQUIRE_CUDA"):  # scripts/python_gpu_check.sh
    pytest.exit(f"ROUTING_REPLAY_REQUIRE_CUDA is set, but the CUDA cases cannot run: {CUDA_SKIP}", returncode=3)
requires_cuda = pytest.mark.skipif(CUDA_SKIP is not None, reason=f"CUDA backend: {CUDA_SKIP}")
requires_torch = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")

BACKENDS = [
    "host",
    pytest.param("cuda", marks=requires_cuda),
]


class Device:
    """Makes router outputs on one backend: numpy arrays on the host, torch CUDA tensors on CUDA."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.name = "cpu" if backend == "host" else "cuda"
        if backend == "cuda":
            import torch

            self.torch = torch

    def array(self, a: np.ndarray):
        """`a` on this backend (same dtype and shape; rows contiguous)."""
        if self.backend == "host":
            return np.ascontiguousarray(a)
        return self.torch.from_numpy(np.ascontiguousarray(a)).to("cuda")

    def synchronize(self) -> None:
        """Waits for device work (CUDA)."""
        if self.backend == "cuda":
            self.torch.cuda.synchronize()


@pytest.fixture(params=BACKENDS)
def device(request) -> Device:
    """Each backend this machine can run."""
    return Device(request.param)


@pytest.fixture
def host() -> Device:
    """The host backend."""
    return Device("host")


def pytest_report_header(config):
    return (f"routing_replay {rr.__version__}: backends built {list(rr._BUILT_BACKENDS)}, importable "
            f"{rr.backends()}; CUDA tests: {'run' if CUDA_SKIP is None else 'skipped: ' + CUDA_SKIP}")


sys.path.insert(0, os.path.dirname(__file__))

import _peers  # noqa: E402  (from this folder, on the path only now)


def pytest_configure(config):
    # ROUTING_REPLAY_*_PEER=installed where the engine cannot serve stops the run here; otherwise
    # nothing is imported until a case asks for a peer (importing SGLang takes half a minute)
    for name in _peers.engine_peers():
        if _peers.peer_wanted(name) == "installed":
            _peers.peer_choice(name)


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter):
    """Which peers the engine tests ran against, and how many cases skipped for want of one (a
    skip reason starting with "peer "), so that a run that compared against nothing says so."""
    skipped = [_skip_reason(r) for r in terminalreporter.stats.get("skipped", []) if r.when != "teardown"]
    wanting = [reason for reason in skipped if reason.startswith("peer ")]
    write = terminalreporter.write_line
    terminalreporter.section("peers")
    used = _peers.used_peers()
    for name, label in _peers.engine_peers().items():
        if _peers.peer_chosen(name):
            kind, why = _peers.peer_choice(name)
            write(f"{label} peer: {kind} ({why}); served by {used.get(name, 'nothing: no case loaded it')}")
        else:
            write(f"{label} peer: not loaded (no case asked for it)")
    for name, what in sorted(used.items()):
        if name not in _peers.engine_peers():
            write(f"{name}: {what}")
    write(f"{len(wanting)} of {len(skipped)} skipped cases skipped for want of a peer")
    for reason in sorted(set(wanting)):
        write(f"  {wanting.count(reason)} x {reason}")
