"""vLLM's scheduler side as the worker connector sees it, restated for the traces of _vllm_trace:
a request's fields the aux-output connector reads, the KV block pool's prefix cache, and the metadata
vLLM 0.33's ``AuxOutputSchedulerConnector`` builds each step (``SchedulerConnectorModel``; checked
against the peer's own connector, which ``peer_scheduler_connector`` builds over the same pool).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit hash step."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def content_hash(previous: int, token: int) -> int:
    """The content hash of a position: its token after the content hash of the position before."""
    return _mix(previous ^ _mix(token + 1))


@dataclass
class Meta:
    """One step's connector metadata, implementation-neutral (hashes as lists of bytes)."""

    generation: int
    requests: dict[str, int]
    block_hashes: dict[str, list[bytes]]
    finished_requests: tuple[str, ...]
    retained: list[bytes] = field(default_factory=list)
    released: list[bytes] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.requests or self.block_hashes or self.finished_requests or self.retained
                    or self.released)



class Request:
    """One request as vLLM's scheduler sees it (the fields the aux connector reads), and as the
    device sees it (the tokens it accepted, the positions it computed)."""

    def __init__(self, request_id: str, prompt: list[int], *, prompt_start: int, max_tokens: int,
                 stop_index: int | None, block_size: int, hash_size: int, external: int = 0,
                 conversation: int | None = None) -> None:
        self.request_id = request_id
        self.prompt = list(prompt)
        self.sampling_params = SimpleNamespace(routed_experts_prompt_start=prompt_start)
        self.max_tokens = max_tokens
        self.stop_index = stop_index
        self.block_size = block_size
        self.hash_size = hash_size
        self.external = external
        self.conversation = conversation
        self.all_token_ids = list(prompt)
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []
        self.placeholders = 0
        self.finished = False
        self.kv_slots: list[int] = []
        self._update_block_hashes()
        # device side
        self.dev_tokens = list(prompt)
        self.dev_hash: list[int] = []
        h = 0
        for token in prompt:
            h = content_hash(h, token)
            self.dev_hash.append(h)
        self.dev_computed = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt)

    def is_finished(self) -> bool:
        return self.finished

    def _update_block_hashes(self) -> None:
        b = self.block_size
        while (len(self.block_hashes) + 1) * b <= len(self.all_token_ids):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else b"root"
            tokens = np.asarray(self.all_token_ids[i * b:(i + 1) * b], dtype=np.int64).tobytes()
            self.block_hashes.append(hashlib.blake2b(parent + tokens, digest_size=self.hash_size).digest())

    def append_tokens(self, tokens: list[int]) -> bool:
        """The scheduler learns sampled tokens; True when the request stops (tokens past it dropped)."""
        for token in tokens:
            self.all_token_ids.append(token)
            index = self.num_output_tokens - 1
            if index == self.stop_index or self.num_output_tokens >= self.max_tokens:
                self._update_block_hashes()
                return True
        self._update_block_hashes()
        return False

    def dev_append(self, token: int) -> None:
        self.dev_tokens.append(token)
        self.dev_hash.append(content_hash(self.dev_hash[-1], token))


