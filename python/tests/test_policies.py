"""Every policy combination, on every backend this machine runs, against the plain reference on a
randomized engine schedule (chunked prefill, decode, drafts accepted and rejected, requests that
did not ask, aborts; KV blocks for block_slot storage), bit-exact."""

from __future__ import annotations

import itertools

import pytest

import routing_replay as rr
from _sim import Engine
from routing_replay import _build

INDEX_TYPES = ("uint8", "uint16", "int16", "int32")
LAYOUTS = ("layer_major", "token_major")
COPIES = ("sync", "async_event", "double_buffered", "device_scatter")
STORAGES = ("per_request", "block_slot")
#: Every combination (64); those compiled ahead of time are the build's AOT_UNITS (index int16 with
#: layout layer_major by default, all with ROUTING_REPLAY_PYTHON_ALL_COMBINATIONS=ON, as CI and
#: scripts/python_gpu_check.sh build): the others compile on first use (test_jit.py tests that).
ALL = list(itertools.product(INDEX_TYPES, LAYOUTS, COPIES, STORAGES))
COMPILED = [p for p in ALL if f"{p[0]}/{p[1]}" in _build.AOT_UNITS]


def compiled(backend: str) -> set[tuple[str, str, str, str]]:
    return {(p["index"], p["layout"], p["copy"], p["storage"]) for p in rr.policies(backend)}


def test_every_combination_compiled_ahead_is_there():
    assert len(ALL) == 64
    # other tests of this process may have loaded units compiled on first use
    assert set(COMPILED) <= compiled("host") <= set(ALL)
    if "cuda" in rr.backends():
        assert set(COMPILED) <= compiled("cuda") <= set(ALL)


@pytest.mark.parametrize("policy", COMPILED, ids=["/".join(p) for p in COMPILED])
def test_policy_matches_reference(device, policy):
    index, layout, copy, storage = policy
    moe_layers = [1, 2, 4]  # model layers 0 and 3 are dense
    replay = rr.Replay(num_experts=40, top_k=3, max_tokens_per_step=24, max_model_len=40, moe_layers=moe_layers,
                       num_model_layers=5, num_fused_shared_experts=1, device=device.name, index=index,
                       layout=layout, copy=copy, storage=storage, block_size=4, num_blocks=64)
    assert replay.policies == {"backend": device.backend, "index": index, "layout": layout, "copy": copy,
                               "storage": storage}
    engine = Engine(replay, device, seed=hash(policy) % 1000, num_experts=40, moe_layers=moe_layers,
                    num_model_layers=5, top_k=3, shared=1, max_tokens=24, max_len=40, block_size=4, num_blocks=64)
    engine.run(steps=30)
    assert engine.checked >= 3
    replay.drain()
    assert replay.steps_in_flight == 0
    assert replay.num_requests == 0
