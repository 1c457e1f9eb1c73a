"""A plain numpy restatement of vLLM 0.33's routed-experts worker connector, the oracle the
differential tests check their harness with (the peer against it) and the library against where the
peer cannot run (no torch, or behaviour beyond upstream).

Same interface as the engine's worker connector (``begin_step``, ``prepare_output`` ->
``enqueue_cpu_copy`` / ``process_output``, ``close``, ``_capturer.capture``), same outputs, and it
fails where vLLM fails, with the exception vLLM raises there:

- a request's rows are kept by position; full blocks whose rows this request captured are filed in
  a content-addressed store under (generation, block hash) once the block's hash is known;
- the store: reference-counted keys are never evicted; unreferenced ones are evicted least recently
  used first when more are filed than fit; keys filed in the same call are spared unless released in
  it; keys released to zero are queued for eviction in release order (a finished request releases
  its blocks tail first); a read refreshes; when every key is referenced the budget doubles;
- emission: each step, a request that sampled emits from its emit cursor to the end of the rows it
  captured; rows before this step's capture come from the store (full keyed blocks) and from the
  request's incomplete block (a ``BlockObjectStoreError`` when a needed block is not stored);
- ``AssertionError`` where vLLM asserts (generation moving back, run and finish in one step, emit
  cursor ahead, capture moving back, an unbacked gap, a rejected count out of range, a first
  capture mid-block unless ``mid_block_start``, too many steps in flight, a read of rows its
  incomplete block does not hold).

With ``mid_block_start=True`` a request's first capture may start inside a block (its KV computed
elsewhere): that block is never filed, rows emit from the capture on.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np


class BlockObjectStoreError(RuntimeError):
    """A block the output needs is not in the store."""


class Store:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("the store must hold at least one block")
        self.capacity = capacity
        self.blocks: dict[object, np.ndarray | None] = {}  # filed or retained-only (None)
        self.lru: OrderedDict[object, None] = OrderedDict()  # unreferenced filed keys, oldest first
        self.refs: dict[object, int] = {}
        self.grew = 0
        self.closed = False

    def put(self, objects: list[tuple[object, np.ndarray]], retain=(), release=()) -> None:
        if self.closed:
            raise RuntimeError("store closed")
        new = dict(objects)
        for key in new.keys() & self.lru.keys():  # an unreferenced key filed again counts as new
            del self.lru[key]
            del self.blocks[key]
        for key in retain:
            if not self.refs.get(key):
                self.lru.pop(key, None)
            self.refs[key] = self.refs.get(key, 0) + 1
        terminal = []
        for key in release:
            self.refs[key] -= 1
            if self.refs[key]:
                continue
            del self.refs[key]
            if key in self.blocks:
                self.lru[key] = None
            terminal.append(key)
        for key in new:
            if key not in self.blocks:
                self.blocks[key] = None
            if key not in self.refs:
                self.lru[key] = None
                self.lru.move_to_end(key)
        for key in terminal:
            if key in self.lru:
                self.lru.move_to_end(key)
        spared = set(new) - set(terminal)
        excess = len(self.blocks) - self.capacity
        if excess > 0:
            victims = [key for key in self.lru if key not in spared][:excess]
            for key in victims:
                del self.lru[key]
                del self.blocks[key]
        if len(self.blocks) > self.capacity:
            self.capacity = max(len(self.blocks), 2 * self.capacity)
            self.grew += 1
        for key, rows in new.items():
            if key in self.blocks and self.blocks[key] is None:  # not if evicted in this very call
                self.blocks[key] = rows.copy()

    def get(self, keys: list) -> np.ndarray:
        if self.closed:
            raise RuntimeError("store closed")
        try:
            rows = [self.blocks[key] for key in keys]
        except KeyError as error:
            raise BlockObjectStoreError(f"block {error.args[0]!r} is not stored (evicted)") from None
        for key in keys:
            if key in self.lru:
                self.lru.move_to_end(key)
        return np.concatenate(rows)


class Capturer:
    def __init__(self, max_tokens: int, num_layers: int, top_k: int, num_experts: int) -> None:
        self.buffer = np.zeros((max_tokens, num_layers, top_k), dtype=np.int32)
        self.shape_per_token = (num_layers, top_k)
        self.output_dtype_name = "uint8" if num_experts <= 256 else "uint16"

    def capture(self, layer_id: int, topk_ids) -> None:
        if not 0 <= layer_id < self.buffer.shape[1]:
            raise IndexError(f"layer {layer_id}")
        ids = np.asarray(topk_ids.cpu() if hasattr(topk_ids, "cpu") else topk_ids)
        self.buffer[:len(ids), layer_id] = ids

    def snapshot_routing_data(self, num_tokens: int) -> np.ndarray:
        return self.buffer[:num_tokens].astype(self.output_dtype_name)


@dataclass
class _State:
    keys: list = field(default_factory=list)
    rows: dict = field(default_factory=dict)  # position -> row
    first: int | None = None  # first captured position
    filed: set = field(default_factory=set)  # block indices filed by this request
    capture_cursor: int | None = None
    scheduled_cursor: int = 0
    emit_cursor: int = 0
    pending_outputs: int = 0
    finished: bool = False


class Pending:
    def __init__(self, connector, req_ids, token_starts, query_start_loc, snapshot) -> None:
        self.connector = connector
        self.request_ids = req_ids
        self.token_starts = token_starts
        self.query_start_loc = query_start_loc
        self.snapshot = snapshot
        self.num_sampled = self.num_rejected = None

    def enqueue_cpu_copy(self, num_sampled, num_rejected) -> None:
        self.num_sampled = np.asarray(num_sampled)
        self.num_rejected = np.asarray(num_rejected)

    def process_output(self):
        return self.connector.process_output(self)


class ReferenceConnector:
    def __init__(self, num_layers, num_experts, top_k, max_num_batched_tokens, max_num_seqs, *,
                 block_size=16, num_kv_blocks=65536, max_concurrent_batches=2, max_bytes=None,
                 mid_block_start=False, output_type=None) -> None:
        self._capturer = Capturer(max_num_batched_tokens, num_layers, top_k, num_experts)
        self.dtype = np.dtype(self._capturer.output_dtype_name)
        self.block_size = block_size
        block_nbytes = block_size * num_layers * top_k * self.dtype.itemsize
        if max_bytes is None:
            max_bytes = num_kv_blocks * block_nbytes
        self.store = Store(max_bytes // block_nbytes)
        self.max_concurrent_batches = max_concurrent_batches
        self.mid_block_start = mid_block_start
        self.output_type = output_type or (lambda token_start, rows: SimpleNamespace(token_start=token_start, rows=rows))
        self.requests: dict[str, _State] = {}
        self.generation = 0
        self.meta = None
        self.pending: list[Pending] = []
        self.counts = {"store_read": 0, "deferred_teardown": 0, "gap_reattach": 0}

    # -- filing -----------------------------------------------------------------------------------
    def _ready_blocks(self, state: _State) -> list[tuple[object, np.ndarray]]:
        """Blocks this request captured in full, keyed and not yet filed, in position order."""
        if state.first is None or state.capture_cursor is None:
            return []
        b = self.block_size
        out = []
        for index in range(-(-state.first // b), min(state.capture_cursor // b, len(state.keys))):
            if index not in state.filed:
                state.filed.add(index)
                out.append((state.keys[index], np.stack([state.rows[p] for p in range(index * b, (index + 1) * b)])))
        return out

    # -- the step ---------------------------------------------------------------------------------
    def begin_step(self, metadata) -> None:
        self.meta = metadata
        if metadata is None:
            return
        assert not metadata.requests.keys() & set(metadata.finished_requests), "run and finish in one step"
        assert metadata.generation >= self.generation, "generation moved backwards"
        old = self.generation
        retain = [(old, h) for h in (metadata.retained_block_hashes or ())]
        release = [(old, h) for h in (metadata.released_block_hashes or ())]
        if metadata.generation > self.generation:
            assert not self.pending, "generation changed with output in flight"
            for state in self.requests.values():
                release.extend(reversed(state.keys))
            self.requests.clear()
            self.generation = metadata.generation
        for rid, emit_start in metadata.requests.items():
            state = self.requests.setdefault(rid, _State(emit_cursor=int(emit_start)))
            if state.pending_outputs == 0:
                assert emit_start <= state.emit_cursor, "emit cursor moved ahead"
        objects = []
        for rid, hashes in metadata.block_hashes.items():
            state = self.requests[rid]
            keys = [(self.generation, bytes(h)) for h in hashes]
            state.keys.extend(keys)
            retain.extend(keys)
            objects.extend(self._ready_blocks(state))
        done = []
        for rid in metadata.finished_requests:
            state = self.requests[rid]
            state.finished = True
            if state.pending_outputs:
                self.counts["deferred_teardown"] += 1
                continue
            done.append(rid)
            release.extend(reversed(state.keys))
        if objects or retain or release:
            self.store.put(objects, retain, release)
        for rid in done:
            del self.requests[rid]

    def prepare_output(self, input_batch):
        if self.meta is None:
            return None
        req_ids = list(input_batch.req_ids)
        qsl = np.asarray(input_batch.query_start_loc_np)[:len(req_ids) + 1]
        pending = Pending(self, req_ids, np.asarray(input_batch.num_computed_tokens_np), qsl,
                          self._capturer.snapshot_routing_data(int(qsl[-1])))
        assert len(self.pending) < self.max_concurrent_batches, "outputs not consumed in order"
        self.pending.append(pending)
        for rid in req_ids:
            self.requests[rid].pending_outputs += 1
        return pending

    def process_output(self, pending: Pending):
        release, done = [], []
        try:
            outputs = self._commit(pending)
        finally:
            self.pending.remove(pending)
            for rid in pending.request_ids:
                state = self.requests[rid]
                state.pending_outputs -= 1
                if state.pending_outputs == 0 and state.finished:
                    done.append(rid)
                    release.extend(reversed(state.keys))
        if done:  # a finish that arrived while this step was in flight completes now
            self.store.put([], (), release)
            for rid in done:
                del self.requests[rid]
        return outputs

    def _commit(self, pending: Pending):
        b = self.block_size
        assert pending.num_sampled is not None, "copy not enqueued"
        outputs, later, objects = {}, [], []
        qsl = pending.query_start_loc
        for i, rid in enumerate(pending.request_ids):
            start, end = int(qsl[i]), int(qsl[i + 1])
            n = end - start
            assert n > 0, "request without tokens"
            state = self.requests[rid]
            rejected = int(pending.num_rejected[i])
            assert 0 <= rejected <= n, "rejected count out of range"
            rows = pending.snapshot[start:end - rejected]
            token_start = int(pending.token_starts[i])
            capture_start = token_start
            cursor = state.capture_cursor if state.capture_cursor is not None else capture_start
            assert capture_start >= cursor, "capture moved backwards"
            if capture_start > cursor:
                assert cursor < state.scheduled_cursor, "unbacked gap"
                capture_start = cursor
                self.counts["gap_reattach"] += 1
            if state.first is None:
                assert self.mid_block_start or capture_start % b == 0, "first capture starts mid-block"
                state.first = capture_start
            for j in range(len(rows)):
                state.rows[capture_start + j] = rows[j]
            token_end = capture_start + len(rows)
            state.capture_cursor = token_end
            state.scheduled_cursor = token_start + n
            objects.extend(self._ready_blocks(state))
            emit = state.emit_cursor
            if pending.num_sampled[i] > 0 and emit <= token_end:
                if emit >= capture_start:
                    outputs[rid] = self.output_type(emit, rows[emit - capture_start:])
                    state.emit_cursor = token_end
                else:
                    later.append((rid, emit, token_end))
        if objects:
            self.store.put(objects)
        for rid, emit, token_end in later:
            state = self.requests[rid]
            self.counts["store_read"] += 1
            stored_end = min(token_end // b, len(state.keys)) * b
            parts = []
            if emit < stored_end:
                stored = self.store.get(state.keys[emit // b:stored_end // b])
                parts.append(stored[emit % b:emit % b + stored_end - emit])
                tail_from = stored_end
            else:
                tail_from = emit
            if tail_from < token_end:
                # only the request's incomplete block can serve rows past the stored ones
                tail_block = (state.capture_cursor // b) * b
                assert state.capture_cursor % b and tail_from >= max(tail_block, state.first), "rows unavailable"
                parts.append(np.stack([state.rows[p] for p in range(tail_from, token_end)]))
            out = np.concatenate(parts) if len(parts) > 1 else parts[0]
            outputs[rid] = self.output_type(emit, np.ascontiguousarray(out, dtype=self.dtype))
            state.emit_cursor = token_end
        return outputs

    def close(self) -> None:
        self.pending.clear()
        self.store.closed = True
