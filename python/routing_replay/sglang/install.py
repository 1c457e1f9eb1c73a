"""Puts :class:`routing_replay.sglang.RoutedExpertsCapturer` into SGLang 0.5, in this process.

SGLang builds its capturer in the model runner (``RoutedExpertsCapturer.create(model=...,
model_config=..., num_tokens=..., max_running_requests=..., device=...)``, a name it imports from
``sglang.srt.state_capturer.routed_experts``) and finds it everywhere else through that module's
``get_global_experts_capturer()``: the MoE top-k (``capture``), the model runner
(``on_forward_end``), the scheduler's output processing (``get_topk``). So :func:`install` patches
that one module, as soon as it is imported (an import hook) or at once if it already is:

- ``routed_experts.RoutedExpertsCapturer`` becomes ours, for every module that imports the name later;
- SGLang's own class's ``create`` builds ours, for any module that imported the class before.

SGLang's global get/set/destroy functions stay (they keep whatever capturer they are given), and so
does its wire format, unless :data:`RECORD_ENV` asks for route records (then ``get_topk`` returns a
record's bytes, which SGLang's detokenizer base64-encodes into the field as it does the int32 rows). SGLang runs its scheduler and model workers in spawned processes, which a
patch here does not reach: :mod:`routing_replay.sglang.launch_server` sets ``ROUTING_REPLAY_SGLANG=1``
and puts ``routing_replay/sglang/_site`` on ``PYTHONPATH``, whose ``sitecustomize`` calls
:func:`install` in every process started from it.
"""

from __future__ import annotations

import sys

from .._import_patch import PatchOnImport

#: The module SGLang keeps its capturer in.
TARGET = "sglang.srt.state_capturer.routed_experts"
#: Set to "1" in the environment, every Python process started from it installs ours.
ENV_FLAG = "ROUTING_REPLAY_SGLANG"
#: Set to "1" (or a codec: "zstd", "zstd_columns") as well, ``meta_info["routed_experts"]`` is base64
#: of a route record (docs/engines.md, "A route record in the field") instead of SGLang's int32 rows.
RECORD_ENV = "ROUTING_REPLAY_SGLANG_RECORD"


def install() -> None:
    """Patches SGLang's capturer module now if it is imported, else when it is. Idempotent."""
    module = sys.modules.get(TARGET)
    if module is not None:
        patch(module)
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def installed(module=None) -> bool:
    """Whether SGLang's capturer module (by default the imported one) is patched."""
    module = sys.modules.get(TARGET) if module is None else module
    return module is not None and getattr(module, "_routing_replay_original", None) is not None


def patch(module) -> None:
    """Replaces the capturer of an imported ``sglang.srt.state_capturer.routed_experts``."""
    if installed(module):
        return
    from . import _context
    from .capturer import RoutedExpertsCapturer

    _context.set_engine_hooks(**_engine_hooks(module))
    original = module.RoutedExpertsCapturer
    original.create = staticmethod(RoutedExpertsCapturer.create)
    module.RoutedExpertsCapturer = RoutedExpertsCapturer
    module._routing_replay_original = original


def _server_args():
    try:
        from sglang.srt.server_args import get_global_server_args

        return get_global_server_args()
    except Exception:  # not set yet in this process, or an SGLang without it
        return None


def _engine_hooks(module) -> dict:
    """The engine's answers, read through the names SGLang's own module uses (0.5.23: its runtime
    context) or, where absent, its global server arguments."""

    def setting(name, default):
        args = _server_args()
        value = getattr(args, name, None) if args is not None else None
        return default if value is None else value

    def enabled():
        if hasattr(module, "get_exec"):
            return module.get_exec().features.enable_return_routed_experts
        return bool(setting("enable_return_routed_experts", True))

    def chunked_prefill_size():
        if hasattr(module, "get_schedule"):
            return module.get_schedule().chunked_prefill_size
        return setting("chunked_prefill_size", 8192)

    def num_dp_ranks():
        if hasattr(module, "get_parallel"):
            return getattr(module.get_parallel(), "num_dp_ranks", 1)
        return setting("dp_size", 1)

    def unsupported():
        if getattr(module, "is_dp_attention_enabled", lambda: False)():
            return "DP attention is not supported (one data-parallel rank per capturer)"
        if getattr(module, "_is_scattered_a2a_backend", lambda: False)():
            return "a DeepEP all-to-all backend is not supported (tokens scattered across attention ranks)"
        return None

    return {"enabled": enabled, "chunked_prefill_size": chunked_prefill_size, "num_dp_ranks": num_dp_ranks,
            "page_size": lambda: setting("page_size", 1), "unsupported": unsupported}


class _PatchOnImport(PatchOnImport):
    """Finds SGLang's capturer module through the other finders and patches it once it has run."""

    def patch_for(self, fullname):
        return patch if fullname == TARGET else None
