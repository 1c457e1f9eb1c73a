"""The engine loop both Python examples share: a left-padded batch of requests, one prefill step
and greedy decode steps, with the routing_replay step plan of each, and the reference the
captured routing is checked against.

A left-padded batch [B, T] flattens row-major, so row b * T + t of a step is token t of request b.
Padding tokens go through the router too (every layer must write every row of a step), so the plan
skips them, as it skips requests that did not ask for their routing.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import numpy as np

import routing_replay as rr


def add_arguments(parser: argparse.ArgumentParser, requests: int, new_tokens: int) -> None:
    """The options both examples take: output, batch size, tokens, seed and the policies."""
    parser.add_argument("--out", default=None, help="directory for request_<id>.npy files")
    parser.add_argument("--requests", type=int, default=requests)
    parser.add_argument("--new-tokens", type=int, default=new_tokens)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--index", default="int16", choices=rr.INDEX_TYPES)
    parser.add_argument("--layout", default="layer_major", choices=rr.LAYOUTS)
    parser.add_argument("--copy", default="double_buffered", choices=rr.COPY_STRATEGIES)
    parser.add_argument("--storage", default="per_request", choices=rr.STORAGES)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, attention mask, positions), each [B, T]: prompts right-aligned, positions counting
    from each prompt's first token (0 on padding)."""
    width = max(len(p) for p in prompts)
    tokens = np.full((len(prompts), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for b, p in enumerate(prompts):
        tokens[b, width - len(p):] = p
        mask[b, width - len(p):] = 1
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    return tokens, mask, positions


class PaddedBatch:
    """Step plans and a routing reference for one left-padded batch.

    `opted_in[b]` says whether request b asked for its routing; the others are skipped like padding.
    """

    def __init__(self, request_ids: Sequence[object], prompt_lengths: Sequence[int], opted_in: Sequence[bool], *,
                 block_size: int = 0, max_len: int = 0):
        self.block_size = block_size
        # block_slot storage: request b owns blocks [b * blocks_per_request, (b + 1) * blocks_per_request)
        self.blocks_per_request = -(-max_len // block_size) if block_size else 0
        self.ids = list(request_ids)
        self.lengths = list(prompt_lengths)
        self.opted_in = list(opted_in)
        self.width = max(self.lengths)
        self.plan = rr.StepPlan()
        self.rows: list[tuple[int, int] | None] = []  # row of the step -> (request, position)
        # (request index, position) -> {layer slot: top-k ids}
        self.reference: dict[tuple[int, int], dict[int, np.ndarray]] = {}

    def add_requests(self, target) -> None:
        """Registers the requests that asked for their routing with a Replay."""
        for rid, n, wanted in zip(self.ids, self.lengths, self.opted_in):
            if wanted:
                target.add_request(rid, prompt_length=n)

    def prefill(self) -> rr.StepPlan:
        """The plan of the prefill step (all prompts, padding skipped)."""
        self.plan.clear()
        self.rows = []
        if self.block_size:
            self.plan.add_fresh_blocks(range(len(self.ids) * self.blocks_per_request))
        for b, n in enumerate(self.lengths):
            pad = self.width - n
            if pad:
                self.plan.skip(pad)
            self._schedule(b, 0, n)
            self.rows += [None] * pad + [(b, p) for p in range(n)]
        return self.plan

    def decode(self, step: int) -> rr.StepPlan:
        """The plan of decode step `step` (0-based): one token per request, at position length + step."""
        self.plan.clear()
        self.rows = []
        for b, n in enumerate(self.lengths):
            self._schedule(b, n + step, 1)
            self.rows.append((b, n + step))
        return self.plan

    def _schedule(self, b: int, first: int, n: int) -> None:
        if not self.opted_in[b]:
            self.plan.skip(n)
            return
        slots = None
        if self.block_size:
            base = b * self.blocks_per_request * self.block_size
            slots = [base + p for p in range(first, first + n)]  # consecutive blocks: slot = base + position
        self.plan.schedule(self.ids[b], first, n, slots=slots)

    @property
    def num_blocks(self) -> int:
        """KV blocks the batch needs (block_slot storage)."""
        return len(self.ids) * self.blocks_per_request

    def record(self, layer_slot: int, topk: np.ndarray) -> None:
        """Notes the reference routing of one layer this step: `topk` [rows, K], the top-k of the
        layer's router logits, computed by the caller from the logits alone."""
        for row, owner in enumerate(self.rows):
            if owner is not None:
                self.reference.setdefault(owner, {})[layer_slot] = topk[row]

    def expected(self, b: int, num_layers: int) -> np.ndarray:
        """Request b's reference routing, [T, L, K], over the positions the model computed."""
        positions = sorted(p for (r, p) in self.reference if r == b)
        assert positions == list(range(len(positions)))
        return np.stack([np.stack([self.reference[(b, p)][l] for l in range(num_layers)]) for p in positions])

    def collect(self, replay: rr.Replay, out_dir: str | None) -> dict[object, np.ndarray]:
        """Every opted-in request's routing (checked against its base64 `routed_experts` field),
        written to `out_dir` as request_<id>.npy when given; the requests are released."""
        results = {}
        for rid, wanted in zip(self.ids, self.opted_in):
            if not wanted:
                continue
            results[rid] = replay.extract(rid, copy=True)
            assert np.array_equal(rr.from_base64_npy(replay.extract_base64_npy(rid)), results[rid])
            if out_dir:
                os.makedirs(out_dir, exist_ok=True)
                replay.write_npy(rid, os.path.join(out_dir, f"request_{rid}.npy"))
            replay.release(rid)
        return results

    def make_replay(self, args: argparse.Namespace, *, num_experts: int, top_k: int, moe_layers: Sequence[int],
                    num_model_layers: int, device: str) -> rr.Replay:
        """A Replay for this batch with the policies of the command line, its requests added."""
        replay = rr.Replay(num_experts=num_experts, top_k=top_k, max_tokens_per_step=len(self.ids) * self.width,
                           max_model_len=max(self.lengths) + args.new_tokens, moe_layers=moe_layers,
                           num_model_layers=num_model_layers, device=device, index=args.index, layout=args.layout,
                           copy=args.copy, storage=args.storage, block_size=self.block_size,
                           num_blocks=self.num_blocks)
        self.add_requests(replay)
        return replay

    def run(self, replay: rr.Replay, generate, args: argparse.Namespace) -> int:
        """Generates without and with capture (`generate(replay, batch)` returns the tokens), checks
        that the tokens are the same and that the routing is the routers' top-k, writes the files."""
        plain = generate(None, None)
        captured = generate(replay, self)
        if not np.array_equal(plain, captured):
            raise AssertionError("capture changed the generated tokens")
        results = self.collect(replay, args.out)
        rows = self.check(results, replay.num_layers)
        print(f"{replay!r}: {len(results)} requests, {rows} rows of [{replay.num_layers}, {replay.top_k}] routing "
              f"bit-exact with the routers' top-k; {args.new_tokens} generated tokens per request unchanged by "
              "capture")
        return 0

    def check(self, results: dict[object, np.ndarray], num_layers: int) -> int:
        """Compares every opted-in request's routing with the reference; returns rows checked."""
        rows = 0
        for b, rid in enumerate(self.ids):
            if not self.opted_in[b]:
                assert rid not in results
                continue
            want = self.expected(b, num_layers)
            got = results[rid]
            if got.shape != want.shape or not np.array_equal(got, want):
                bad = np.argwhere(got != want)[:5] if got.shape == want.shape else "shape"
                raise AssertionError(f"request {rid!r}: routing {got.shape} differs from the router's top-k "
                                     f"{want.shape} at {bad}")
            rows += len(got)
        return rows
