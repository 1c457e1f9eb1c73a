"""Where the engines' own released code lives, loaded at run time to test and measure against.

The peers (vLLM PR 39917's capturer, vLLM 0.33's routed-experts data plane, SGLang 0.5.23's
capturer) are never part of this repository. They are looked for, in order, in the folder named by
``ROUTING_REPLAY_PEERS``, in ``.peers/`` at the top of the checkout (where the device machines get
a copy) and in ``../shared/peers`` beside the checkout. Tests that compare against a peer skip,
saying which folders were searched, where it is absent.
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
    return module
