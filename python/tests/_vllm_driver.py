"""Drives one connector of one implementation step by step, as vLLM's model runner does, for tests
written as a few explicit steps (the restated upstream tests and the behaviour beyond upstream).

``Worker.step`` runs begin_step, the captures, prepare_output, enqueue_cpu_copy and process_output
of one step and returns ``{request: (token_start, rows)}``; ``Worker.read`` returns what a request
whose prefix hit covers some blocks gets back from the store (a "reader": it emits from token 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from _vllm_harness import capturer_of
from _vllm_scheduler import Meta
from _vllm_trace import Forward, TraceConfig

L, K, B = 3, 2, 4  # upstream's shape per token (3, 2), uint8 rows, hash blocks of 4 tokens
E = 256


def logical(n: int, start: int = 0) -> np.ndarray:
    """Rows [n, L, K] whose values follow their position (start..start+n)."""
    return (np.arange(start * L * K, (start + n) * L * K) % E).reshape(n, L, K).astype(np.uint8)


def h(c) -> bytes:
    return (c.encode() if isinstance(c, str) else bytes([c])) * 32


@dataclass
class Sched:
    """One request in one step: where the batch says it starts, its tokens, the scheduler's emit
    start and the block hashes that arrive with it."""

    rid: str
    token_start: int
    num_tokens: int
    emit: int = 0
    hashes: list = field(default_factory=list)


class Worker:
    """A connector of one implementation, driven step by step as vLLM's model runner drives it."""

    def __init__(self, impl, *, max_num_seqs=2, max_num_batched_tokens=None, max_concurrent_batches=2,
                 store_blocks=None, num_experts=E):
        self.impl = impl
        self.cfg = TraceConfig(seed=0, num_layers=L, top_k=K, num_experts=num_experts, block_size=B,
                               max_num_batched_tokens=max_num_batched_tokens or 64,
                               max_num_seqs=max_num_seqs, max_concurrent_batches=max_concurrent_batches,
                               num_kv_blocks=4096, store_blocks=store_blocks)
        self.conn = impl.connector(self.cfg)
        self.readers = 0

    def meta(self, runs=(), finished=None, hash_updates=None, generation=0, retained=(), released=()):
        hashes = {r.rid: list(r.hashes) for r in runs if r.hashes}
        hashes.update({rid: list(v) for rid, v in (hash_updates or {}).items() if v})
        hashes.update({rid: list(v) for rid, v in (finished or {}).items() if v})
        return self.impl.metadata(Meta(generation, {r.rid: r.emit for r in runs}, hashes,
                                       tuple(finished or {}), list(retained), list(released)))

    def begin(self, runs=(), **meta):
        self.conn.begin_step(self.meta(runs, **meta))

    def forward(self, runs, rows, *, query_start_loc=None):
        """The forward's captures and prepare_output; the pending output."""
        rows = np.asarray(rows)
        capturer = capturer_of(self.conn)
        for layer in range(L):
            capturer.capture(layer, self.impl.ids(self.conn, np.ascontiguousarray(rows[:, layer, :].astype(np.int64))))
        if query_start_loc is None:
            query_start_loc = np.concatenate([[0], np.cumsum([r.num_tokens for r in runs])])
        self._fw = Forward(0, [r.rid for r in runs], np.asarray(query_start_loc, np.int32),
                           np.asarray([r.token_start for r in runs], np.int32), rows, None, None)
        return self.conn.prepare_output(self.impl.input_batch(self._fw))

    def finish_step(self, pending, runs, *, rejected=None, sampled=None):
        n = len(runs)
        self._fw.num_sampled = np.asarray(sampled if sampled is not None else [1] * n, np.int32)
        self._fw.num_rejected = np.asarray(rejected if rejected is not None else [0] * n, np.int32)
        self.impl.wait(self.impl.enqueue(pending, self._fw))
        return {rid: (int(o.token_start), np.asarray(o.rows)) for rid, o in pending.process_output().items()}

    def step(self, runs, rows, *, rejected=None, sampled=None, query_start_loc=None, **meta):
        self.begin(runs, **meta)
        pending = self.forward(runs, rows, query_start_loc=query_start_loc)
        assert pending is not None
        return self.finish_step(pending, runs, rejected=rejected, sampled=sampled)

    def read(self, hashes, *, generation=0) -> np.ndarray:
        """The rows stored under ``hashes``, as a request whose prefix hit covers them gets them."""
        self.readers += 1
        rid = f"reader-{self.readers}"
        out = self.step([Sched(rid, len(hashes) * B, 1, 0, hashes)], np.zeros((1, L, K), np.uint8),
                        generation=generation)
        self.begin(finished={rid: []}, generation=generation)
        token_start, rows = out[rid]
        assert token_start == 0
        return rows[:-1]

    def close(self):
        self.conn.close()


def refused(impl, call, *args, **kwargs):
    """``call`` is refused as ``impl`` refuses (vLLM: an assert; the library: a clear exception)."""
    with pytest.raises(Exception) as info:
        call(*args, **kwargs)
    assert isinstance(info.value, impl.refusal), f"{impl.name} raised {type(info.value).__name__}: {info.value}"
    if impl.name == "routing_replay":
        assert_clear(info.value)


def assert_clear(error: BaseException) -> None:
    """The library's refusals say what was refused (a sentence, not an internal type's name)."""
    assert len(str(error).split()) >= 3, f"unclear refusal: {type(error).__name__}({str(error)!r})"
