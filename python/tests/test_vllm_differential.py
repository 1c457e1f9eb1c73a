"""routing_replay.vllm against vLLM 0.33's own routed-experts worker connector (the peer), on seeded
traces of a vLLM-like engine (``_vllm_trace``): chunked prefill, decode, speculative decoding with
rejections under asynchronous scheduling, prefix hits across requests served from the store,
multi-turn conversations with an emit start at the new turn or past the prompt, requests finishing
with steps in flight, eviction under a small store budget (reads of evicted blocks fail), prefix-cache
resets. Every ``AuxRequestOutput`` of every step must be equal (token_start, rows, dtype), and the
library must raise exactly where vLLM raises (an assert, its store error: any exception of ours).

The harness is checked first: the trace model's metadata against vLLM's own scheduler connector,
the peer against itself and against a plain numpy reference, every output against the rows the
device computed. Where torch is absent (no peer) the library is still checked against the reference,
and so are the traces vLLM cannot run (a first capture mid-block, KV computed elsewhere).

The peer is the installed vLLM's own connector where vLLM imports, the stubbed copy otherwise
(``_peers``, ROUTING_REPLAY_VLLM_PEER). ROUTING_REPLAY_VLLM_TRACES sets the number of traces (240 by
default).
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest

from conftest import requires_cuda
from _vllm_harness import Library, Peer, Reference, compare, have_library, run, truth_errors
from _vllm_scheduler import Meta, SchedulerConnectorModel, meta_from_peer, peer_scheduler_connector
from _vllm_trace import make_trace, random_config

NUM_TRACES = int(os.environ.get("ROUTING_REPLAY_VLLM_TRACES", "240"))
BATCH = 24
BATCHES = [range(start, min(start + BATCH, NUM_TRACES)) for start in range(0, NUM_TRACES, BATCH)]
REMOTE_SEEDS = range(10_000, 10_000 + max(NUM_TRACES // 4, 12))
requires_library = pytest.mark.skipif(not have_library(), reason="routing_replay.vllm is not built here")

_TRACES: dict[tuple[int, bool], object] = {}


@pytest.fixture(autouse=True)
def _quiet_store_growth():
    # vLLM's store logs a warning each time every block it holds is referenced and it grows
    loggers = [logging.getLogger(), logging.getLogger("routing_replay_peer_vllm_0_33_routed_experts")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    yield
    for logger, level in zip(loggers, levels):
        logger.setLevel(level)


def trace(seed: int, *, remote_prefill: bool = False):
    key = (seed, remote_prefill)
    if key not in _TRACES:
        _TRACES[key] = make_trace(seed, remote_prefill=remote_prefill)
    return _TRACES[key]


def check(expected_impl, got_impl, seeds, *, remote_prefill: bool = False) -> None:
    problems = []
    for seed in seeds:
        t = trace(seed, remote_prefill=remote_prefill)
        expected, got = run(expected_impl, t), run(got_impl, t)
        problems += compare(expected, got, t) + truth_errors(expected, t) + truth_errors(got, t)
    assert not problems, f"{len(problems)} differences:\n" + "\n".join(problems[:40])


# -- the harness ----------------------------------------------------------------------------------
REQUIRED_FEATURES = {"chunked_prefill", "decode", "spec_rejection", "async_rejection", "prefix_hit", "multi_turn",
                     "hash_only_update", "finish", "finish_in_flight", "padding", "generation_reset_seen"}
REQUIRED_COUNTS = {"store_read", "gap_reattach", "deferred_teardown", "store_growth"}


def test_traces_cover_every_scenario():
    """The seeds in use reach every scenario the comparison is meant to cover (the reference counts
    what happens inside the connector: reads from the store, reattachment after a rejection,
    teardown deferred behind a step in flight, the store growing, reads of evicted blocks)."""
    features, counts, evicted = set(), set(), 0
    reference = Reference()
    for seed in range(min(NUM_TRACES, 120)):
        t = trace(seed)
        features |= t.features
        result = run(reference, t)
        counts |= {k for k, v in result.counts.items() if v}
        evicted += result.error is not None and type(result.error[2]).__name__ == "BlockObjectStoreError"
    assert REQUIRED_FEATURES <= features, REQUIRED_FEATURES - features
    assert REQUIRED_COUNTS <= counts, REQUIRED_COUNTS - counts
    assert evicted >= 2, "too few traces read a block the store evicted"


class _BothSchedulers:
    """Builds each step's metadata with the trace model and with vLLM's own scheduler connector
    over the same requests and KV pool; any difference fails the step."""

    def __init__(self, peer, pool, cfg):
        self.model = SchedulerConnectorModel(cfg.block_size, pool, cfg.num_kv_blocks, retain=True)
        self.peer = peer_scheduler_connector(peer, cfg.block_size, pool, cfg.num_kv_blocks)
        self.steps = 0

    @property
    def finished(self):
        return self.model.finished

    def build(self, num_scheduled, requests) -> Meta:
        mine = self.model.build(num_scheduled, requests)
        theirs = meta_from_peer(self.peer.build_connector_meta(SimpleNamespace(num_scheduled_tokens=dict(num_scheduled)),
                                                               requests))
        assert mine == theirs, f"step {self.steps}: the trace model sends {mine}, vLLM sends {theirs}"
        self.steps += 1
        return mine

    def request_finished(self, request) -> None:
        self.model.request_finished(request)
        self.peer.request_finished(request)

    def reset(self) -> None:
        self.model.reset()
        self.peer.reset()


def test_trace_metadata_is_what_vllms_scheduler_sends():
    peer = Peer().module
    for seed in range(min(NUM_TRACES, 80)):
        cfg = random_config(seed)
        cfg.retain = True
        make_trace(seed, config=cfg, metadata_builder=lambda pool, cfg=cfg: _BothSchedulers(peer, pool, cfg))


def test_peer_against_itself():
    """Two runs of the peer on one trace agree (its background writer thread changes nothing)."""
    check(Peer(), Peer(), range(min(NUM_TRACES, 48)))


@pytest.mark.parametrize("seeds", BATCHES, ids=lambda r: f"seeds{r.start}-{r.stop - 1}")
def test_reference_matches_peer(seeds):
    check(Peer(), Reference(), seeds)


# -- the library ----------------------------------------------------------------------------------
BACKENDS = ["host", pytest.param("cuda", marks=requires_cuda)]


@requires_library
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seeds", BATCHES, ids=lambda r: f"seeds{r.start}-{r.stop - 1}")
def test_library_matches_vllm(seeds, backend):
    peer = Peer()
    # the library's own metadata classes for even seeds, vLLM's (as the engine hands them over) for
    # odd ones; on the host backend every fourth seed captures CPU torch tensors instead of numpy
    variants = [Library(backend), Library(backend, metadata_from="vllm"), Library(backend),
                Library(backend, metadata_from="vllm", cpu_tensors=backend == "host")]
    problems = []
    for seed in seeds:
        t = trace(seed)
        expected = run(peer, t)
        got = run(variants[seed % 4], t)
        problems += compare(expected, got, t) + truth_errors(got, t)
    assert not problems, f"{len(problems)} differences:\n" + "\n".join(problems[:40])


@requires_library
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seeds", BATCHES, ids=lambda r: f"seeds{r.start}-{r.stop - 1}")
def test_library_matches_reference(seeds, backend):
    """Without torch (CI) the reference stands in for vLLM."""
    check(Reference(), Library(backend), seeds)


@requires_library
@pytest.mark.parametrize("backend", BACKENDS)
def test_library_starts_mid_block_where_vllm_cannot(backend):
    """Requests whose KV was computed elsewhere (prefill/decode disaggregation) start capturing mid
    block, with the emit start at their first computed token: vLLM asserts; the library matches the
    reference, which files no block it did not capture in full."""
    check(Reference(mid_block_start=True), Library(backend), REMOTE_SEEDS, remote_prefill=True)
