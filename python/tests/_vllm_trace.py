"""Seeded traces of vLLM 0.33's engine driving its routed-experts worker connector.

A small engine stands in for vLLM's scheduler, KV cache and model runner. It decides, step by step,
what vLLM would send to the worker connector and what the worker would see:

- the scheduler side: requests admitted under a token budget and a seat limit, chunked prefill,
  decode with speculative drafts, prefix-cache hits on equal KV block hashes, multi-turn
  conversations (each turn a new request whose prompt is the whole conversation so far), requests
  stopping early or at max_tokens, prefix-cache resets while idle;
- the connector metadata of every step, built as vLLM 0.33's ``AuxOutputSchedulerConnector``
  builds it (``_vllm_scheduler`` restates its rules: the per-request emit start, block hashes only
  for blocks whose tokens are computed and known, hash-only updates for requests not rescheduled,
  one-shot finish events, retained and released hashes of blocks the KV cache holds, the
  generation bump after a reset);
- asynchronous scheduling: up to ``max_concurrent_batches`` steps in flight, the next step
  scheduled on the optimistic view (all drafts accepted) before the previous output is known; the
  device runs at the true positions, so after a rejection the step's ``num_computed_tokens`` runs
  ahead of the rows it computed; the worker's output thread may consume a step's output before or
  after the next step begins;
- the forward: per layer the router's top-k ids in batch order, a pure function of the content
  before the position (a rolling hash of the tokens), the layer and k, so equal prefixes have equal
  rows and every emitted row can be checked; rows of rejected drafts come from a different content
  and must never be emitted; sometimes a batch padded as CUDA graphs pad it.

A trace is a list of events, ``Begin`` (begin_step), ``Forward`` (capture, prepare_output,
enqueue_cpu_copy) and ``Process`` (process_output), replayed identically through every
implementation by ``_vllm_harness``. ``Trace.truth`` holds, per request, the rows of every position
the device computed and accepted: every emitted ``AuxRequestOutput`` must equal a slice of it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from _vllm_scheduler import KVPool, Meta, Request, SchedulerConnectorModel, content_hash

def routing_rows(hashes, num_layers: int, top_k: int, num_experts: int) -> np.ndarray:
    """The router's ids [n, L, K] (int64) for positions with these content hashes."""
    h = np.asarray(hashes, dtype=np.uint64).reshape(-1, 1, 1)
    layer = np.arange(num_layers, dtype=np.uint64).reshape(1, -1, 1)
    k = np.arange(top_k, dtype=np.uint64).reshape(1, 1, -1)
    with np.errstate(over="ignore"):
        x = h ^ (layer * np.uint64(0x9E3779B97F4A7C15)) ^ (k * np.uint64(0xC2B2AE3D27D4EB4F))
        x = (x ^ (x >> np.uint64(31))) * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(29))
    return (x % np.uint64(num_experts)).astype(np.int64)


@dataclass
class TraceConfig:
    """The engine's shape and the connector's construction arguments for one trace."""

    seed: int
    num_layers: int = 2
    top_k: int = 2
    num_experts: int = 24
    block_size: int = 4
    max_num_batched_tokens: int = 32
    max_num_seqs: int = 8
    max_concurrent_batches: int = 2
    num_kv_blocks: int = 64
    store_blocks: int | None = None  # the store's byte budget in blocks; None: vLLM's default
    num_spec: int = 0  # draft tokens per decode step (at most)
    retain: bool = True  # the scheduler retains/releases the blocks the KV cache holds
    hash_size: int = 32
    remote_prefill: bool = False  # some requests start with KV computed elsewhere (P/D)
    padding: bool = True  # some forwards carry CUDA-graph padding rows
    hits_first: bool = False  # every prompt shares one prefix and most emit from token 0

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8 if self.num_experts <= 256 else np.uint16)

    @property
    def block_nbytes(self) -> int:
        return self.block_size * self.num_layers * self.top_k * self.dtype.itemsize

    @property
    def max_bytes(self) -> int | None:
        return None if self.store_blocks is None else self.store_blocks * self.block_nbytes

    def connector_kwargs(self) -> dict:
        """The keyword arguments of ``make_worker_connector`` past its five positional ones."""
        return dict(block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
                    max_concurrent_batches=self.max_concurrent_batches, max_bytes=self.max_bytes)

    def connector_args(self) -> tuple:
        return (self.num_layers, self.num_experts, self.top_k, self.max_num_batched_tokens, self.max_num_seqs)


