"""A route record in vLLM 0.33's ``routed_experts`` field: with ``ROUTING_REPLAY_VLLM_RECORD=1`` (or a
codec: ``zstd``, ``zstd_columns``) in the environment, the OpenAI-compatible server's
``routed_experts`` is base64 of a route record (docs/wire.md) instead of base64 of an ``.npy``.

vLLM makes the field in its front-end process (the API server), not in the workers: the output
processor (``vllm/v1/engine/output_processor.py``) concatenates a request's
``routed_experts_chunks`` when it finishes (``RequestState._new_completion_output``) and the serving
modules write ``numpy2base64(output.routed_experts)``. vLLM loads its general plugins in that
process too (``EngineArgs.create_engine_config``), so :func:`install`, called from the plugin's
``register``, patches three places there, each when its module is first imported (an import hook)
or at once if it already is:

- ``AsyncLLM.__init__`` and ``LLMEngine.__init__`` (``vllm/v1/engine/async_llm.py``,
  ``llm_engine.py``): read the model's E as vLLM's capturer does
  (``model_config.get_num_experts()``), before the engine starts; where routed experts are asked
  for (``--enable-return-routed-experts``) and E is not found, the engine is not built
  (RuntimeError naming the model);
- ``RequestState._new_completion_output``: the finished completion's rows array (the same data, a
  view: :class:`RoutedExpertsRows`) carries E and its first position, the emit start vLLM's
  scheduler connector uses (``min(routed_experts_prompt_start, prompt length)``, in
  ``vllm/distributed/aux_output_connector/connector.py``), read from the counts as the rows end
  where the last sampled token starts: prompt length + output tokens - 1 - rows;
- ``numpy2base64`` as the serving modules bound it (``vllm/entrypoints/openai/chat_completion/
  serving.py``, ``completion/serving.py``, ``scale_out/token_in_token_out/serving.py``): a
  :class:`RoutedExpertsRows` becomes base64 of ``routing_replay.wire.encode(rows, E,
  token_start=...)``; every other array (the token-in-token-out module's prompt logprobs) goes to
  vLLM's own function.

The rows keep vLLM's layers (all ``get_total_num_hidden_layers()``, a dense layer as expert 0), so
the record's layer map is 0 .. L-1, the model layers. Offline ``LLM.generate`` sees the same rows
array as without the option (a view of it, same values). Only vLLM 0.33.x is patched; another
version gets a warning and vLLM's field.
"""

from __future__ import annotations

import base64
import functools
import logging
import sys
from typing import Any, Callable, NamedTuple

import numpy as np

from .._import_patch import PatchOnImport
from .._record import RecordOptions, from_environment

#: The environment variable: unset or 0 (vLLM's field), 1 (a packed record) or a codec name.
RECORD_ENV = "ROUTING_REPLAY_VLLM_RECORD"
#: The vLLM release line whose code this patches.
VERSION_PREFIX = "0.33."
#: The modules patched, each with the names it must have.
ENGINES = ("vllm.v1.engine.async_llm", "vllm.v1.engine.llm_engine")
OUTPUT_PROCESSOR = "vllm.v1.engine.output_processor"
SERVING = (
    "vllm.entrypoints.openai.chat_completion.serving",
    "vllm.entrypoints.openai.completion.serving",
    "vllm.entrypoints.scale_out.token_in_token_out.serving",
)

logger = logging.getLogger("vllm.plugins.routing_replay")


class RecordSpec(NamedTuple):
    """What a record of one completion needs beyond its rows."""

    num_experts: int
    token_start: int
    options: RecordOptions


class RoutedExpertsRows(np.ndarray):
    """vLLM's rows ``[T, L, K]`` of one finished completion, with :attr:`route_record` (a
    :class:`RecordSpec`) set on the array the output processor made; a view, slice or copy of it
    carries None, so only that array becomes a record."""

    route_record: RecordSpec | None = None

    def __array_finalize__(self, obj) -> None:
        self.route_record = None


def options() -> RecordOptions | None:
    """The record :data:`RECORD_ENV` asks for (None: vLLM's field). Raises ValueError naming the
    variable for a value it does not take, and where the codec needs zstd this build lacks."""
    record = from_environment(RECORD_ENV)
    if record is not None and record.codec != "packed":
        from .. import wire

        if record.codec not in wire.CODECS:
            raise ValueError(f"{RECORD_ENV}={record.codec}: this build of routing_replay has no zstd "
                             f"(routing_replay.wire.CODECS: {wire.CODECS})")
    return record


