"""Where the engines' own released code lives, loaded at run time to test and measure against.

The peers (vLLM PR 39917's capturer, vLLM 0.33's routed-experts data plane, SGLang 0.5.23's
capturer) are never part of this repository. They are looked for, in order, in the folder named by
``ROUTING_REPLAY_PEERS``, in ``.peers/`` at the top of the checkout (where the device machines get
a copy) and in ``../shared/peers`` beside the checkout. Tests that compare against a peer skip,
saying which folders were searched, where it is absent.

vLLM's connector is taken from the installed vLLM where one is importable (``_vllm_installed``: a
thin layer over vLLM 0.33's own classes), from the stubbed file otherwise;
``ROUTING_REPLAY_VLLM_PEER=installed`` or ``stubbed`` chooses (``installed`` without an importable
vLLM stops the run). ``used_peers()`` says, for the run's summary, which peers served.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

_CHECKOUT = Path(__file__).resolve().parents[2]

#: File names of the peers this suite knows.
VLLM_PR39917 = "vllm_pr39917_capturer.py"
VLLM_0_33 = "vllm_0_33_routed_experts.py"
SGLANG_0_5_23 = "sglang_0_5_23_capturer.py"


def peer_folders() -> list[Path]:
    """The folders searched for peers, in order."""
    folders = []
    if os.environ.get("ROUTING_REPLAY_PEERS"):
        folders.append(Path(os.environ["ROUTING_REPLAY_PEERS"]))
    folders += [_CHECKOUT / ".peers", _CHECKOUT.parent / "shared" / "peers"]
    return folders


def find_peer(file_name: str) -> Path | None:
    """The path of a peer's file, or None where no searched folder holds it."""
    for folder in peer_folders():
        if (folder / file_name).is_file():
            return folder / file_name
    return None


def load_peer(file_name: str, *, needs: tuple[str, ...] = ()) -> ModuleType:
    """Imports a peer as a module of its own (once per process); skips the calling test, with the
    reason, where the file or a module it needs (``needs``, e.g. ``("torch",)``) is absent."""
    path = find_peer(file_name)
    if path is None:
        pytest.skip(f"peer {file_name} not found (searched {', '.join(str(f) for f in peer_folders())})")
    for module in needs:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"peer {file_name} needs {module}, which is not installed")
    name = "routing_replay_peer_" + path.stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    _USED[file_name] = f"stubbed ({path})"
    return module


#: What served each peer in this run ({peer file name: description}), for the summary.
_USED: dict[str, str] = {}
#: ROUTING_REPLAY_VLLM_PEER: which vLLM serves as the peer.
VLLM_PEER_ENV = "ROUTING_REPLAY_VLLM_PEER"


def used_peers() -> dict[str, str]:
    """{peer file name: what served it ("installed vLLM 0.33.0 (path)" or "stubbed (path)")}."""
    return dict(_USED)


def vllm_peer_choice() -> tuple[str, str]:
    """("installed" or "stubbed", why): the explicit ROUTING_REPLAY_VLLM_PEER, else installed where
    ``import vllm`` works."""
    wanted = os.environ.get(VLLM_PEER_ENV, "").strip().lower()
    if wanted not in ("", "installed", "stubbed"):
        raise pytest.UsageError(f"{VLLM_PEER_ENV}={wanted!r}: want 'installed' or 'stubbed'")
    if wanted == "stubbed":
        return "stubbed", f"{VLLM_PEER_ENV}=stubbed"
    problem = _vllm_import_problem()
    if problem is None:
        return "installed", f"{VLLM_PEER_ENV}=installed" if wanted else "vllm is importable"
    if wanted == "installed":
        pytest.exit(f"{VLLM_PEER_ENV}=installed, but vLLM cannot serve as the peer: {problem}", returncode=3)
    return "stubbed", f"no installed vLLM ({problem})"


_VLLM_PROBLEM: list[str | None] = []


def _vllm_import_problem() -> str | None:
    if not _VLLM_PROBLEM:
        if importlib.util.find_spec("vllm") is None:
            _VLLM_PROBLEM.append("vllm is not installed")
        else:
            try:
                import vllm.distributed.aux_output_connector.worker  # noqa: F401  (0.33's connector)
                _VLLM_PROBLEM.append(None)
            except Exception as error:  # an import error, or vLLM's own startup failing
                _VLLM_PROBLEM.append(f"import failed: {type(error).__name__}: {error}")
    return _VLLM_PROBLEM[0]


def load_vllm_peer() -> ModuleType:
    """vLLM 0.33's routed-experts data plane: over the installed vLLM's own classes, or the stubbed
    file (skips the caller, saying why, where neither can serve)."""
    kind, _ = vllm_peer_choice()
    if kind == "stubbed":
        return load_peer(VLLM_0_33, needs=("torch",))
    import _vllm_installed

    _USED[VLLM_0_33] = f"installed vLLM {_vllm_installed.VERSION} ({_vllm_installed.LOCATION})"
    return _vllm_installed
