"""A vLLM general plugin: with ``ROUTING_REPLAY_VLLM=1`` in its environment, vLLM 0.33 builds
``routing_replay.vllm.AuxOutputWorkerConnector`` wherever it would build its own routed-experts
worker connector.

vLLM calls every entry point of the group ``vllm.general_plugins`` (this package registers
``routing_replay = routing_replay.vllm.plugin:register``) in each of its processes, once
(``vllm.plugins.load_general_plugins``; ``VLLM_PLUGINS``, where set, must name ``routing_replay``).
``register`` does nothing unless the variable is set: installing the package changes nothing.
Where ``VLLM_PLUGINS`` leaves ``routing_replay`` out, vLLM never calls ``register``, so the
variable alone changes nothing either: :func:`left_out_warning` says so, and the library logs it
(:func:`warn_if_left_out`) wherever its own vLLM code is imported (``routing_replay.vllm``) and in
``python -m routing_replay``.

What it replaces, in ``vllm.distributed.aux_output_connector.worker``: ``AuxOutputWorkerConnector``
and ``get_aux_output_connector``, the factory vLLM's model runner calls with
``(model, vllm_config, kv_cache_config)`` once the KV cache is sized. The factory looks the class
up in its own module when called, so both names are replaced there; a module of vLLM that bound
either name with ``from ... import`` before the plugin ran gets the replacement too. The worker
module is patched when it is first imported (an import hook), or at once if it already was, so the
plugin itself imports nothing heavy in processes that never build a connector (the API server).

With ``ROUTING_REPLAY_VLLM_RECORD=1`` (or a codec name) as well, or alone, the plugin puts a route
record in the ``routed_experts`` field vLLM's front end writes (:mod:`routing_replay.vllm.record`,
docs/engines.md, "Route records and vLLM's field"): that works with vLLM's own connector too.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

from .._import_patch import PatchOnImport

#: The environment variable that turns the plugin on ("1", "true", "yes" or "on").
ENV = "ROUTING_REPLAY_VLLM"
#: vLLM's allow-list of plugins: comma-separated entry point names, matched exactly; unset: all.
ALLOW_LIST = "VLLM_PLUGINS"
#: The name of this plugin's entry point (group ``vllm.general_plugins``).
NAME = "routing_replay"
#: The module whose names are replaced.
TARGET = "vllm.distributed.aux_output_connector.worker"
#: The names replaced there, each by the one of the same name in ``routing_replay.vllm``.
REPLACED = ("AuxOutputWorkerConnector", "get_aux_output_connector")

# a child of vLLM's logger, so that the line shows in vLLM's log with its own
logger = logging.getLogger("vllm.plugins.routing_replay")


def enabled() -> bool:
    """Whether ``ROUTING_REPLAY_VLLM`` asks for the library's connector."""
    return os.environ.get(ENV, "").strip().lower() in {"1", "true", "yes", "on"}


#: The environment variable that asks for a route record in vLLM's ``routed_experts`` field
#: (:mod:`routing_replay.vllm.record`).
RECORD_ENV = "ROUTING_REPLAY_VLLM_RECORD"


def _record_asked() -> bool:
    return os.environ.get(RECORD_ENV, "").strip().lower() not in {"", "0", "false", "no", "off"}


def left_out_warning() -> str | None:
    """The one-line warning for ``ROUTING_REPLAY_VLLM`` (or ``ROUTING_REPLAY_VLLM_RECORD``) set while
    ``VLLM_PLUGINS`` leaves this plugin out (vLLM then never loads it and runs its own connector and
    field); None where there is nothing to say."""
    allowed = os.environ.get(ALLOW_LIST)
    if not (enabled() or _record_asked()) or allowed is None:
        return None
    names = allowed.split(",")  # as vLLM splits it: no stripping
    if NAME in names:
        return None
    spaced = [name for name in names if name.strip() == NAME]
    why = (f"names {spaced[0]!r}, and vLLM matches names exactly" if spaced else "leaves routing_replay out")
    which = ENV if enabled() else RECORD_ENV
    return (f"routing_replay: {which}={os.environ[which]} is set, but {ALLOW_LIST}={allowed!r} {why}: vLLM will not "
            f"load the routing_replay plugin and runs its own {'connector' if which == ENV else 'routed_experts field'}; add routing_replay to {ALLOW_LIST} "
            f"(comma-separated, no spaces) or unset {ALLOW_LIST}")


