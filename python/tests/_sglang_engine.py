"""A randomized SGLang-like engine for the SGLang capturer's tests and benchmark: a paged KV
allocator (slot 0's page reserved for padding, as SGLang's), a ``req_to_token_pool`` (int32
``[max_reqs, max_context_len]``), chunked prefill, decode, radix-cache prefix hits that read slots
another request wrote, retraction and re-prefill, slots freed and reused, ``start_len``, fused
shared-expert columns, CUDA-graph padded decode batches, and dense layers never captured.

``steps()`` yields one :class:`Step` per forward (the router outputs of every MoE layer, the KV
slots of the step's tokens, the graph padding); the driver feeds the same step to every capturer,
then reads the requests that step finished (:attr:`Step.finished`) and hands them back with
:meth:`SimEngine.release`. Routing ids are a function of (request, position, layer, column, compute
epoch), so a recomputed position gets new ids.
"""

from __future__ import annotations

import collections
import dataclasses
from types import SimpleNamespace

import numpy as np


@dataclasses.dataclass
class Finished:
    """A request to read after its last step: SGLang's get_topk arguments."""

    req_pool_idx: int
    seqlen: int
    start_len: int
    uid: int


@dataclasses.dataclass
class Step:
    """One forward."""

    slots: np.ndarray  #: int64 [n]: the KV slot of every token of the step, batch order
    captured_rows: int  #: rows every layer's router output has (>= n with graph padding)
    topk: dict  #: MoE layer -> int [captured_rows, K or K + shared]
    graph_batch: int | None  #: the padded batch of a replayed decode graph
    virtual: bool  #: hand the slots as out_cache_loc_virtual (out_cache_loc then padded)
    finished: list  #: (request, Finished) of the requests this step finished


