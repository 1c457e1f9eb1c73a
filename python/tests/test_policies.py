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
#: Every combination (64); a build compiles all of them unless ROUTING_REPLAY_PYTHON_INDEX_TYPES
#: named fewer index types (python/src/instances/instances.hpp).
ALL = list(itertools.product(INDEX_TYPES, LAYOUTS, COPIES, STORAGES))
COMPILED = [p for p in ALL if p[0] in _build.INDEX_TYPES]


def compiled(backend: str) -> set[tuple[str, str, str, str]]:
    return {(p["index"], p["layout"], p["copy"], p["storage"]) for p in rr.policies(backend)}


def test_every_combination_of_the_built_index_types():
    assert len(ALL) == 64
    assert compiled("host") == set(COMPILED)
    if "cuda" in rr.backends():
        assert compiled("cuda") == set(COMPILED)


@pytest.mark.skipif(set(_build.INDEX_TYPES) == set(INDEX_TYPES), reason="this build compiled every index type")
def test_a_left_out_index_type_says_how_to_get_it(host):
    index = next(i for i in INDEX_TYPES if i not in _build.INDEX_TYPES)
    with pytest.raises(ValueError, match=f"no compiled host instantiation for index={index}.*"
                                         "this build compiled index types .*ROUTING_REPLAY_PYTHON_INDEX_TYPES=all"):
        rr.Replay(num_experts=8, top_k=2, max_tokens_per_step=8, max_model_len=16, moe_layers=[0], device="cpu",
                  index=index)


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