@dataclass
class Begin:
    step: int
    meta: Meta | None  # None: an internal step without metadata (warm-up)


@dataclass
class Forward:
    step: int
    req_ids: list[str]
    query_start_loc: np.ndarray  # int32 [n + 1 (+ padding)]
    num_computed_tokens: np.ndarray  # int32 [n], the scheduler's (optimistic) view
    ids: np.ndarray  # int64 [rows (+ padding), L, K], the router's output in batch order
    num_sampled: np.ndarray  # int32 [n]
    num_rejected: np.ndarray  # int32 [n]


@dataclass
class Process:
    step: int


@dataclass
class Trace:
    config: TraceConfig
    events: list
    truth: dict[str, np.ndarray]  # request -> rows [computed positions, L, K] (int64)
    features: set[str]


def random_config(seed: int) -> TraceConfig:
    """A trace's engine shape, drawn from its seed."""
    rng = np.random.default_rng([seed, 1])
    block = int(rng.choice([4, 4, 8, 16]))
    cfg = TraceConfig(
        seed=seed,
        num_layers=int(rng.choice([1, 2, 3])),
        top_k=int(rng.choice([1, 2, 2])),
        num_experts=int(rng.choice([8, 24, 128, 256, 257, 300])),
        block_size=block,
        max_num_batched_tokens=int(rng.choice([2, 4, 8])) * block,
        max_num_seqs=16,
        max_concurrent_batches=int(rng.choice([1, 2, 2])),
        num_kv_blocks=int(rng.choice([24, 48, 96])),
        num_spec=int(rng.choice([0, 0, 1, 3])),
        hash_size=int(rng.choice([32, 32, 16])),
        padding=bool(rng.random() < 0.5),
    )
    u = rng.random()
    if u < 0.2:  # a small store, retention withheld: prefix hits read blocks the store evicted
        cfg.store_blocks = int(rng.integers(2, 6))
        cfg.retain = False
        cfg.hits_first = True
    elif u < 0.35:  # a small store that must grow: every block it holds is referenced
        cfg.store_blocks = int(rng.integers(2, 10))
    return cfg


