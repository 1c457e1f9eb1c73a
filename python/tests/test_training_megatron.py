"""routing_replay.megatron against megatron-core's own RouterReplay (megatron-core >= 0.16 from PyPI).

- everywhere megatron-core and torch import (CPU too): the layer of every RouterReplay instance,
  and the real routers' ``routing()`` under REPLAY_FORWARD with the tensors we hand over, for a
  padded and a packed batch and emulated context-parallel / sequence-parallel ranks, checked row by
  row against a plain-loop reference of Megatron's token order;
- on CUDA (Megatron's router gating moves its weights to the GPU, so a whole forward needs one): a
  small MoE GPTModel records each request's routing alone, the routing travels as vLLM's base64
  field into a right-padded batch, and the batch's forward under replay uses the recorded experts
  for every token and layer, with logits equal to the rollout's; with router weights perturbed, the
  replayed experts stay the recorded ones, also in a training step, whose backward reaches the
  router weights; with one request's routing shifted by one position, the check fails.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import routing_replay as rr  # noqa: E402
from routing_replay import megatron as rrm  # noqa: E402
from routing_replay import training as rrt  # noqa: E402

E, K, HIDDEN, VOCAB = 8, 2, 32, 64
LAYER_FREQ = [1, 0, 1, 1]  # model layer 1 is dense
MOE_LAYERS = [i for i, f in enumerate(LAYER_FREQ) if f]
CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def parallel_state():
    """A process group of one and Megatron's model-parallel state."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not hasattr(moe_utils, "te_general_gemm"):
        # megatron-core 0.16.1 without Transformer Engine: router_gating_linear tests
        # `te_general_gemm is not None`, but the name is only bound when TE imports (NameError).
        # Binding it to None selects Megatron's own torch.mm path, as the code intends.
        moe_utils.te_general_gemm = None
    created = not dist.is_initialized()
    if created:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        if CUDA:
            torch.cuda.set_device(0)
        # a group of one: NCCL on a GPU (Megatron's collectives take CUDA tensors), gloo elsewhere
        dist.init_process_group("nccl" if CUDA else "gloo", rank=0, world_size=1)
    ps.initialize_model_parallel()
    if CUDA:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
    yield ps
    ps.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


def build_model(seed: int = 0):
    """A 4-layer GPT with layers 0, 2, 3 MoE (8 experts, top-2), routers replaying; float32."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    rrm.RouterReplay.clear_global_router_replay_instances()
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=len(LAYER_FREQ), hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=64,
        num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=16, moe_layer_freq=LAYER_FREQ,
        moe_enable_routing_replay=True, moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
        add_bias_linear=False, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, moe_router_dtype="fp32")
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=128,
                     position_embedding_type="rope")
    return model.eval()


def test_router_layers(parallel_state):
    model = build_model()
    assert rrm.router_layers(model) == MOE_LAYERS
    assert rrm.router_layers([model]) == MOE_LAYERS
    rrm.RouterReplay.global_router_replay_instances.insert(0, rrm.RouterReplay())  # a stale instance
    with pytest.raises(ValueError, match="belong to no router of this model"):
        rrm.router_layers(model)
    rrm.RouterReplay.clear_global_router_replay_instances()
    with pytest.raises(ValueError, match="moe_enable_routing_replay"):
        rrm.router_layers(model)


def random_routing(rng, rows: int, layers: int) -> np.ndarray:
    out = np.zeros((rows, layers, K), dtype=np.int16)
    for t in range(rows):
        for layer in range(layers):
            out[t, layer] = rng.choice(E, size=K, replace=False)
    return out


def routers(model):
    """The model's replaying TopKRouters in RouterReplay instance order."""
    from megatron.core.transformer.moe.router import TopKRouter

    by_instance = {id(m.router_replay): m for m in model.modules() if isinstance(m, TopKRouter)}
    return [by_instance[id(inst)] for inst in rrm.RouterReplay.global_router_replay_instances
            if id(inst) in by_instance]


