"""What the capturer asks of the engine that builds it: whether routed experts are returned at all,
the chunked-prefill size and DP ranks that size SGLang's device buffer, the KV page size, a model's
fused shared experts, and whether the deployment is one this capturer serves.

Standalone (tests, benchmarks, engines of their own) the defaults answer; inside SGLang,
:mod:`routing_replay.sglang.install` points these at SGLang's own runtime context.
"""

from __future__ import annotations

from typing import Any, Callable

#: The chunked-prefill size SGLang's capturer assumes where no engine says otherwise.
DEFAULT_CHUNKED_PREFILL_SIZE = 8192

_engine: dict[str, Callable[..., Any]] = {}


def set_engine_hooks(**hooks: Callable[..., Any]) -> None:
    """Replaces hooks by name: ``enabled()``, ``chunked_prefill_size()``, ``num_dp_ranks()``,
    ``page_size()``, ``unsupported()`` (a reason, or None), ``record()`` (the route record asked for)."""
    _engine.update(hooks)


def reset_engine_hooks() -> None:
    """Back to the standalone defaults."""
    _engine.clear()


def enabled() -> bool:
    """Whether the engine returns routed experts (create() then builds a capturer)."""
    hook = _engine.get("enabled")
    return True if hook is None else bool(hook())


def max_batch_size(max_running_requests: int) -> int:
    """SGLang's device-buffer rows: max(chunked_prefill_size, max_running_requests) times the DP ranks."""
    chunk = _engine.get("chunked_prefill_size", lambda: DEFAULT_CHUNKED_PREFILL_SIZE)()
    ranks = _engine.get("num_dp_ranks", lambda: 1)()
    return max(int(chunk) * int(ranks), int(max_running_requests) * int(ranks))


def page_size() -> int:
    """Tokens per KV page (1 where the engine does not say)."""
    return int(_engine.get("page_size", lambda: 1)())


def fused_shared_experts(model) -> int:
    """The model's fused shared-expert columns, read as SGLang's create() does."""
    config = getattr(model, "shared_experts_config", None)
    if config is not None:
        return int(config.num_fused_shared_experts)
    return int(getattr(model, "num_fused_shared_experts", 0) or 0)


def record():
    """The route record ``create()`` asks its capturer for: ``ROUTING_REPLAY_SGLANG_RECORD`` in the
    environment (unset: none, SGLang's int32 field), or the engine's own answer where a hook gives one."""
    hook = _engine.get("record")
    if hook is not None:
        return hook()
    from .._record import from_environment
    from .install import RECORD_ENV

    return from_environment(RECORD_ENV)


def check_supported() -> None:
    """Raises NotImplementedError where the engine runs a deployment this capturer does not serve."""
    hook = _engine.get("unsupported")
    reason = hook() if hook is not None else None
    if reason:
        raise NotImplementedError(f"routing_replay.sglang.RoutedExpertsCapturer: {reason}")