def version_supported(version: str | None = None) -> bool:
    """Whether the vLLM here (or ``version``) is one whose field this patches (0.33.x)."""
    if version is None:
        import vllm

        version = getattr(vllm, "__version__", "")
    return str(version).startswith(VERSION_PREFIX)


def register() -> bool:
    """Called by the plugin's ``register`` in every vLLM process: installs the patches where
    :data:`RECORD_ENV` asks for a record and vLLM is 0.33.x; warns (and patches nothing) for another
    vLLM. Returns whether the patches are (now or on import) installed."""
    record = options()
    if record is None:
        return False
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if not version_supported(version):
        logger.warning("routing_replay: %s is set, but this vLLM is %s and the route record replaces vLLM 0.33's "
                       "routed_experts field only: the field stays vLLM's (base64 of .npy)", RECORD_ENV, version)
        return False
    install(record)
    return True


_state: dict[str, Any] = {"options": None}


def install(record: RecordOptions | None = None) -> None:
    """Patches vLLM's front end (now for the modules imported, on import for the others). Idempotent;
    a second call with other options takes them."""
    _state["options"] = record or RecordOptions()
    for name, patch in _patches().items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
    if not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def installed(name: str) -> bool:
    """Whether the imported module ``name`` (one of :data:`ENGINES`, :data:`OUTPUT_PROCESSOR`,
    :data:`SERVING`) is patched."""
    module = sys.modules.get(name)
    return module is not None and getattr(module, "_routing_replay_record_originals", None) is not None


def uninstall() -> None:
    """Puts vLLM's own functions back (tests)."""
    for name in _patches():
        module = sys.modules.get(name)
        originals = getattr(module, "_routing_replay_record_originals", None) if module is not None else None
        if originals is None:
            continue
        for (owner, attr), original in originals.items():
            setattr(module if owner is None else getattr(module, owner), attr, original)
        module._routing_replay_record_originals = None
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PatchOnImport)]
    _state["options"] = None


def num_experts_of(model_config) -> int:
    """The model's E as vLLM's capturer reads it (``model_config.get_num_experts()``), or, where that
    says nothing, the Hugging Face config's ``num_experts`` / ``n_routed_experts`` /
    ``num_local_experts`` / ``moe_num_experts``; 0 where none is found."""
    try:
        experts = int(model_config.get_num_experts() or 0)
    except Exception:  # noqa: BLE001 - a config vLLM cannot read this way: look at the HF config
        experts = 0
    if experts > 0:
        return experts
    for config in (getattr(model_config, "hf_text_config", None), getattr(model_config, "hf_config", None)):
        for name in ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"):
            value = getattr(config, name, None) if config is not None else None
            if isinstance(value, (list, tuple)):  # per-modality counts (Ernie 4.5 VL): the widest
                value = max(value) if value else None
            if isinstance(value, int) and value > 0:
                return value
    return 0


def _engine_experts(vllm_config) -> int | None:
    """E for an engine built with ``vllm_config``; None where it returns no routed experts.
    Raises RuntimeError where it does and E is not found."""
    aux = getattr(vllm_config, "aux_output_config", None)
    if aux is None or not getattr(aux, "enable_return_routed_experts", False):
        return None
    model_config = getattr(vllm_config, "model_config", None)
    experts = num_experts_of(model_config) if model_config is not None else 0
    if experts <= 0:
        model = getattr(model_config, "model", "the model")
        raise RuntimeError(f"{RECORD_ENV} is set, but the number of routed experts of {model} is not known "
                           "(model_config.get_num_experts() and the Hugging Face config's num_experts, "
                           "n_routed_experts, num_local_experts, moe_num_experts say nothing): a route record must "
                           f"state E; unset {RECORD_ENV} for vLLM's field")
    if experts > 65536:
        raise RuntimeError(f"{RECORD_ENV} is set, but the model has {experts} routed experts and a route record "
                           "holds at most 65536")
    return experts