def ref_cp_tokens(n: int, cp: int, rank: int) -> list[int]:
    c = n // (2 * cp)
    return [t for t in range(n) if t // c == rank] + [t for t in range(n) if t // c == 2 * cp - 1 - rank]


@pytest.mark.parametrize("cp,tp,sp", [(1, 1, False), (2, 1, False), (1, 2, True), (2, 2, True)])
def test_routers_replay_padded_batch(parallel_state, cp, tp, sp):
    """Megatron's routers, under REPLAY_FORWARD with our tensors, route row s * B + b of this rank's
    [s, b] tokens to the experts of token (b, s) of the batch, with weights from their own logits."""
    rng = np.random.default_rng(cp * 10 + tp)
    model = build_model()
    layer_map = rrt.LayerMap(MOE_LAYERS, len(LAYER_FREQ))
    b, s = 3, 4 * cp * tp
    mask = np.zeros((b, s), dtype=np.int64)
    lengths = [s, s - 1, s // 2 + 1]
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    fields = [rr.to_base64_npy(random_routing(rng, n - 1, len(MOE_LAYERS))) for n in lengths]
    batch = rrt.padded_batch(fields, mask, final_token="repeat", pad_rows="first_k")
    for cp_rank in range(cp):
        for tp_rank in range(tp):
            local_s = ref_cp_tokens(s, cp, cp_rank)
            if sp:
                local_s = local_s[tp_rank * len(local_s) // tp:(tp_rank + 1) * len(local_s) // tp]
            with rrm.replay(model, batch, layer_map=layer_map, cp_size=cp, cp_rank=cp_rank, tp_size=tp,
                            tp_rank=tp_rank, sequence_parallel=sp, device="cpu"):
                for slot, router in enumerate(routers(model)):
                    logits = torch.randn(len(local_s), b, E, dtype=torch.float32)
                    probs, routing_map = router.routing(logits)
                    flat = logits.view(-1, E)
                    for i in range(len(local_s) * b):
                        want = batch[i % b, local_s[i // b], slot]
                        assert sorted(torch.nonzero(routing_map[i]).flatten().tolist()) == sorted(want.tolist())
                        gathered = torch.softmax(flat[i, torch.from_numpy(want.astype(np.int64))], dim=-1)
                        assert torch.allclose(probs[i, torch.from_numpy(want.astype(np.int64))], gathered)
            assert all(r.router_replay.target_topk_idx is None for r in routers(model))  # cleared on exit


def test_routers_replay_packed_batch(parallel_state):
    rng = np.random.default_rng(5)
    model = build_model()
    layer_map = rrt.LayerMap(MOE_LAYERS, len(LAYER_FREQ))
    lengths = [5, 9, 2]
    fields = [rr.to_base64_npy(rrt.LayerMap(MOE_LAYERS, 4).take(random_routing(rng, n, 3), "all")) for n in lengths]
    packed = rrt.packed_batch(fields, lengths, final_token="refuse", align=4, pad_rows="first_k")
    cp = 2
    for cp_rank in range(cp):
        tokens = []
        for i in range(len(lengths)):
            start, end = int(packed.cu_seqlens_padded[i]), int(packed.cu_seqlens_padded[i + 1])
            tokens += [start + t for t in ref_cp_tokens(end - start, cp, cp_rank)]
        with rrm.replay(model, packed.routing, layer_map=layer_map, packed=True,
                        cu_seqlens_padded=packed.cu_seqlens_padded, cp_size=cp, cp_rank=cp_rank, device="cpu"):
            for slot, router in enumerate(routers(model)):
                _, routing_map = router.routing(torch.randn(len(tokens), 1, E))
                for i, token in enumerate(tokens):
                    want = packed.routing[token, MOE_LAYERS[slot]]  # all-layer routing: model layer index
                    assert sorted(torch.nonzero(routing_map[i]).flatten().tolist()) == sorted(want.tolist())


def test_replay_one_model_chunk(parallel_state):
    """vp_stage: only the routers of that chunk get indices and the action; the others, none.
    (A world of one cannot build real virtual stages, whose layer offsets Megatron requires PP > 1
    for: two models stand for two chunks here, their instances listed one after the other.)"""
    rrm.RouterReplay.clear_global_router_replay_instances()
    chunks = [build_model(), None]
    saved = list(rrm.RouterReplay.global_router_replay_instances)
    chunks[1] = build_model(seed=1)  # build_model clears the list: put chunk 0's instances back first
    rrm.RouterReplay.global_router_replay_instances[:0] = saved
    assert rrm.router_layers(chunks) == MOE_LAYERS * 2
    assert rrm.router_layers(chunks, 1) == MOE_LAYERS
    layer_map = rrt.LayerMap(MOE_LAYERS, len(LAYER_FREQ))
    batch = rrt.padded_batch([random_routing(np.random.default_rng(7), 4, 3)], np.ones((1, 4)),
                             final_token="refuse", pad_rows="first_k")
    with rrm.replay(chunks, batch, layer_map=layer_map, vp_stage=1, device="cpu") as tensors:
        assert len(tensors) == len(MOE_LAYERS)
        for c, chunk in enumerate(chunks):
            for slot, router in enumerate(routers(chunk)):
                replay = router.router_replay
                if c == 0:
                    assert replay.target_topk_idx is None and replay.router_replay_action is None
                else:
                    assert replay.router_replay_action == rrm.RouterReplayAction.REPLAY_FORWARD
                    assert replay.target_topk_idx.tolist() == batch[0, :, slot].tolist()
    assert all(r.router_replay.target_topk_idx is None for r in routers(chunks[1]))


def test_replay_errors(parallel_state):
    model = build_model()
    layer_map = rrt.LayerMap(MOE_LAYERS, len(LAYER_FREQ))
    rng = np.random.default_rng(6)
    mask = np.array([[1, 1, 1, 0]])
    routing = [random_routing(rng, 2, 3)]
    batch = rrt.padded_batch(routing, mask, final_token="sentinel", pad_rows="first_k")
    with pytest.raises(ValueError, match="model layer 0: 1 of 4 rows on this rank hold no routing"):
        rrm.set_replay_data(model, batch, layer_map=layer_map, device="cpu")
    batch = rrt.padded_batch(routing, mask, final_token="repeat", pad_rows="sentinel")
    with pytest.raises(ValueError, match="no routing"):
        rrm.set_replay_data(model, batch, layer_map=layer_map, device="cpu")
    with pytest.raises(ValueError, match="expects 3 .MoE layers. or 4"):
        rrm.set_replay_data(model, batch[:, :, :2], layer_map=layer_map, device="cpu")
    with pytest.raises(ValueError, match="top-k 1"):
        rrm.set_replay_data(model, batch[..., :1], layer_map=layer_map, device="cpu")


# ---- the whole forward (CUDA) ---------------------------------------------------------------------

def forward(model, tokens: np.ndarray, device) -> torch.Tensor:
    ids = torch.from_numpy(tokens).to(device)
    positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
    with torch.no_grad():
        return model(ids, positions, None).float()  # [B, S, V]; attention_mask None: causal


def record_routers(model):
    """Forward hooks on the routers: each forward appends, per router, its chosen experts."""
    seen: list[list[torch.Tensor]] = [[] for _ in routers(model)]
    handles = []
    for slot, router in enumerate(routers(model)):
        def hook(module, inputs, output, slot=slot):
            routing_map = output[1]  # [tokens, E] bool, tokens in [s, b] order
            seen[slot].append(routing_map.detach().cpu())
        handles.append(router.register_forward_hook(hook))
    return seen, handles


def closed_loop(device, shift_request: int | None = None) -> dict:
    """Rollout per request, then a right-padded training forward under replay; returns what differs."""
    rng = np.random.default_rng(11)
    model = build_model(seed=3).to(device)
    lengths = [12, 7, 16, 9]
    prompts = [rng.integers(1, VOCAB, size=n) for n in lengths]
    fields, rollout_logits, truth = [], [], []
    for p in prompts:  # the "engine": one request at a time, routers record
        rrm.RouterReplay.set_global_router_replay_action(rrm.RouterReplayAction.RECORD)
        rollout_logits.append(forward(model, p[None], device)[0])
        recorded = rrm.RouterReplay.get_recorded_data()  # per layer [T, K], B = 1: token order
        rrm.RouterReplay.clear_global_indices()
        rrm.RouterReplay.clear_global_router_replay_action()
        routing = torch.stack(recorded, dim=1).cpu().numpy().astype(np.int16)[:-1]  # last token: no row
        fields.append(rr.to_base64_npy(routing))
        truth.append(routing)
    if shift_request is not None:
        r = rr.from_base64_npy(fields[shift_request])
        fields[shift_request] = rr.to_base64_npy(np.concatenate([r[1:], r[-1:]]))
    width = max(lengths)
    tokens = np.zeros((len(prompts), width), dtype=np.int64)
    mask = np.zeros_like(tokens)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)], mask[b, :len(p)] = p, 1
    batch = rrt.padded_batch(fields, mask, final_token="repeat", pad_rows="first_k")
    layer_map = rrt.LayerMap(MOE_LAYERS, len(LAYER_FREQ))
    seen, handles = record_routers(model)
    try:
        with rrm.replay(model, batch, layer_map=layer_map, device=device):
            logits = forward(model, tokens, device)
        with torch.no_grad():  # routers pushed off their own choice: replay must still hold
            for router in routers(model):
                router.weight.add_(torch.randn_like(router.weight))
        with rrm.replay(model, batch, layer_map=layer_map, device=device):
            forward(model, tokens, device)
        model.train()  # a training step under replay: same experts, and the routers get gradients
        with rrm.replay(model, batch, layer_map=layer_map, device=device):
            ids = torch.from_numpy(tokens).to(device)
            model(ids, torch.arange(ids.shape[1], device=device).expand_as(ids), None).float().pow(2).mean().backward()
        model.eval()
        router_grads = all(r.weight.grad is not None and r.weight.grad.abs().sum().item() > 0 for r in routers(model))
        forward(model, tokens, device)  # perturbed routers, no replay
    finally:
        for h in handles:
            h.remove()
    assert all(len(maps) == 4 for maps in seen), [len(maps) for maps in seen]
    wrong_rows = wrong_rows_perturbed = own_choice_differs = 0
    max_logit_diff = 0.0
    b_size = len(prompts)
    for slot in range(len(MOE_LAYERS)):
        for call, maps in enumerate(seen[slot]):  # replay, replay perturbed, training step, own choice
            for b, p in enumerate(prompts):
                want_all = truth[b]
                for t in range(len(p) - 1):  # tokens the rollout routed
                    got = sorted(torch.nonzero(maps[t * b_size + b]).flatten().tolist())
                    want = sorted(want_all[t, slot].tolist())
                    if call == 0:
                        wrong_rows += got != want
                    elif call in (1, 2):
                        wrong_rows_perturbed += got != want
                    else:
                        own_choice_differs += got != want
    for b, p in enumerate(prompts):
        n = len(p) - 1  # the final token's logits depend on its repeated row: compared up to it
        diff = (logits[b, :n] - rollout_logits[b][:n]).abs().max().item()
        max_logit_diff = max(max_logit_diff, diff)
    return {"wrong_rows": wrong_rows, "wrong_rows_perturbed": wrong_rows_perturbed,
            "own_choice_differs": own_choice_differs, "max_logit_diff": max_logit_diff, "router_grads": router_grads,
            "rows": sum(n - 1 for n in lengths) * len(MOE_LAYERS)}


LOGIT_TOLERANCE = 1e-4  # float32; the batch and the single-request forwards differ in summation order


@pytest.mark.skipif(not CUDA, reason="Megatron's TopKRouter.gating moves its weights to CUDA: a forward needs a GPU")
def test_closed_loop_forward(parallel_state):
    result = closed_loop("cuda")
    print("megatron closed loop:", result)
    assert result["wrong_rows"] == 0 and result["wrong_rows_perturbed"] == 0, result
    assert result["own_choice_differs"] > 0, result  # the perturbation did change the routers' own choice
    assert result["router_grads"], result
    assert result["max_logit_diff"] < LOGIT_TOLERANCE, result
    shifted = closed_loop("cuda", shift_request=2)
    assert shifted["wrong_rows"] > 0 and shifted["max_logit_diff"] > LOGIT_TOLERANCE, shifted


@pytest.mark.parametrize("pp,vpp,num_layers,first,last", [
    (2, None, 8, None, None), (4, 2, 16, None, None), (3, 2, 12, None, None), (4, None, 10, 1, 3),
    (3, 2, 14, 2, 4), (2, 3, 12, None, 6)])
def test_pipeline_layers_match_megatron(pp, vpp, num_layers, first, last):
    """training.pipeline_layers against megatron-core's own get_transformer_layer_offset and
    get_num_layers_to_build."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(num_layers=num_layers, hidden_size=32, num_attention_heads=4,
                               pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                               num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                               pipeline_dtype=torch.float32, use_cpu_initialization=True)
    for p in range(pp):
        for v in range(vpp or 1):
            layers = rrt.pipeline_layers(num_layers, pp, p, vpp, v if vpp else None, first_stage_layers=first,
                                         last_stage_layers=last)
            vp_stage = v if vpp else None
            assert layers[0] == get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=p)
            assert len(layers) == get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=p)


class _Group:
    """Stands for a context-parallel process group of `size` ranks, seen from `rank`: all that
    Megatron's get_batch_on_this_cp_rank asks of a group is its size() and rank()."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_split_matches_megatron(parallel_state, cp):
    """training.context_parallel_split against megatron-core's own get_batch_on_this_cp_rank."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    b, s = 3, 2 * cp * 4
    token = np.arange(b * s).reshape(b, s)
    routing = token[:, :, None, None]  # [B, S, L = 1, K = 1]: each row holds its token's index
    for rank in range(cp):
        theirs = get_batch_on_this_cp_rank({"tokens": torch.from_numpy(token.copy())}, cp_group=_Group(cp, rank))
        ours = rrt.context_parallel_split(routing, cp, rank)[:, :, 0, 0]
        assert theirs["tokens"].tolist() == ours.tolist()
