#!/usr/bin/env python3
"""routing_replay with a transformers model: a small, randomly initialised Qwen3-MoE (nothing is
downloaded) generates greedily for a left-padded batch of requests (prefill, then decode with the
KV cache). Forward hooks on the MoE routers capture the experts each router chose through
routing_replay (CUDA backend on a GPU); the captured routing is checked bit-exact against the
top-k of the router logits (recomputed from the logits each router returns), and the generated
tokens must be the same as without capture. Each request's routing is written as .npy and as vLLM's `routed_experts` field.

    python examples/python/hf_qwen3_moe.py                 # on the GPU
    python examples/python/hf_qwen3_moe.py --device cpu    # host backend, CPU tensors

numpy_moe.py runs the same loop with a numpy model on the host backend.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import routing_replay as rr

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from padded_batch import PaddedBatch, add_arguments, left_pad  # noqa: E402


def tiny_qwen3_moe(seed: int, device: str) -> Qwen3MoeForCausalLM:
    """Four layers, layer 1 dense (mlp_only_layers), 16 experts, top-4; random weights."""
    config = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=16, num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[1],
                            max_position_embeddings=256, norm_topk_prob=True, attn_implementation="eager")
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config).to(device).eval()


def moe_layers(model: Qwen3MoeForCausalLM) -> list[int]:
    """Model layers whose MLP is a routed-expert block (the layer map)."""
    return [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]


@torch.inference_mode()
def generate(model, prompts, new_tokens: int, device: str, replay: rr.Replay | None = None,
             batch: PaddedBatch | None = None, logits_out: list | None = None) -> np.ndarray:
    """Greedy decode; with a replay, each forward is a routing_replay step whose routers are
    captured by forward hooks, and the reference top-k is recomputed from the router logits.
    `logits_out` (a list) receives each step's logits [B, tokens of the step, V] (r3_closed_loop.py)."""
    hooks = []
    layers = moe_layers(model)
    step_logits: dict[int, torch.Tensor] = {}
    if replay is not None:
        def on_router(layer, output):
            # Qwen3MoeTopKRouter returns (router_logits [tokens, E], routing_weights, router_indices [tokens, K])
            replay.capture(layer, output[2])
            step_logits[replay.layer_slot(layer)] = output[0]

        for layer in layers:
            hooks.append(model.model.layers[layer].mlp.gate.register_forward_hook(
                lambda module, inputs, output, layer=layer: on_router(layer, output)))
    tokens, mask, positions = (torch.from_numpy(a).to(device) for a in left_pad(prompts))
    lengths = mask.sum(dim=1)
    top_k = model.config.num_experts_per_tok

    def step(plan, **inputs):
        if replay is None:
            out = model(**inputs, use_cache=True)
        else:
            with replay.step(plan):
                out = model(**inputs, use_cache=True)
            for slot, logits in step_logits.items():  # the reference: top-k of the router's softmax
                probs = torch.softmax(logits, dim=-1, dtype=torch.float)
                batch.record(slot, torch.topk(probs, top_k, dim=-1).indices.cpu().numpy())
        if logits_out is not None:
            logits_out.append(out.logits)
        return out

    try:
        out = step(batch.prefill() if batch else None, input_ids=tokens, attention_mask=mask, position_ids=positions)
        generated = [out.logits[:, -1].argmax(dim=-1)]
        for s in range(new_tokens - 1):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = step(batch.decode(s) if batch else None, input_ids=generated[-1][:, None], attention_mask=mask,
                       position_ids=(lengths + s)[:, None], past_key_values=out.past_key_values)
            generated.append(out.logits[:, -1].argmax(dim=-1))
    finally:
        for handle in hooks:
            handle.remove()
    return torch.stack(generated, dim=1).cpu().numpy()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (CUDA backend) or cpu (host backend)")
    add_arguments(parser, requests=6, new_tokens=16)
    args = parser.parse_args(argv)

    model = tiny_qwen3_moe(args.seed, args.device)
    config = model.config
    rng = np.random.default_rng(args.seed + 1)
    prompts = [list(rng.integers(1, config.vocab_size, size=int(rng.integers(4, 20)))) for _ in range(args.requests)]
    ids = [f"req-{i}" if i % 2 == 0 else i for i in range(args.requests)]
    opted_in = [i != 1 for i in range(args.requests)]  # request 1 did not ask for its routing
    block_size = 8 if args.storage == "block_slot" else 0
    batch = PaddedBatch(ids, [len(p) for p in prompts], opted_in, block_size=block_size,
                        max_len=max(len(p) for p in prompts) + args.new_tokens)
    replay = batch.make_replay(args, num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                               moe_layers=moe_layers(model), num_model_layers=config.num_hidden_layers,
                               device=args.device)
    return batch.run(replay, lambda r, b: generate(model, prompts, args.new_tokens, args.device, r, b), args)

if __name__ == "__main__":
    sys.exit(main())
