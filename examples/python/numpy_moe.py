#!/usr/bin/env python3
"""routing_replay on the host backend: a small numpy MoE language model generates greedily for a
left-padded batch of requests (prefill, then decode with a KV cache), and the routing its routers
chose is captured through routing_replay, checked bit-exact against the top-k of the router
logits, and written per request as .npy files and vLLM's base64 `routed_experts` field. The
generated tokens must be the same with and without capture.

The loop is the one of hf_qwen3_moe.py (a transformers model on the GPU); this one needs numpy only.

    python examples/python/numpy_moe.py --out build/numpy_moe --copy double_buffered
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import routing_replay as rr

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from padded_batch import PaddedBatch, add_arguments, left_pad  # noqa: E402


def gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(0.7978845608 * (x + 0.044715 * x**3)))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


class TinyMoE:
    """A decoder-only MoE transformer in numpy: one attention head per layer with a KV cache, a
    top-k routed expert FFN in MoE layers and a dense FFN in the others, tied embeddings."""

    def __init__(self, seed: int = 0, vocab: int = 96, hidden: int = 32, layers: int = 4, dense_layers=(1,),
                 experts: int = 16, top_k: int = 4, ffn: int = 24) -> None:
        rng = np.random.default_rng(seed)
        w = lambda *shape: rng.standard_normal(shape) / np.sqrt(shape[-2])  # noqa: E731
        self.vocab, self.hidden, self.experts, self.top_k = vocab, hidden, experts, top_k
        self.embedding = rng.standard_normal((vocab, hidden))
        self.moe_layers = [l for l in range(layers) if l not in dense_layers]
        self.layers = []
        for l in range(layers):
            layer = {"q": w(hidden, hidden), "k": w(hidden, hidden), "v": w(hidden, hidden), "o": w(hidden, hidden)}
            if l in self.moe_layers:
                layer.update(router=w(hidden, experts), up=w(experts, hidden, ffn), down=w(experts, ffn, hidden))
            else:
                layer.update(up=w(hidden, ffn), down=w(ffn, hidden))
            self.layers.append(layer)

    def new_cache(self, batch: int) -> list[list[np.ndarray]]:
        return [[np.zeros((batch, 0, self.hidden)), np.zeros((batch, 0, self.hidden))] for _ in self.layers]

    def forward(self, tokens, key_mask, positions, cache, on_router) -> np.ndarray:
        """Logits [B, T, vocab] for new tokens [B, T] at `positions`; `key_mask` [B, S + T] masks the
        padding among cached and new keys; `on_router(layer, logits [B*T, E], topk [B*T, K])`."""
        B, T = tokens.shape
        freq = np.exp(-np.arange(0, self.hidden, 2) / self.hidden * np.log(1000.0))
        angle = positions[..., None] * freq
        h = self.embedding[tokens] + np.concatenate([np.sin(angle), np.cos(angle)], axis=-1)
        for l, p in enumerate(self.layers):
            q, k, v = h @ p["q"], h @ p["k"], h @ p["v"]
            cache[l][0] = np.concatenate([cache[l][0], k], axis=1)
            cache[l][1] = np.concatenate([cache[l][1], v], axis=1)
            keys, values = cache[l]
            S = keys.shape[1] - T
            scores = q @ keys.transpose(0, 2, 1) / np.sqrt(self.hidden)
            causal = np.arange(S + T)[None, :] <= (S + np.arange(T))[:, None]
            allowed = causal[None] & (key_mask[:, None, :] > 0)
            scores = np.where(allowed, scores, -1e30)
            h = h + (softmax(scores) @ values) @ p["o"]
            x = h.reshape(B * T, self.hidden)
            if l in self.moe_layers:
                logits = x @ p["router"]
                topk = np.argsort(-logits, axis=-1, kind="stable")[:, : self.top_k]
                on_router(l, logits, topk)
                weights = softmax(np.take_along_axis(logits, topk, axis=-1))
                out = np.zeros_like(x)
                for e in range(self.experts):
                    rows, slot = np.nonzero(topk == e)
                    if rows.size:
                        out[rows] += weights[rows, slot, None] * (gelu(x[rows] @ p["up"][e]) @ p["down"][e])
            else:
                out = gelu(x @ p["up"]) @ p["down"]
            h = h + out.reshape(B, T, self.hidden)
        return h @ self.embedding.T


def generate(model: TinyMoE, prompts, new_tokens: int, replay: rr.Replay | None = None,
             batch: PaddedBatch | None = None) -> np.ndarray:
    """Greedy decode of `new_tokens` tokens per prompt; with a replay, every step is a
    routing_replay step and the routers' choices are captured."""
    tokens, mask, positions = left_pad(prompts)
    lengths = mask.sum(axis=1)
    cache = model.new_cache(len(prompts))

    def on_router(layer, logits, topk):
        if replay is not None:
            batch.record(replay.layer_slot(layer), np.argsort(-logits, axis=-1, kind="stable")[:, : model.top_k])
            replay.capture(layer, topk)

    def step(plan, step_tokens, key_mask, step_positions):
        if replay is None:
            return model.forward(step_tokens, key_mask, step_positions, cache, on_router)
        with replay.step(plan):
            return model.forward(step_tokens, key_mask, step_positions, cache, on_router)

    logits = step(batch.prefill() if batch else None, tokens, mask, positions)
    out = [logits[:, -1].argmax(axis=-1)]
    key_mask = mask
    for s in range(new_tokens - 1):
        key_mask = np.concatenate([key_mask, np.ones((len(prompts), 1), dtype=key_mask.dtype)], axis=1)
        logits = step(batch.decode(s) if batch else None, out[-1][:, None], key_mask, (lengths + s)[:, None])
        out.append(logits[:, -1].argmax(axis=-1))
    return np.stack(out, axis=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, requests=5, new_tokens=12)
    args = parser.parse_args(argv)

    model = TinyMoE(seed=args.seed)
    rng = np.random.default_rng(args.seed + 1)
    prompts = [list(rng.integers(1, model.vocab, size=int(rng.integers(3, 14)))) for _ in range(args.requests)]
    ids = [f"req-{i}" for i in range(args.requests)]
    opted_in = [i != 1 for i in range(args.requests)]  # request 1 did not ask for its routing
    block_size = 8 if args.storage == "block_slot" else 0
    batch = PaddedBatch(ids, [len(p) for p in prompts], opted_in, block_size=block_size,
                        max_len=max(len(p) for p in prompts) + args.new_tokens)
    replay = batch.make_replay(args, num_experts=model.experts, top_k=model.top_k, moe_layers=model.moe_layers,
                               num_model_layers=len(model.layers), device="cpu")
    return batch.run(replay, lambda r, b: generate(model, prompts, args.new_tokens, r, b), args)

if __name__ == "__main__":
    sys.exit(main())