class Engine:
    """Runs one trace: requests arrive, are scheduled, executed and consumed; events recorded."""

    def __init__(self, cfg: TraceConfig, *, requests: int | None = None, max_steps: int = 200,
                 metadata_builder=None) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng([cfg.seed, 2])
        self.pool = KVPool(cfg.num_kv_blocks)
        self.connector = (metadata_builder(self.pool) if metadata_builder is not None else
                          SchedulerConnectorModel(cfg.block_size, self.pool, cfg.num_kv_blocks, retain=cfg.retain))
        self.max_steps = max_steps
        self.events: list = []
        self.features: set[str] = set()
        self.requests: dict[str, Request] = {}  # unfinished, known to the scheduler
        self.all_requests: dict[str, Request] = {}
        self.waiting: list[tuple[int, Request]] = []
        self.running: list[Request] = []
        self.in_flight: deque = deque()
        self.step = 0
        self.next_id = 0
        self.followups: list[tuple[int, int, Request]] = []  # (arrival step, conversation, prev turn)
        self.num_requests = requests if requests is not None else int(self.rng.integers(3, 12))
        low, high = (2 * cfg.block_size, 5 * cfg.block_size) if cfg.hits_first else (0, 4 * cfg.block_size + 3)
        self.system_prompts = [self._tokens(int(self.rng.integers(low, high))) for _ in range(3)]
        self.reset_pending = False

    # -- requests ---------------------------------------------------------------------------------
    def _tokens(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(0, 50_000, size=n)]

    def _new_request(self, prompt: list[int], *, prompt_start: int, external: int = 0,
                     conversation: int | None = None) -> Request:
        rid = f"req-{self.next_id}"
        self.next_id += 1
        max_tokens = int(self.rng.integers(1, 14))
        stop = int(self.rng.integers(0, max_tokens)) if self.rng.random() < 0.3 else None
        r = Request(rid, prompt, prompt_start=prompt_start, max_tokens=max_tokens, stop_index=stop,
                    block_size=self.cfg.block_size, hash_size=self.cfg.hash_size, external=external,
                    conversation=conversation)
        self.all_requests[rid] = r
        return r

    def _prompt_start(self, prompt_len: int, turn_start: int) -> int:
        u = self.rng.random()
        if self.cfg.hits_first and u < 0.8:
            return 0
        if u < 0.35:
            return 0
        if u < 0.55:
            return turn_start
        if u < 0.75:
            return int(self.rng.integers(0, prompt_len + 1))
        if u < 0.85:
            return prompt_len + int(self.rng.integers(0, 5))  # past the prompt: generated rows only
        return turn_start + int(self.rng.integers(0, 3))

    def _arrivals(self) -> None:
        cfg = self.cfg
        rate = 0.2 if cfg.hits_first else 0.5  # gaps let a small store evict a shared prefix
        while self.num_requests > 0 and self.rng.random() < rate:
            self.num_requests -= 1
            u = self.rng.random()
            if cfg.remote_prefill and u < 0.5:
                prompt = self._tokens(int(self.rng.integers(2, 5 * cfg.block_size)))
                if self.rng.random() < 0.2:
                    prompt = self.system_prompts[0] + prompt
                external = int(self.rng.integers(1, len(prompt)))
                r = self._new_request(prompt, prompt_start=external, external=external)
                self.features.add("remote_prefill")
            elif u < 0.3:  # a conversation: later turns arrive after this one finishes
                prompt = self._tokens(int(self.rng.integers(1, 3 * cfg.block_size)))
                r = self._new_request(prompt, prompt_start=self._prompt_start(len(prompt), 0),
                                      conversation=int(self.rng.integers(1, 4)))
            else:
                which = int(self.rng.integers(0, 2 if cfg.hits_first else len(self.system_prompts)))
                system = self.system_prompts[which]
                prompt = system + self._tokens(int(self.rng.integers(1, 3 * cfg.block_size)))
                r = self._new_request(prompt, prompt_start=self._prompt_start(len(prompt), len(system)))
            self._enqueue(r)
        for entry in list(self.followups):
            arrival, turns_left, previous = entry
            if arrival <= self.step:
                self.followups.remove(entry)
                history = previous.all_token_ids
                prompt = history + self._tokens(int(self.rng.integers(1, 2 * cfg.block_size)))
                r = self._new_request(prompt, prompt_start=self._prompt_start(len(prompt), len(history)),
                                      conversation=turns_left - 1)
                self.features.add("multi_turn")
                self._enqueue(r)

    def _enqueue(self, r: Request) -> None:
        cfg = self.cfg
        blocks = -(-(r.num_prompt_tokens + r.max_tokens + cfg.num_spec + 2) // cfg.block_size)
        if blocks <= cfg.num_kv_blocks // 2:  # longer ones vLLM would refuse; here they are dropped
            self.waiting.append((self.step, r))

    # -- scheduling -------------------------------------------------------------------------------
    def _admit(self, r: Request, budget: int) -> int:
        """KV blocks for a new request, its prefix hit; the tokens of its first chunk (0: wait)."""
        cfg = self.cfg
        b = cfg.block_size
        reserve = -(-(r.num_prompt_tokens + r.max_tokens + cfg.num_spec + 2) // b)
        if r.external:
            hit_blocks = 0
            computed = r.external
        else:
            usable = r.block_hashes[:(r.num_tokens - 1) // b]
            hit_blocks = self.pool.hits(usable)
            computed = hit_blocks * b
        slots = self.pool.allocate(r.block_hashes[:hit_blocks], reserve - hit_blocks)
        if slots is None:
            return 0
        r.kv_slots = slots
        if r.external:  # the loaded blocks are cached as they arrive
            for i, h in enumerate(r.block_hashes[:computed // b]):
                self.pool.cache(slots[i], h)
        if computed:
            self.features.add("prefix_hit" if not r.external else "remote_prefill")
        r.num_computed_tokens = computed
        r.dev_computed = computed
        return self._chunk(r.num_prompt_tokens - computed, budget)

    def _chunk(self, remaining: int, budget: int) -> int:
        cap = int(self.rng.choice([self.cfg.block_size - 1, self.cfg.block_size, 2 * self.cfg.block_size + 3,
                                   1 << 30, 1 << 30]))
        return max(0, min(remaining, budget, max(cap, 1)))

    def _schedule(self) -> tuple[dict[str, int], Meta]:
        cfg = self.cfg
        budget = cfg.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        for r in self.running:
            if budget <= 0:
                break
            if r.num_computed_tokens < r.num_prompt_tokens:
                n = self._chunk(r.num_prompt_tokens - r.num_computed_tokens, budget)
            else:
                if r.num_output_tokens + r.placeholders >= r.max_tokens:
                    continue
                drafts = int(self.rng.integers(0, cfg.num_spec + 1)) if cfg.num_spec else 0
                n = min(1 + drafts, budget)
            if n > 0 and self.rng.random() < 0.93:  # now and then a running request waits a step
                scheduled[r.request_id] = n
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            arrival, r = self.waiting[0]
            n = self._admit(r, budget)
            if n == 0:
                break
            self.waiting.pop(0)
            self.running.append(r)
            self.requests[r.request_id] = r
            scheduled[r.request_id] = n
            budget -= n
        meta = self.connector.build(scheduled, self.requests)
        return scheduled, meta

    # -- the device -------------------------------------------------------------------------------
    def _execute(self, scheduled: dict[str, int]) -> tuple[Forward, dict[str, list[int]]]:
        cfg = self.cfg
        rows, req_ids, starts, sampled, rejected, qsl = [], [], [], [], [], [0]
        new_tokens: dict[str, list[int]] = {}
        for rid, n in scheduled.items():
            r = self.requests[rid]
            req_ids.append(rid)
            starts.append(r.num_computed_tokens)
            p = r.dev_computed
            if p < r.num_prompt_tokens:  # a prefill chunk: the device is where the scheduler is
                assert p == r.num_computed_tokens, (rid, p, r.num_computed_tokens)
                rows.append(routing_rows(r.dev_hash[p:p + n], cfg.num_layers, cfg.top_k, cfg.num_experts))
                r.dev_computed += n
                if r.dev_computed == r.num_prompt_tokens:
                    token = int(self.rng.integers(0, 50_000))
                    r.dev_append(token)
                    new_tokens[rid] = [token]
                    sampled.append(1)
                else:
                    sampled.append(0)
                    self.features.add("chunked_prefill")
                rejected.append(0)
            else:
                drafts = n - 1
                accepted = int(self.rng.integers(0, drafts + 1)) if drafts else 0
                if drafts and self.rng.random() < 0.4:
                    accepted = drafts
                draft_tokens = self._tokens(drafts)
                tokens = draft_tokens[:accepted] + [int(self.rng.integers(0, 50_000))]
                for token in tokens:
                    r.dev_append(token)
                good = routing_rows(r.dev_hash[p:p + 1 + accepted], cfg.num_layers, cfg.top_k, cfg.num_experts)
                wrong = [content_hash(r.dev_hash[p] ^ 0x5EED5EED, t + i)  # not the accepted content
                         for i, t in enumerate(draft_tokens[accepted:])]
                bad = routing_rows(wrong, cfg.num_layers, cfg.top_k, cfg.num_experts)
                rows.append(np.concatenate([good, bad]))
                r.dev_computed += 1 + accepted
                new_tokens[rid] = tokens
                sampled.append(1 + accepted)
                rejected.append(drafts - accepted)
                self.features.add("decode")
                if drafts - accepted:
                    self.features.add("spec_rejection")
                    if cfg.max_concurrent_batches > 1:
                        self.features.add("async_rejection")
            qsl.append(qsl[-1] + n)
        ids = np.concatenate(rows) if rows else np.zeros((0, cfg.num_layers, cfg.top_k), np.int64)
        qsl_np = np.asarray(qsl, dtype=np.int32)
        room = cfg.max_num_batched_tokens - len(ids)
        if cfg.padding and room > 0 and self.rng.random() < 0.3:  # CUDA graphs pad the batch
            pad = int(self.rng.integers(1, min(room, 3) + 1))
            pad_ids = routing_rows([self.rng.integers(0, 1 << 62) for _ in range(pad)], cfg.num_layers,
                                   cfg.top_k, cfg.num_experts)
            ids = np.concatenate([ids, pad_ids])
            qsl_np = np.concatenate([qsl_np, np.full(int(self.rng.integers(1, 3)), qsl[-1], np.int32)])
            self.features.add("padding")
        forward = Forward(self.step, req_ids, qsl_np, np.asarray(starts, dtype=np.int32), ids,
                          np.asarray(sampled, dtype=np.int32), np.asarray(rejected, dtype=np.int32))
        return forward, new_tokens

    def _after_schedule(self, scheduled: dict[str, int]) -> None:
        """vLLM's bookkeeping once a step is scheduled: optimistic progress, blocks cached."""
        b = self.cfg.block_size
        for rid, n in scheduled.items():
            r = self.requests[rid]
            if r.num_computed_tokens + n >= r.num_prompt_tokens:
                r.placeholders += 1
            r.num_computed_tokens += n
            for i, h in enumerate(r.block_hashes[:r.num_computed_tokens // b]):
                self.pool.cache(r.kv_slots[i], h)

    # -- consuming outputs ------------------------------------------------------------------------
    def _update(self, record) -> None:
        step, forward, new_tokens = record
        for i, rid in enumerate(forward.req_ids):
            r = self.requests.get(rid)
            if r is None:  # finished while this step was in flight: its output is dropped
                continue
            if forward.num_sampled[i] == 0:
                continue
            r.placeholders -= 1
            r.num_computed_tokens -= int(forward.num_rejected[i])
            if r.append_tokens(new_tokens[rid]):
                self._finish(r)

    def _finish(self, r: Request) -> None:
        r.finished = True
        if any(r.request_id in fw.req_ids for _, fw, _ in self.in_flight):
            self.features.add("finish_in_flight")
        self.connector.request_finished(r)
        self.pool.release(r.kv_slots)
        self.running.remove(r)
        del self.requests[r.request_id]
        if r.conversation:
            self.followups.append((self.step + int(self.rng.integers(0, 4)), r.conversation, r))

    def _consume_oldest(self, processed: set[int]) -> None:
        record = self.in_flight.popleft()
        if record[0] not in processed:
            self.events.append(Process(record[0]))
        self._update(record)

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> Trace:
        cfg = self.cfg
        processed: set[int] = set()
        if self.rng.random() < 0.2:
            self.events.append(Begin(-1, None))  # a warm-up step without metadata
        while self.step < self.max_steps:
            idle = not (self.running or self.in_flight)
            if idle and not self.waiting and self.num_requests == 0 and not self.followups:
                if not self.connector.finished:  # the last finish events are delivered first
                    break
            if idle and self.step > 0 and self.rng.random() < 0.08:
                self.connector.reset()  # a prefix-cache reset: only with nothing running or in flight
                self.pool.reset()
                self.features.add("generation_reset")
            self._arrivals()
            scheduled, meta = self._schedule()
            if scheduled or not meta.is_empty():
                if meta.generation > 0:
                    self.features.add("generation_reset_seen")
                if any(rid not in meta.requests for rid in meta.block_hashes):
                    self.features.add("hash_only_update")
                if meta.finished_requests:
                    self.features.add("finish")
                if self.in_flight and self.rng.random() < 0.5:  # the output thread wins the race
                    oldest = self.in_flight[0][0]
                    if oldest not in processed:
                        self.events.append(Process(oldest))
                        processed.add(oldest)
                self.events.append(Begin(self.step, meta))
                if scheduled:
                    forward, new_tokens = self._execute(scheduled)
                    self._after_schedule(scheduled)
                    self.events.append(forward)
                    self.in_flight.append((self.step, forward, new_tokens))
            if self.in_flight and (len(self.in_flight) >= cfg.max_concurrent_batches or not scheduled):
                self._consume_oldest(processed)
            self.step += 1
        while self.in_flight:
            self._consume_oldest(processed)
        truth = {rid: routing_rows(r.dev_hash[:r.dev_computed], cfg.num_layers, cfg.top_k, cfg.num_experts)
                 for rid, r in self.all_requests.items()}
        return Trace(cfg, self.events, truth, self.features)


def make_trace(seed: int, *, remote_prefill: bool = False, config: TraceConfig | None = None,
               metadata_builder=None, **engine_kwargs) -> Trace:
    """The trace of one seed (its engine shape drawn from the seed unless given)."""
    cfg = config or random_config(seed)
    if remote_prefill:
        cfg.remote_prefill = True
    return Engine(cfg, metadata_builder=metadata_builder, **engine_kwargs).run()
