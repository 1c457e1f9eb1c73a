"""Every compiled instantiation, on every backend this machine runs, against the plain reference
on a randomized engine schedule (chunked prefill, decode, drafts accepted and rejected, requests
that did not ask, aborts; KV blocks for block_slot storage), bit-exact."""

from __future__ import annotations

import pytest

import routing_replay as rr
from _sim import Engine

#: The documented set (routing_replay.policies, python/src/instances.hpp): 28 on each backend.
EXPECTED = (
    [("int16", layout, copy, storage)
     for layout in ("layer_major", "token_major")
     for copy in ("sync", "async_event", "double_buffered", "device_scatter")
     for storage in ("per_request", "block_slot")]
    + [(index, "layer_major", copy, storage)
       for index in ("uint8", "uint16", "int32")
       for copy in ("double_buffered", "device_scatter")
       for storage in ("per_request", "block_slot")]
)
IDS = ["/".join(p) for p in EXPECTED]


def test_host_policies_are_the_documented_set():
    got = {(p["index"], p["layout"], p["copy"], p["storage"]) for p in rr.policies("host")}
    assert got == set(EXPECTED)


@pytest.mark.parametrize("policy", EXPECTED, ids=IDS)
def test_policy_matches_reference(device, policy):
    if device.backend == "cuda":
        got = {(p["index"], p["layout"], p["copy"], p["storage"]) for p in rr.policies("cuda")}
        assert got == set(EXPECTED)
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