class KVPool:
    """vLLM's KV block pool reduced to what decides prefix hits: slots with a reference count, a
    hash -> slot map of cached full blocks, and free slots evicted least recently freed first."""

    def __init__(self, num_blocks: int) -> None:
        self.refs = [0] * num_blocks
        self.slot_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    def get_cached_block(self, block_hash, group_ids=None):
        slot = self.cached.get(block_hash)
        return None if slot is None else [slot]

    def hits(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cached:
                break
            n += 1
        return n

    def allocate(self, hashes_hit: list[bytes], num_new: int) -> list[int] | None:
        if len(self.free) < num_new + sum(1 for h in hashes_hit if self.refs[self.cached[h]] == 0):
            return None
        slots = []
        for h in hashes_hit:
            slot = self.cached[h]
            if self.refs[slot] == 0:
                del self.free[slot]
            self.refs[slot] += 1
            slots.append(slot)
        for _ in range(num_new):
            slot, _ = self.free.popitem(last=False)
            if self.slot_hash[slot] is not None:
                del self.cached[self.slot_hash[slot]]
                self.slot_hash[slot] = None
            self.refs[slot] = 1
            slots.append(slot)
        return slots

    def cache(self, slot: int, block_hash: bytes) -> None:
        if block_hash in self.cached or self.slot_hash[slot] is not None:
            return
        self.cached[block_hash] = slot
        self.slot_hash[slot] = block_hash

    def release(self, slots: list[int]) -> None:
        for slot in reversed(slots):  # tail blocks are evicted first, as vLLM frees them
            self.refs[slot] -= 1
            if self.refs[slot] == 0:
                self.free[slot] = None

    def reset(self) -> None:
        self.cached.clear()
        self.slot_hash = [None] * len(self.slot_hash)


class SchedulerConnectorModel:
    """The metadata vLLM 0.33's scheduler-side aux-output connector sends, restated (block size ==
    hash block size; no KV connector). ``retain=False`` withholds the retained/released hashes of
    blocks the KV cache holds, so that a small store can evict blocks a later prefix hit reads."""

    def __init__(self, block_size: int, pool: KVPool, capacity: int, *, retain: bool = True) -> None:
        self.block_size = block_size
        self.pool = pool
        self.capacity = capacity
        self.retain = retain
        self.sent: dict[str, int] = {}
        self.finished: dict[str, list[bytes] | None] = {}
        self.generation = 0
        self.kv_cached: OrderedDict[bytes, None] = OrderedDict()
        self.retained: list[bytes] = []
        self.released: list[bytes] = []

    def _take(self, request: Request, num_computed: int) -> list[bytes] | None:
        num_sent = self.sent[request.request_id]
        num_keyed = min(len(request.block_hashes), num_computed // self.block_size)
        if num_keyed <= num_sent:
            return None
        self.sent[request.request_id] = num_keyed
        return request.block_hashes[num_sent:num_keyed]

    def build(self, num_scheduled: dict[str, int], requests: dict[str, Request]) -> Meta:
        emit: dict[str, int] = {}
        hashes: dict[str, list[bytes]] = {}
        for rid, n in num_scheduled.items():
            self.sent.setdefault(rid, 0)
            r = requests[rid]
            new = self._take(r, r.num_computed_tokens + n)
            if new:
                hashes[rid] = new
            floor = 0 if r.num_output_tokens == 0 else r.num_tokens - 1
            emit[rid] = max(min(r.sampling_params.routed_experts_prompt_start, r.num_prompt_tokens), floor)
        for rid in self.sent:  # a settled token may complete a block of a request not rescheduled
            if rid not in emit:
                new = self._take(requests[rid], requests[rid].num_computed_tokens)
                if new:
                    hashes[rid] = new
        finished = tuple(self.finished)
        hashes.update((rid, h) for rid, h in self.finished.items() if h)
        self.finished = {}
        meta = Meta(self.generation, emit, hashes, finished, self.retained, self.released)
        self.retained, self.released = [], []
        return meta

    def request_finished(self, request: Request) -> None:
        if self.retain:
            for h in request.block_hashes[:request.num_computed_tokens // self.block_size]:
                if h not in self.kv_cached and self.pool.get_cached_block(h):
                    self.kv_cached[h] = None
                    self.retained.append(h)
            excess = len(self.kv_cached) - self.capacity
            if excess > 0:
                victims = [h for h in self.kv_cached if not self.pool.get_cached_block(h)][:excess]
                for h in victims:
                    del self.kv_cached[h]
                    self.released.append(h)
        if request.request_id not in self.sent:
            return
        self.finished[request.request_id] = self._take(request, request.num_computed_tokens)
        del self.sent[request.request_id]

    def reset(self) -> None:
        self.sent.clear()
        self.finished.clear()
        self.generation += 1
        self.released.extend(self.kv_cached)
        self.kv_cached.clear()


def peer_scheduler_connector(peer, block_size: int, pool: KVPool, num_kv_blocks: int):
    """The peer's own ``AuxOutputSchedulerConnector`` over ``pool`` (for checking the model above)."""
    manager = SimpleNamespace(block_size=block_size, block_pool=pool)
    kv_cache_manager = SimpleNamespace(
        coordinator=SimpleNamespace(full_attention_group_id=0, single_type_managers=[manager]),
        block_pool=SimpleNamespace(hash_block_size=block_size),
        kv_cache_config=SimpleNamespace(num_blocks=num_kv_blocks))
    return peer.AuxOutputSchedulerConnector(kv_cache_manager)


def meta_from_peer(m) -> Meta:
    """A peer ``AuxOutputConnectorMetadata`` as a ``Meta``."""
    return Meta(m.generation, dict(m.requests), {k: list(v) for k, v in m.block_hashes.items()},
                tuple(m.finished_requests), list(m.retained_block_hashes or ()),
                list(m.released_block_hashes or ()))