def _patch_engine(module) -> None:
    if getattr(module, "_routing_replay_record_originals", None) is not None:
        return
    cls_name = "AsyncLLM" if module.__name__.endswith("async_llm") else "LLMEngine"
    cls = getattr(module, cls_name, None)
    if cls is None:
        logger.warning("routing_replay: %s is set, but %s has no %s: route records are off for it", RECORD_ENV,
                       module.__name__, cls_name)
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        experts = _engine_experts(vllm_config)  # before the engine starts: nothing to stop on an error
        original(self, *args, **kwargs)
        processor = getattr(self, "output_processor", None)
        if experts is not None and processor is not None:
            processor._routing_replay_experts = experts
            logger.info("routing_replay: %s: routed_experts is base64 of a route record (%s, E = %d)", RECORD_ENV,
                        _state["options"].codec, experts)

    cls.__init__ = __init__
    module._routing_replay_record_originals = {(cls_name, "__init__"): original}


def _patch_output_processor(module) -> None:
    if getattr(module, "_routing_replay_record_originals", None) is not None:
        return
    state_cls, processor_cls = getattr(module, "RequestState", None), getattr(module, "OutputProcessor", None)
    missing = [name for name, obj in (("RequestState._new_completion_output",
                                        getattr(state_cls, "_new_completion_output", None)),
                                       ("OutputProcessor.add_request", getattr(processor_cls, "add_request", None)))
               if obj is None]
    if missing:
        logger.warning("routing_replay: %s is set, but %s has no %s: this is not vLLM 0.33's output processor, "
                       "the field stays vLLM's", RECORD_ENV, module.__name__, ", ".join(missing))
        return
    new_completion_output = state_cls._new_completion_output
    add_request = processor_cls.add_request

    @functools.wraps(new_completion_output)
    def _new_completion_output(self, *args, **kwargs):
        completion = new_completion_output(self, *args, **kwargs)
        experts = getattr(self, "_routing_replay_experts", None)
        rows = getattr(completion, "routed_experts", None)
        if experts is None or not isinstance(rows, np.ndarray) or rows.ndim != 3 or self.detokenizer is None:
            return completion
        total = int(self.prompt_len) + int(self.detokenizer.num_output_tokens())
        token_start = total - 1 - int(rows.shape[0])
        if token_start < 0:
            logger.warning("routing_replay: request %s: %d rows for %d tokens; its routed_experts stays vLLM's field",
                           self.request_id, rows.shape[0], total)
            return completion
        marked = rows.view(RoutedExpertsRows)
        marked.route_record = RecordSpec(int(experts), token_start, _state["options"] or RecordOptions())
        completion.routed_experts = marked
        return completion

    @functools.wraps(add_request)
    def add_request_(self, request, *args, **kwargs):
        add_request(self, request, *args, **kwargs)
        experts = getattr(self, "_routing_replay_experts", None)
        state = self.request_states.get(request.request_id)
        if experts is not None and state is not None:
            state._routing_replay_experts = experts

    state_cls._new_completion_output = _new_completion_output
    processor_cls.add_request = add_request_
    module._routing_replay_record_originals = {("RequestState", "_new_completion_output"): new_completion_output,
                                               ("OutputProcessor", "add_request"): add_request}


def field(rows: RoutedExpertsRows) -> str:
    """The ``routed_experts`` field of a marked rows array: base64 of its route record."""
    from .. import wire

    spec = rows.route_record
    record = wire.encode(np.asarray(rows), spec.num_experts, token_start=spec.token_start,
                         codec=spec.options.codec, ordered=spec.options.ordered, zstd_level=spec.options.zstd_level)
    return base64.b64encode(record).decode("ascii")


def _patch_serving(module) -> None:
    if getattr(module, "_routing_replay_record_originals", None) is not None:
        return
    original = getattr(module, "numpy2base64", None)
    if original is None:
        logger.warning("routing_replay: %s is set, but %s does not use numpy2base64: its routed_experts stays "
                       "vLLM's field", RECORD_ENV, module.__name__)
        return

    @functools.wraps(original)
    def numpy2base64(array, *args, **kwargs):
        if isinstance(array, RoutedExpertsRows) and array.route_record is not None:
            return field(array)
        return original(array, *args, **kwargs)

    module.numpy2base64 = numpy2base64
    module._routing_replay_record_originals = {(None, "numpy2base64"): original}


def _patches() -> dict[str, Callable]:
    patches: dict[str, Callable] = {name: _patch_engine for name in ENGINES}
    patches[OUTPUT_PROCESSOR] = _patch_output_processor
    patches.update({name: _patch_serving for name in SERVING})
    return patches


class _PatchOnImport(PatchOnImport):
    """Finds the patched modules with the other finders and patches each once it has run."""

    def patch_for(self, fullname):
        patch = _patches().get(fullname)
        if patch is None:
            return None
        return lambda module: patch(module) if _state["options"] is not None else None