_warned: set[str] = set()


def warn_if_left_out() -> bool:
    """Logs :func:`left_out_warning` (logger ``vllm.plugins.routing_replay``, WARNING), once per process
    and message; returns whether there was one."""
    message = left_out_warning()
    if message is None:
        return False
    if message not in _warned:
        _warned.add(message)
        logger.warning("%s", message)
    return True


def register() -> None:
    """The entry point vLLM calls. Off unless ``ROUTING_REPLAY_VLLM`` is set; then vLLM's worker
    connector is replaced (now, or when its module is imported). With ``ROUTING_REPLAY_VLLM_RECORD``
    set, vLLM's front end writes route records in its ``routed_experts`` field
    (:func:`routing_replay.vllm.record.register`: raises ValueError for a value it does not take).
    Safe to call more than once."""
    if enabled():
        install()
    if _record_asked():
        from . import record

        record.register()


def install() -> None:
    """Replaces vLLM's worker connector with the library's, whatever the environment says.

    Raises RuntimeError, naming what is missing, where this vLLM has no routed-experts worker
    connector (vLLM before 0.33) or the library's ``routing_replay.vllm`` cannot be imported."""
    module = sys.modules.get(TARGET)
    if module is not None:
        _patch(module)
        return
    vllm = importlib.util.find_spec("vllm")
    if vllm is None or not vllm.submodule_search_locations:
        raise RuntimeError(f"{ENV} is set but vLLM is not importable here")
    source = Path(next(iter(vllm.submodule_search_locations))) / "distributed" / "aux_output_connector" / "worker.py"
    if not source.is_file():
        raise RuntimeError(f"{ENV} is set but this vLLM has no {TARGET} ({source} is missing): the library's "
                           "connector replaces vLLM 0.33's routed-experts worker connector")
    _library()  # fail now, not in the middle of the model runner's start
    if not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def installed() -> bool:
    """Whether vLLM's worker module, imported, now builds the library's connector."""
    module = sys.modules.get(TARGET)
    return module is not None and getattr(module, "_routing_replay_originals", None) is not None


def _library():
    try:
        import routing_replay.vllm as library
    except ImportError as error:
        raise RuntimeError(f"{ENV} is set but routing_replay.vllm cannot be imported: {error}") from error
    missing = [name for name in REPLACED if not hasattr(library, name)]
    if missing:
        raise RuntimeError(f"{ENV} is set but routing_replay.vllm lacks {', '.join(missing)}")
    return library


def _patch(module) -> None:
    if getattr(module, "_routing_replay_originals", None) is not None:
        return
    missing = [name for name in REPLACED if not hasattr(module, name)]
    if missing:
        raise RuntimeError(f"{ENV} is set but {TARGET} has no {', '.join(missing)}: this vLLM is not the one the "
                           "library's connector replaces (0.33)")
    library = _library()
    originals = {name: getattr(module, name) for name in REPLACED}
    for name in REPLACED:
        setattr(module, name, getattr(library, name))
    module._routing_replay_originals = originals
    # modules that bound a name with `from ... import` before this ran
    rebound = []
    for name, other in list(sys.modules.items()):
        if other is None or other is module or not name.startswith("vllm"):
            continue
        for attr, original in originals.items():
            if getattr(other, attr, None) is original:
                setattr(other, attr, getattr(library, attr))
                rebound.append(f"{name}.{attr}")
    logger.info("routing_replay: vLLM's %s.AuxOutputWorkerConnector replaced by routing_replay.vllm's%s", TARGET,
                f" (also {', '.join(rebound)})" if rebound else "")


class _PatchOnImport(PatchOnImport):
    """Finds vLLM's worker module with the other finders and patches it once it has run."""

    once = True

    def patch_for(self, fullname):
        return _patch if fullname == TARGET else None
