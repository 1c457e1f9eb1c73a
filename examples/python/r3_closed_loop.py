#!/usr/bin/env python3
"""R3 closed: rollout with capture, routing through vLLM's base64 field, training forward under replay.

1. Rollout: a small, randomly initialised Qwen3-MoE (example (a), hf_qwen3_moe.py: nothing is
   downloaded) generates greedily for a left-padded batch with routing_replay capturing its
   routers; each step's logits are kept (float32). Every request's routing leaves as the base64
   `routed_experts` field: one row per token that went through the model, T - 1 for T tokens.
2. Training batches of the same tokens (prompt + generated), built by routing_replay.training from
   the fields: a left-padded batch [B, S] with its attention mask, and a packed batch [1, N]
   (sequences aligned to 4 tokens, positions restarting per sequence: transformers' packed-sequence
   mask) with cu_seqlens. The final token is completed with final_token="repeat", padding with
   pad_rows="first_k".
3. Each training forward runs under routing_replay.hf.replay. Checked, for every request, token
   and MoE layer the rollout routed: the expert ids that reach the MoE blocks' experts equal the
   rollout's (exactly, in top-k order), and the logits equal the rollout's within --tolerance.
4. Negative control: one request's routing shifted by one position must fail the check.

    python examples/python/r3_closed_loop.py                      # on the GPU
    python examples/python/r3_closed_loop.py --device cpu         # host backend, CPU tensors

Exit status 0 when every check holds; a one-line summary per batch layout is printed. With --out,
the routing fields and a summary.json are written there (nothing is written without it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

import routing_replay as rr
from routing_replay import hf as rrh
from routing_replay import training as rrt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_qwen3_moe import generate, moe_layers, tiny_qwen3_moe  # noqa: E402
from padded_batch import PaddedBatch, add_arguments  # noqa: E402

#: float32 logits of the training forward against the rollout's (KV-cache decode, other batch
#: shapes): only the summation order differs. Measured: about 1e-6 on CPU.
TOLERANCE = 1e-4


def rollout(model, prompts, args):
    """Generates with capture; returns (tokens per request, fields, logits per request [T - 1, V])."""
    config = model.config
    ids = list(range(len(prompts)))
    batch = PaddedBatch(ids, [len(p) for p in prompts], [True] * len(prompts),
                        max_len=max(len(p) for p in prompts) + args.new_tokens)
    replay = batch.make_replay(args, num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                               moe_layers=moe_layers(model), num_model_layers=config.num_hidden_layers,
                               device=args.device)
    steps: list[torch.Tensor] = []
    generated = generate(model, prompts, args.new_tokens, args.device, replay, batch, logits_out=steps)
    results = batch.collect(replay, None)
    batch.check(results, replay.num_layers)  # the captured routing is the routers' top-k
    fields = [replay_field(results[i]) for i in ids]
    width = max(len(p) for p in prompts)
    sequences, logits = [], []
    for b, p in enumerate(prompts):
        sequences.append(np.concatenate([np.asarray(p), generated[b]]))
        prefill = steps[0][b, width - len(p):]  # left-padded prefill: the prompt's positions
        decode = [s[b] for s in steps[1:]]  # one row per decode step; the last token never went in
        logits.append(torch.cat([prefill] + decode).float().cpu())
        assert len(logits[-1]) == len(sequences[-1]) - 1 == len(rr.from_base64_npy(fields[b]))
    return sequences, fields, logits


def replay_field(routing: np.ndarray) -> str:
    """What a vLLM-style server would put in `routed_experts` (base64 of the .npy)."""
    return rr.to_base64_npy(routing)


def experts_seen(model):
    """Pre-hooks on each MoE block's experts: the top-k ids that reached them, per model layer."""
    seen: dict[int, list[torch.Tensor]] = {}
    handles = []
    for layer in rrh.routers(model):
        def hook(module, args, layer=layer):
            seen.setdefault(layer, []).append(args[1].detach().cpu())
        handles.append(model.model.layers[layer].mlp.experts.register_forward_pre_hook(hook))
    return seen, handles


