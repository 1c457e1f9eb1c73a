"""A small randomized engine driving a Replay, and the plain reference it is checked against.

The engine admits requests (some do not ask for routing: their rows are skipped), runs chunked
prefill and decode with speculative drafts (accepted or rejected after the step), allocates KV
blocks (declared fresh; needed by block_slot storage), finishes requests (extracted, then
released) and aborts some. Every step's routing is random, so a row stored at the wrong position,
from the wrong step or for the wrong request cannot pass. The reference is a dict per request:
position -> [L, K] ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import routing_replay as rr

SOURCE_DTYPES = (np.int64, np.int32, np.int16, np.uint8, np.int8, np.uint16, np.uint32, np.uint64)


@dataclass
class Request:
    rid: object
    prompt: int
    target: int
    opted_in: bool
    next_pos: int = 0
    blocks: list[int] = field(default_factory=list)


class Engine:
    """Randomized steps against one replay; `check_finished` compares every extraction."""

    def __init__(self, replay: rr.Replay, device, seed: int, *, num_experts: int, moe_layers, num_model_layers: int,
                 top_k: int, shared: int, max_tokens: int, max_len: int, block_size: int = 0, num_blocks: int = 0,
                 drafts: bool = True) -> None:
        self.replay = replay
        self.device = device
        self.rng = np.random.default_rng(seed)
        self.E, self.K, self.S = num_experts, top_k, shared
        self.moe_layers = list(moe_layers)
        self.L = len(self.moe_layers)
        self.num_model_layers = num_model_layers
        self.max_tokens, self.max_len = max_tokens, max_len
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks))
        self.block_slot = replay.policies["storage"] == "block_slot"
        self.drafts = drafts
        self.requests: dict[object, Request] = {}
        self.reference: dict[object, dict[int, np.ndarray]] = {}
        self.next_id = 0
        self.checked = 0
        self.plan = rr.StepPlan()

    # ---- requests ---------------------------------------------------------------------------

    def admit(self) -> None:
        rid = f"req-{self.next_id}" if self.next_id % 2 == 0 else self.next_id
        self.next_id += 1
        prompt = int(self.rng.integers(1, 12))
        target = min(self.max_len - 1, prompt + int(self.rng.integers(1, 10)))
        opted = bool(self.rng.random() < 0.8)
        self.requests[rid] = Request(rid, prompt, target, opted)
        if opted:
            self.replay.add_request(rid, prompt_length=prompt)
            self.reference[rid] = {}

    def slots_for(self, r: Request, first: int, n: int, fresh: list[int]) -> list[int]:
        while len(r.blocks) * self.block_size < first + n:
            block = self.free_blocks.pop(0)
            r.blocks.append(block)
            fresh.append(block)
        return [r.blocks[p // self.block_size] * self.block_size + p % self.block_size for p in range(first, first + n)]

    def finish(self, r: Request, abort: bool) -> None:
        del self.requests[r.rid]
        if self.block_size:
            self.free_blocks.extend(r.blocks)
        if not r.opted_in:
            return
        expected = self.reference.pop(r.rid)
        if abort:
            self.replay.abort(r.rid)
            return
        got = self.replay.extract(r.rid)
        self.compare(r.rid, got, expected)
        del got  # a zero-copy view would refuse the release
        self.replay.release(r.rid)
        self.checked += 1

    def compare(self, rid, got: np.ndarray, expected: dict[int, np.ndarray]) -> None:
        T = max(expected) + 1 if expected else 0
        assert got.shape == (T, self.L, self.K), (rid, got.shape, T)
        assert got.dtype == self.replay.index_dtype
        want = np.full((T, self.L, self.K), self.replay.sentinel, dtype=got.dtype)
        for position, row in expected.items():
            want[position] = row
        np.testing.assert_array_equal(got, want, err_msg=f"request {rid!r}")

    # ---- steps ------------------------------------------------------------------------------

    def step(self, step_index: int) -> None:
        if len(self.requests) < 4 and self.rng.random() < 0.7:
            self.admit()
        self.plan.clear()
        fresh: list[int] = []
        runs = []  # (request, first, n, drafts)
        rows = 0
        for r in list(self.requests.values()):
            if r.next_pos < r.prompt:
                n, d = min(r.prompt - r.next_pos, int(self.rng.integers(1, 6))), 0
            else:
                d = int(self.rng.integers(0, 3)) if (self.drafts and r.opted_in) else 0
                d = min(d, self.max_len - 1 - r.next_pos)
                n = 1 + d
            if rows + n > self.max_tokens:
                break
            if r.opted_in:
                slots = self.slots_for(r, r.next_pos, n, fresh) if self.block_slot else None
                self.plan.schedule(r.rid, r.next_pos, n, d, slots)
            else:
                if self.block_slot:
                    self.slots_for(r, r.next_pos, n, fresh)
                self.plan.skip(n)
            runs.append((r, r.next_pos, n, d))
            rows += n
        if fresh:
            self.plan.add_fresh_blocks(fresh)
        routing = self.rng.integers(0, self.E, size=(rows, self.L, self.K), dtype=np.int64)

        self.replay.begin_step(self.plan)
        for i, layer in enumerate(self.moe_layers):
            self.capture(step_index, i, layer, routing[:, i, :])
        self.replay.end_step()

        row = 0
        for r, first, n, d in runs:
            committed = n - d
            accepted = int(self.rng.integers(0, d + 1)) if d else 0
            if r.opted_in:
                for t in range(committed + accepted):
                    self.reference[r.rid][first + t] = routing[row + t]
                if d:
                    self.replay.accept_draft(r.rid, accepted)
            r.next_pos = first + committed + accepted
            row += n
        for r in list(self.requests.values()):
            if r.next_pos >= r.target:
                self.finish(r, abort=False)
            elif self.rng.random() < 0.03:
                self.finish(r, abort=True)

    def capture(self, step_index: int, i: int, layer: int, ids: np.ndarray) -> None:
        """One layer's router output, [N, K + S] with garbage shared-expert columns, in a dtype that
        changes with the layer and step, sometimes a column window of a wider array."""
        n = ids.shape[0]
        dtype = SOURCE_DTYPES[(step_index + i) % len(SOURCE_DTYPES)]
        wide = np.full((n, self.K + self.S + 2), self.E + 7, dtype=np.int64)
        wide[:, : self.K] = ids
        source = wide[:, : self.K + self.S] if (step_index + i) % 3 == 0 else np.ascontiguousarray(wide[:, : self.K + self.S])
        array = source.astype(dtype, copy=False) if source.dtype != dtype else source
        if self.device.backend == "host":
            self.replay.capture(layer, array)
        else:
            self.replay.capture(layer, self.device.array(np.ascontiguousarray(array)))

    def run(self, steps: int) -> None:
        for s in range(steps):
            self.step(s)
        for r in list(self.requests.values()):
            self.finish(r, abort=False)
