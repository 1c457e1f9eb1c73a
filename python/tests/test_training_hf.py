"""routing_replay.hf with random transformers models (Qwen3-MoE, Mixtral, DeepSeek-V3; CPU, float32):
the experts that reach each MoE block's experts under replay are the recorded ones, the logits equal
the free forward's when the recorded routing is the model's own, gradients reach the routers, and
wrong routing (shifted, short, sentinel) is caught."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from routing_replay import hf as rrh  # noqa: E402
from routing_replay import training as rrt  # noqa: E402

NUM_LAYERS, DENSE = 3, 1


def qwen3_moe():
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
        mlp_only_layers=[DENSE], norm_topk_prob=True, attn_implementation="eager")
    return transformers.Qwen3MoeForCausalLM(config), [0, 2]


def mixtral():
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=NUM_LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=8, num_experts_per_tok=2, attn_implementation="eager")
    return transformers.MixtralForCausalLM(config), [0, 1, 2]


def deepseek_v3():
    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, q_lora_rank=None,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, attn_implementation="eager")
    return transformers.DeepseekV3ForCausalLM(config), [1, 2]


MODELS = {"qwen3_moe": qwen3_moe, "mixtral": mixtral, "deepseek_v3": deepseek_v3}


def experts_seen(model):
    """Pre-hooks on each MoE block's experts: the indices that reached them, per model layer."""
    seen: dict[int, list[torch.Tensor]] = {}
    handles = []
    for layer, router in rrh.routers(model).items():
        experts = model.model.layers[layer].mlp.experts
        def hook(module, args, layer=layer):
            seen.setdefault(layer, []).append(args[1].detach().clone())  # (hidden, top_k_index, top_k_weights)
        handles.append(experts.register_forward_pre_hook(hook))
    return seen, handles


@pytest.fixture(params=sorted(MODELS))
def model(request):
    torch.manual_seed(0)
    m, moe_layers = MODELS[request.param]()
    for name, p in m.named_parameters():  # random routers (some initialise them to zero)
        if "gate.weight" in name:
            torch.nn.init.normal_(p, std=0.5)
    return m.eval(), moe_layers


def test_replay_matches_own_routing_and_trains(model):
    m, moe_layers = model
    assert sorted(rrh.routers(m)) == moe_layers
    layer_map = rrt.LayerMap(moe_layers, NUM_LAYERS)
    rng = np.random.default_rng(1)
    ids = torch.from_numpy(rng.integers(1, 64, size=(2, 9)))
    seen, handles = experts_seen(m)
    with torch.no_grad():
        free = m(input_ids=ids).logits
    recorded = np.stack([seen[layer][0].numpy() for layer in moe_layers], axis=1)  # [B * S, L, K]
    batch = recorded.reshape(2, 9, len(moe_layers), -1)
    with torch.no_grad(), rrh.replay(m, batch, layer_map=layer_map):
        replayed = m(input_ids=ids).logits
    assert torch.equal(replayed, free)  # same experts, same weights: bit-exact
    for layer in moe_layers:
        assert torch.equal(seen[layer][1], seen[layer][0])

    # routers pushed off their own choice: replay still routes as recorded, and trains the routers
    with torch.no_grad():
        for router in rrh.routers(m).values():
            router.weight.add_(torch.randn_like(router.weight))
    m.train()
    with rrh.replay(m, layer_map.take(batch, "all"), layer_map=layer_map):  # all-layer routing works too
        loss = m(input_ids=ids, labels=ids).loss
    loss.backward()
    for layer in moe_layers:
        assert torch.equal(seen[layer][2], seen[layer][0])
        assert rrh.routers(m)[layer].weight.grad.abs().sum() > 0
    with torch.no_grad():
        m(input_ids=ids)  # restored: the routers choose on their own again
    assert any(not torch.equal(seen[layer][3], seen[layer][0]) for layer in moe_layers)
    for h in handles:
        h.remove()


def test_replay_shifted_routing_differs(model):
    m, moe_layers = model
    layer_map = rrt.LayerMap(moe_layers, NUM_LAYERS)
    ids = torch.from_numpy(np.random.default_rng(2).integers(1, 64, size=(1, 12)))
    seen, handles = experts_seen(m)
    with torch.no_grad():
        free = m(input_ids=ids).logits
    recorded = np.stack([seen[layer][0].numpy() for layer in moe_layers], axis=1)
    shifted = np.concatenate([recorded[1:], recorded[-1:]])
    with torch.no_grad(), rrh.replay(m, shifted, layer_map=layer_map):
        replayed = m(input_ids=ids).logits
    assert not torch.allclose(replayed, free, atol=1e-4)
    for h in handles:
        h.remove()


def test_replay_errors(model):
    m, moe_layers = model
    layer_map = rrt.LayerMap(moe_layers, NUM_LAYERS)
    ids = torch.ones((1, 4), dtype=torch.long)
    good = np.tile(np.arange(2, dtype=np.int16), (4, len(moe_layers), 1))
    with pytest.raises(ValueError, match=f"model layer {moe_layers[0]}: the router got 4 tokens, the replayed "
                                         "routing has 3 rows"):
        with torch.no_grad(), rrh.replay(m, good[:3], layer_map=layer_map):
            m(input_ids=ids)
    assert "forward" not in vars(rrh.routers(m)[moe_layers[0]])  # restored after the error
    bad = good.copy()
    bad[3, 1, 0] = -1
    with pytest.raises(ValueError, match=f"model layer {moe_layers[1]}: 1 of 4 rows hold no routing"):
        with rrh.replay(m, bad, layer_map=layer_map):
            pass
    with pytest.raises(ValueError, match="top-k 1"):
        with rrh.replay(m, good[..., :1], layer_map=layer_map):
            pass
    with pytest.raises(ValueError, match="are not MoE layers"):
        with rrh.replay(m, good[:, :1], layer_map=rrt.LayerMap(moe_layers[:1], NUM_LAYERS)):
            pass
    with pytest.raises(ValueError, match=r"\[B, S, L, K\] or \[N, L, K\]"):
        with rrh.replay(m, good[0], layer_map=layer_map):
            pass
    with pytest.raises(ValueError, match="no known MoE router"):
        with rrh.replay(torch.nn.Linear(2, 2), good, layer_map=layer_map):
            pass