def train_forward(model, sequences, fields, layout: str, device: str):
    """One training forward of `layout` under replay: (logits per request [T, V], experts per
    request [T, L, K]) over each request's own tokens."""
    layer_map = rrt.LayerMap(moe_layers(model), model.config.num_hidden_layers)
    lengths = [len(s) for s in sequences]
    if layout == "padded":  # left padding, as the rollout had
        width = max(lengths)
        tokens = np.zeros((len(sequences), width), dtype=np.int64)
        mask = np.zeros_like(tokens)
        for b, s in enumerate(sequences):
            tokens[b, width - len(s):], mask[b, width - len(s):] = s, 1
        routing = rrt.padded_batch(fields, mask, final_token="repeat", pad_rows="first_k")
        positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
        inputs = {"input_ids": tokens, "attention_mask": mask, "position_ids": positions}
        rows = [np.flatnonzero(mask[b]) + b * width for b in range(len(sequences))]  # router rows, batch-major
    else:
        packed = rrt.packed_batch(fields, lengths, final_token="repeat", align=4, pad_rows="first_k")
        cu = packed.cu_seqlens_padded
        tokens = np.zeros((1, int(cu[-1])), dtype=np.int64)
        positions = np.zeros_like(tokens)
        for b, s in enumerate(sequences):
            tokens[0, cu[b]:cu[b] + len(s)] = s
            positions[0, cu[b]:cu[b + 1]] = np.arange(cu[b + 1] - cu[b])  # padding continues its sequence
        routing = packed.routing
        inputs = {"input_ids": tokens, "position_ids": positions}  # no mask: packed-sequence mask from positions
        rows = [np.arange(cu[b], cu[b] + lengths[b]) for b in range(len(sequences))]
    seen, handles = experts_seen(model)
    try:
        with torch.no_grad(), rrh.replay(model, routing, layer_map=layer_map):
            out = model(**{k: torch.from_numpy(v).to(device) for k, v in inputs.items()}, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    flat_logits = out.logits.float().reshape(-1, out.logits.shape[-1]).cpu()
    layers = sorted(seen)
    experts = torch.stack([seen[layer][0] for layer in layers], dim=1).numpy()  # [router rows, L, K]
    return [flat_logits[r] for r in rows], [experts[r] for r in rows]


def check(sequences, fields_truth, logits_truth, logits, experts) -> tuple[int, int, float]:
    """(rows whose experts differ from the rollout's, rows compared, max |logit difference|) over
    every token the rollout routed (all but each request's last) and every MoE layer."""
    wrong = compared = 0
    diff = 0.0
    for b in range(len(sequences)):
        want = rr.from_base64_npy(fields_truth[b]).astype(np.int64)  # [T - 1, L, K]
        got = experts[b][:len(want)]
        wrong += int((got != want).any(axis=-1).sum())
        compared += want.shape[0] * want.shape[1]
        diff = max(diff, (logits[b][:len(want)] - logits_truth[b]).abs().max().item())
    return wrong, compared, diff


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (CUDA backend) or cpu (host backend)")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="max |logit difference|, float32")
    add_arguments(parser, requests=5, new_tokens=12)
    args = parser.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 here

    model = tiny_qwen3_moe(args.seed, args.device)
    rng = np.random.default_rng(args.seed + 1)
    prompts = [list(rng.integers(1, model.config.vocab_size, size=int(rng.integers(4, 20))))
               for _ in range(args.requests)]
    sequences, fields, logits_truth = rollout(model, prompts, args)

    ok = True
    summary = {"device": args.device, "requests": len(prompts), "tolerance": args.tolerance, "layouts": {}}
    shifted = list(fields)
    r = rr.from_base64_npy(fields[1])
    shifted[1] = rr.to_base64_npy(np.concatenate([r[1:], r[-1:]]))  # one request off by one position
    for layout in ("padded", "packed"):
        logits, experts = train_forward(model, sequences, fields, layout, args.device)
        wrong, compared, diff = check(sequences, fields, logits_truth, logits, experts)
        passed = wrong == 0 and diff <= args.tolerance
        logits_s, experts_s = train_forward(model, sequences, shifted, layout, args.device)
        wrong_s, _, diff_s = check(sequences, fields, logits_truth, logits_s, experts_s)
        caught = wrong_s > 0 and diff_s > args.tolerance
        ok = ok and passed and caught
        summary["layouts"][layout] = {"rows": compared, "wrong_rows": wrong, "max_logit_diff": diff,
                                      "shifted_wrong_rows": wrong_s, "shifted_max_logit_diff": diff_s,
                                      "pass": passed, "shift_caught": caught}
        print(f"{layout}: {compared} (token, layer) rows of {len(prompts)} requests replayed, {wrong} differ from "
              f"the rollout; max |logit diff| {diff:.2e} (tolerance {args.tolerance:.0e}); one request shifted by "
              f"one position: {wrong_s} rows differ, max |logit diff| {diff_s:.2e} -> "
              f"{'PASS' if passed and caught else 'FAIL'}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "routed_experts.json"), "w") as f:
            json.dump({str(i): field for i, field in enumerate(fields)}, f)
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
