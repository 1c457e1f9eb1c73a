"""Where the engines' own released code lives, loaded at run time to test and measure against.

The peers (vLLM PR 39917's capturer, vLLM 0.33's routed-experts data plane, SGLang 0.5.23's
capturer) are never part of this repository. They are looked for, in order, in the folder named by
``ROUTING_REPLAY_PEERS``, in ``.peers/`` at the top of the checkout (where the device machines get
a copy) and in ``../shared/peers`` beside the checkout. Tests that compare against a peer skip,
saying which folders were searched, where it is absent.

vLLM's connector and SGLang's capturer are taken from the installed engine where it imports
(``_vllm_installed``, ``_sglang_installed``: thin layers over the engines' own classes), from the
stubbed files otherwise; ``ROUTING_REPLAY_VLLM_PEER`` / ``ROUTING_REPLAY_SGLANG_PEER`` =
``installed`` or ``stubbed`` choose (``installed`` where the engine cannot serve stops the run).
``used_peers()`` says, for the run's summary, which peers served.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
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


@dataclass(frozen=True)
class _Engine:
    label: str  # as the summary names it
    env: str  # the variable that chooses installed or stubbed
    probe: str  # the module whose import says the installed engine can serve
    layer: str  # this folder's module over the installed engine's own classes


_ENGINES = {
    VLLM_0_33: _Engine("vLLM", "ROUTING_REPLAY_VLLM_PEER", "vllm.distributed.aux_output_connector.worker",
                       "_vllm_installed"),
    SGLANG_0_5_23: _Engine("SGLang", "ROUTING_REPLAY_SGLANG_PEER", "sglang.srt.state_capturer.routed_experts",
                           "_sglang_installed"),
}
#: ROUTING_REPLAY_VLLM_PEER: which vLLM serves as the peer.
VLLM_PEER_ENV = _ENGINES[VLLM_0_33].env


def used_peers() -> dict[str, str]:
    """{peer file name: what served it ("installed vLLM 0.33.0 (path)" or "stubbed (path)")}."""
    return dict(_USED)


def engine_peers() -> dict[str, str]:
    """{peer file name: the engine's name} for the engines with an installed variant."""
    return {name: engine.label for name, engine in _ENGINES.items()}


def peer_wanted(file_name: str) -> str:
    """What the engine's variable (e.g. ROUTING_REPLAY_VLLM_PEER) asks for: "installed",
    "stubbed", or "" (unset: installed where the engine imports)."""
    engine = _ENGINES[file_name]
    wanted = os.environ.get(engine.env, "").strip().lower()
    if wanted not in ("", "installed", "stubbed"):
        raise pytest.UsageError(f"{engine.env}={wanted!r}: want 'installed' or 'stubbed'")
    return wanted


def peer_choice(file_name: str) -> tuple[str, str]:
    """("installed" or "stubbed", why) for an engine's peer: the explicit variable (e.g.
    ROUTING_REPLAY_VLLM_PEER), else installed where the engine's module imports (the first call
    imports it)."""
    if file_name not in _CHOSEN:
        _CHOSEN[file_name] = _choose(file_name)
    return _CHOSEN[file_name]


#: The choices made in this run ({peer file name: (kind, why)}).
_CHOSEN: dict[str, tuple[str, str]] = {}


def peer_chosen(file_name: str) -> bool:
    """Whether this run has chosen the engine's peer (a case asked for it, or the variable is set)."""
    return file_name in _CHOSEN


def _choose(file_name: str) -> tuple[str, str]:
    engine = _ENGINES[file_name]
    wanted = peer_wanted(file_name)
    if wanted == "stubbed":
        return "stubbed", f"{engine.env}=stubbed"
    problem = _import_problem(engine)
    if problem is None:
        return "installed", f"{engine.env}=installed" if wanted else f"{engine.probe.split('.')[0]} is importable"
    if wanted == "installed":
        pytest.exit(f"{engine.env}=installed, but {engine.label} cannot serve as the peer: {problem}", returncode=3)
    return "stubbed", f"no installed {engine.label} ({problem})"


def vllm_peer_choice() -> tuple[str, str]:
    """:func:`peer_choice` for vLLM."""
    return peer_choice(VLLM_0_33)


_PROBLEMS: dict[str, str | None] = {}


def _import_problem(engine: _Engine) -> str | None:
    if engine.probe not in _PROBLEMS:
        top = engine.probe.split(".")[0]
        if importlib.util.find_spec(top) is None:
            _PROBLEMS[engine.probe] = f"{top} is not installed"
        else:
            try:
                importlib.import_module(engine.probe)
                _PROBLEMS[engine.probe] = None
            except Exception as error:  # an import error, or the engine's own startup failing
                _PROBLEMS[engine.probe] = f"import failed: {type(error).__name__}: {error}"
    return _PROBLEMS[engine.probe]


def load_engine_peer(file_name: str) -> ModuleType:
    """An engine's released code: a thin layer over the installed engine's own classes, or the
    stubbed file (skips the caller, saying why, where neither can serve)."""
    kind, _ = peer_choice(file_name)
    if kind == "stubbed":
        return load_peer(file_name, needs=("torch",))
    module = importlib.import_module(_ENGINES[file_name].layer)
    _USED[file_name] = f"installed {_ENGINES[file_name].label} {module.VERSION} ({module.LOCATION})"
    return module


def load_vllm_peer() -> ModuleType:
    """vLLM 0.33's routed-experts data plane (:func:`load_engine_peer`)."""
    return load_engine_peer(VLLM_0_33)


def load_sglang_peer() -> ModuleType:
    """SGLang 0.5.23's routed-experts capturer (:func:`load_engine_peer`)."""
    return load_engine_peer(SGLANG_0_5_23)