class SimEngine:
    """The engine; see the module docstring. ``rng`` decides everything."""

    def __init__(self, rng: np.random.Generator, *, num_layers=6, dense=(0, 1), top_k=4, num_experts=32, shared=0,
                 page_size=1, num_pages=96, max_reqs=12, max_context=160, chunk=24, graph_sizes=(1, 2, 4, 8),
                 routed_only_prob=0.3, int64_prob=0.2):
        self.rng = rng
        self.num_layers, self.top_k, self.num_experts, self.shared = num_layers, top_k, num_experts, shared
        self.moe_layers = [layer for layer in range(num_layers) if layer not in set(dense)]
        self.page_size, self.chunk, self.graph_sizes = page_size, chunk, graph_sizes
        self.routed_only_prob, self.int64_prob = routed_only_prob, int64_prob
        self.num_tokens = num_pages * page_size + page_size  # SGLang: max_total_num_tokens + page_size
        self.free_pages = list(range(1, num_pages + 1))  # page 0 holds the padding slot
        self.req_to_token = np.zeros((max_reqs, max_context), np.int32)
        self.free_reqs = list(range(max_reqs))
        self.max_context = max_context
        self.waiting: list[SimpleNamespace] = []
        self.running: list[SimpleNamespace] = []
        self.cache: list[SimpleNamespace] = []  # radix entries: page-aligned slot lists, refcounted
        self.next_uid = 0
        self.steps_made = 0
        #: how often each feature occurred (prefix_hit, retract, graph, virtual, shared_columns, ...)
        self.stats: collections.Counter = collections.Counter()
        self._written: set = set()

    # ---- the pool that SGLang's get_topk reads ---------------------------------------------------

    @property
    def req_to_token_pool(self):
        return SimpleNamespace(req_to_token=self.req_to_token)

    # ---- requests -------------------------------------------------------------------------------

    def _new_request(self):
        prompt = int(self.rng.integers(1, 40))
        output = int(self.rng.integers(1, 12))
        self.next_uid += 1
        return SimpleNamespace(uid=self.next_uid, prompt=prompt, target=output, outputs=0, epoch=0, idx=None,
                               pages=[], shared=None, done=0, start_len=self._start_len(prompt + output))

    def _start_len(self, seqlen):
        r = self.rng.random()
        if r < 0.6:
            return 0
        if r < 0.9:
            return int(self.rng.integers(0, seqlen))
        return seqlen + int(self.rng.integers(0, 5))  # past the end: clamped to seqlen - 1

    def _alloc_page(self):
        if not self.free_pages:
            self._evict()
        return self.free_pages.pop(int(self.rng.integers(len(self.free_pages)))) if self.free_pages else None

    def _evict(self):
        idle = [e for e in self.cache if e.refs == 0]
        if idle:
            entry = idle[int(self.rng.integers(len(idle)))]
            self.cache.remove(entry)
            self.free_pages.extend(entry.pages)
            self.stats["evicted"] += 1

    def _admit(self, req):
        """A req_pool_idx and, perhaps, a prefix hit (page-aligned, never the whole input)."""
        if not self.free_reqs:
            return False
        req.idx = self.free_reqs.pop(0)
        req.pages, req.shared, req.done = [], None, 0
        length = req.prompt + req.outputs
        usable = [e for e in self.cache if len(e.pages) * self.page_size <= length - 1 and e.pages]
        if usable and self.rng.random() < 0.5:
            entry = usable[int(self.rng.integers(len(usable)))]
            entry.refs += 1
            req.shared = entry
            hit = len(entry.pages) * self.page_size
            self.stats["prefix_hit"] += 1
            self.req_to_token[req.idx, :hit] = self._slots_of(entry.pages, hit)
            req.done = hit
        return True

    def _slots_of(self, pages, count):
        p = self.page_size
        return np.array([pages[i // p] * p + i % p for i in range(count)], np.int64)

    def _slot_for(self, req, position):
        p = self.page_size
        first_own = 0 if req.shared is None else len(req.shared.pages)
        page = position // p
        while page - first_own >= len(req.pages):
            new = self._alloc_page()
            if new is None:
                return None
            req.pages.append(new)
        return req.pages[page - first_own] * p + position % p

    def _drop(self, req, *, cache_prefix):
        """Frees a request's KV (keeping a page-aligned prefix in the radix cache if asked)."""
        if req.shared is not None:
            req.shared.refs -= 1
        computed = req.prompt + req.outputs - 1
        own_full = max(0, computed // self.page_size - (0 if req.shared is None else len(req.shared.pages)))
        if cache_prefix and own_full > 0 and req.shared is None:  # one entry per page: never two holders
            self.cache.append(SimpleNamespace(pages=req.pages[:own_full], refs=0))
            self.free_pages.extend(req.pages[own_full:])
        else:
            self.free_pages.extend(req.pages)
        self.free_reqs.append(req.idx)
        req.idx, req.pages, req.shared = None, [], None

    def release(self, req) -> None:
        """After the driver read a finished request: SGLang's release_kv_cache."""
        self._drop(req, cache_prefix=self.rng.random() < 0.6)

    # ---- steps ----------------------------------------------------------------------------------

    def _ids(self, rows, n_rows_padded):
        """Router outputs of every MoE layer for `rows` (uid, position, epoch), padded with -1 rows."""
        uid = np.array([r[0] for r in rows], np.int64)
        pos = np.array([r[1] for r in rows], np.int64)
        epoch = np.array([r[2] for r in rows], np.int64)
        topk = {}
        for layer in self.moe_layers:
            cols = np.arange(self.top_k, dtype=np.int64)
            ids = (uid[:, None] * 131 + pos[:, None] * 31 + layer * 7 + cols[None, :] * 3 + epoch[:, None] * 17)
            ids %= self.num_experts
            width = self.top_k if (self.shared == 0 or self.rng.random() < self.routed_only_prob) else \
                self.top_k + self.shared
            out = np.full((n_rows_padded, width), -1, np.int64)
            out[: len(rows), : self.top_k] = ids
            out[: len(rows), self.top_k:] = self.num_experts + np.arange(width - self.top_k)
            self.stats["shared_columns" if width > self.top_k else "routed_columns"] += 1
            topk[layer] = out.astype(np.int64 if self.rng.random() < self.int64_prob else np.int32)
        return topk

    def steps(self, count: int):
        """Yields `count` forwards (fewer if the engine runs dry), and None where it has nothing to run
        until the driver hands back the requests it holds."""
        idle = 0
        while self.steps_made < count and idle < 50:
            if len(self.waiting) + len(self.running) < 10 and self.rng.random() < 0.7:
                self.waiting.append(self._new_request())
            step = self._prefill() if (self.waiting and (not self.running or self.rng.random() < 0.45)) else None
            if step is None:
                step = self._decode()
            if step is None:  # nothing to run: the driver catches up with the results it holds
                idle += 1
                yield None
                continue
            idle = 0
            self.steps_made += 1
            yield step

    def _prefill(self):
        rows, slots, finished = [], [], []
        budget = self.chunk
        for req in list(self.waiting):
            if budget == 0:
                break
            if req.idx is None and not self._admit(req):
                break
            length = req.prompt + req.outputs
            take = min(budget, length - req.done)
            if req.done + take > self.max_context:
                take = self.max_context - req.done
            got = 0
            for position in range(req.done, req.done + take):
                slot = self._slot_for(req, position)
                if slot is None:
                    break
                self.req_to_token[req.idx, position] = slot
                rows.append((req.uid, position, req.epoch))
                slots.append(slot)
                got += 1
            req.done += got
            budget -= got
            if req.done == length:  # the whole input went through: a token is sampled
                self.waiting.remove(req)
                req.outputs += 1
                if req.outputs >= req.target:
                    finished.append((req, Finished(req.idx, req.prompt + req.outputs, req.start_len, req.uid)))
                else:
                    self.running.append(req)
            if got < take:
                break
        if not rows:
            return None
        return self._step(rows, slots, finished, graph=False)

    def _decode(self):
        if not self.running:
            return None
        if len(self.running) > 1 and self.rng.random() < 0.08:  # retract one, it re-prefills later
            req = self.running.pop(int(self.rng.integers(len(self.running))))
            self._drop(req, cache_prefix=self.rng.random() < 0.5)
            req.epoch += 1
            self.waiting.append(req)
            self.stats["retract"] += 1
        rows, slots, finished = [], [], []
        for req in list(self.running):
            position = req.prompt + req.outputs - 1
            slot = self._slot_for(req, position) if position < self.max_context else None
            if slot is None:  # no room: it finishes here
                self.running.remove(req)
                finished.append((req, Finished(req.idx, position + 1, req.start_len, req.uid)))
                continue
            self.req_to_token[req.idx, position] = slot
            rows.append((req.uid, position, req.epoch))
            slots.append(slot)
            req.outputs += 1
            if req.outputs >= req.target:
                self.running.remove(req)
                finished.append((req, Finished(req.idx, req.prompt + req.outputs, req.start_len, req.uid)))
        if not rows:
            return Step(np.zeros(0, np.int64), 0, self._ids([], 0), None, False, finished) if finished else None
        graph = self.rng.random() < 0.5 and len(rows) <= max(self.graph_sizes)
        return self._step(rows, slots, finished, graph=graph)

    def _step(self, rows, slots, finished, *, graph):
        n = len(rows)
        padded = min(s for s in self.graph_sizes if s >= n) if graph else n
        step = Step(np.array(slots, np.int64), padded, self._ids(rows, padded), padded if graph else None,
                    graph and self.rng.random() < 0.5, finished)
        self.stats["graph"] += graph
        self.stats["padded_rows"] += padded > n
        self.stats["virtual"] += step.virtual
        self.stats["reused_slot"] += sum(1 for slot in slots if slot in self._written)
        self._written.update(slots)
        for _, f in finished:
            self.stats["start_len_clamped" if f.start_len >= f.seqlen - 1 else
                       "start_len" if f.start_len else "start_len_0"] += 1
        return step
