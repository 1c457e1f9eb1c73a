#!/usr/bin/env python3
"""Rollout to trainer through Ray: routes captured by the SGLang adapter, moved as route records by
reference, replayed by trainer-rank actors into the same model, logits checked.

1. A rollout actor runs a small, randomly initialised Qwen3-MoE (hf_qwen3_moe.py: nothing is
   downloaded) greedily over a left-padded batch, with routing_replay.sglang's
   ``RoutedExpertsCapturer`` on the host backend capturing its routers as SGLang's engine drives it
   (``capture`` per MoE layer, ``on_forward_end`` with the step's KV slots, ``get_topk`` per
   finished request). Each request's routing becomes a route record (``routing_replay.wire``), and
   ``routing_replay.ray.publish`` puts the records into Ray's object store; the actor returns the
   sequences, the references (no payload) and its logits.
2. Trainer-rank actors (data parallel, ``--ranks``) each build their share of the batch with
   ``routing_replay.ray.rank_routing`` (a packed batch, sequences aligned to 4 tokens, the final token
   completed with ``final_token="repeat"``, padding ``pad_rows="first_k"``), decoding only their
   samples' records where they lie in the object store, and run one training forward of their
   share under ``routing_replay.hf.replay``.
3. Checked on every rank, for every token the rollout routed and every MoE layer: the experts that
   reach the MoE blocks equal the rollout's, and the logits equal the rollout's within
   ``--tolerance``; the same routing one row off must move them past it, and a record handed with
   the wrong token count must be refused (``RecordMismatchError``).

    python examples/python/ray_rollout_to_trainer.py            # starts a Ray cluster of this machine

Exit status 0 when every check holds; one line per rank is printed.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

import numpy as np
import ray
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from hf_qwen3_moe import moe_layers, tiny_qwen3_moe  # noqa: E402
from padded_batch import left_pad  # noqa: E402

#: float32 logits of the training forward against the rollout's (KV-cache decode, other batch
#: shapes): only the summation order differs. Measured: about 1e-6 on CPU.
TOLERANCE = 1e-4
#: the packed batch's alignment (context parallel 2 would want 2 * CP = 4)
ALIGN = 4


class Rollout:
    """The rollout engine: generates with capture, publishes the batch's route records. It owns the
    objects it publishes, so it stays alive until the trainers have fetched them."""

    def __init__(self, seed: int) -> None:
        torch.set_num_threads(1)  # the actors share the machine's cores
        self.model = tiny_qwen3_moe(seed, "cpu")

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], new_tokens: int):
        """(sequences [T_b], RouteRefs, logits [T_b - 1, V] float32) of each request."""
        from routing_replay import ray as rr_ray
        from routing_replay import wire
        from routing_replay.sglang import RoutedExpertsCapturer

        model, config = self.model, self.model.config
        layers = moe_layers(model)
        b = len(prompts)
        max_len = max(len(p) for p in prompts) + new_tokens
        # KV slots as SGLang's req_to_token_pool holds them; slot 0 takes the padding tokens' rows
        req_to_token = (1 + np.arange(b * max_len, dtype=np.int32)).reshape(b, max_len)
        pool = SimpleNamespace(req_to_token=req_to_token)
        capturer = RoutedExpertsCapturer(SimpleNamespace(hf_text_config=config), num_tokens=1 + b * max_len,
                                         max_running_requests=b, num_fused_shared_experts=0, device="cpu",
                                         max_batch_size=b * max_len)
        hooks = [model.model.layers[layer].mlp.gate.register_forward_hook(
            lambda module, inputs, output, layer=layer: capturer.capture(layer, output[2])) for layer in layers]

        def forward(slots: np.ndarray, **inputs):
            out = model(**inputs, use_cache=True)
            batch = SimpleNamespace(out_cache_loc=torch.from_numpy(slots.astype(np.int64)), out_cache_loc_virtual=None)
            capturer.on_forward_end(batch, can_run_graph=False, cuda_graph_batch=None)
            return out

        try:
            tokens, mask, positions = left_pad(prompts)
            lengths = mask.sum(axis=1)
            width = tokens.shape[1]
            prefill_slots = np.where(mask == 1, req_to_token[np.arange(b)[:, None], positions], 0).reshape(-1)
            mask_t = torch.from_numpy(mask)
            out = forward(prefill_slots, input_ids=torch.from_numpy(tokens), attention_mask=mask_t,
                          position_ids=torch.from_numpy(positions))
            logits = [[out.logits[i, width - lengths[i]:].float()] for i in range(b)]
            generated = [out.logits[:, -1].argmax(dim=-1)]
            for s in range(new_tokens - 1):
                mask_t = torch.cat([mask_t, torch.ones_like(mask_t[:, :1])], dim=1)
                pos = lengths + s
                out = forward(req_to_token[np.arange(b), pos], input_ids=generated[-1][:, None], attention_mask=mask_t,
                              position_ids=torch.from_numpy(pos)[:, None], past_key_values=out.past_key_values)
                for i in range(b):
                    logits[i].append(out.logits[i, -1:].float())
                generated.append(out.logits[:, -1].argmax(dim=-1))
        finally:
            for h in hooks:
                h.remove()
        generated = torch.stack(generated, dim=1).numpy()
        sequences, records, logits_out = [], [], []
        for i, p in enumerate(prompts):
            seq = np.concatenate([np.asarray(p, dtype=np.int64), generated[i]])
            # SGLang's get_topk: int32 [T - 1, num_hidden_layers, K], the dense layers' rows 0
            rows = np.asarray(capturer.get_topk(i, len(seq), pool))[:, layers]
            records.append(wire.encode(rows, int(config.num_experts), layer_map=layers))
            sequences.append(seq)
            logits_out.append(torch.cat(logits[i]).numpy())
            assert len(logits_out[-1]) == len(seq) - 1 == len(rows)
        capturer.destroy()
        refs = rr_ray.publish(records, samples=[f"req-{i}" for i in range(b)])
        return sequences, refs, logits_out


class Trainer:
    """A data-parallel trainer rank: its share of the batch's routing through Ray, one replayed forward."""

    def __init__(self, seed: int, dp_rank: int, dp_size: int) -> None:
        torch.set_num_threads(1)
        self.model = tiny_qwen3_moe(seed, "cpu")
        self.dp_rank, self.dp_size = dp_rank, dp_size

    @torch.no_grad()
    def step(self, sequences, refs, logits_truth, tolerance: float) -> dict:
        from routing_replay import hf as rrh
        from routing_replay import ray as rr_ray
        from routing_replay import training as rrt

        model = self.model
        layer_map = rrt.LayerMap(moe_layers(model), model.config.num_hidden_layers)
        place = rr_ray.RankPlace(dp_rank=self.dp_rank, dp_size=self.dp_size)
        lengths = [len(s) for s in sequences]
        routing = rr_ray.rank_routing(refs, place, layer_map=layer_map, num_tokens=lengths, final_token="repeat",
                                      align=ALIGN, pad_rows="first_k")
        per = len(sequences) // self.dp_size
        mine = range(self.dp_rank * per, (self.dp_rank + 1) * per)
        padded = [-(-lengths[i] // ALIGN) * ALIGN for i in mine]
        cu = np.concatenate([[0], np.cumsum(padded)])
        assert routing.shape[0] == cu[-1]
        tokens = np.zeros((1, int(cu[-1])), dtype=np.int64)
        positions = np.zeros_like(tokens)
        for j, i in enumerate(mine):
            tokens[0, cu[j]:cu[j] + lengths[i]] = sequences[i]
            positions[0, cu[j]:cu[j + 1]] = np.arange(cu[j + 1] - cu[j])  # padding continues its sequence
        seen: dict[int, torch.Tensor] = {}
        hooks = [model.model.layers[layer].mlp.experts.register_forward_pre_hook(
            lambda module, args, layer=layer: seen.__setitem__(layer, args[1].detach().clone()))
            for layer in layer_map.moe_layers]
        inputs = {"input_ids": torch.from_numpy(tokens), "position_ids": torch.from_numpy(positions)}
        try:
            with rrh.replay(model, routing, layer_map=layer_map):  # no mask: packed sequences from positions
                out = model(**inputs, use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        logits = out.logits[0].float().numpy()
        # negative control: the same routing one row off must move the logits past the tolerance
        with rrh.replay(model, np.roll(routing, 1, axis=0), layer_map=layer_map):
            shifted = model(**inputs, use_cache=False).logits[0].float().numpy()
        experts = torch.stack([seen[layer] for layer in layer_map.moe_layers], dim=1).numpy()  # [N, L, K]
        wrong = compared = 0
        diff = shift_diff = 0.0
        for j, i in enumerate(mine):
            want = rr_ray.fetch(refs[i]).astype(np.int64)  # the rollout's rows: [T - 1, L, K]
            got = experts[cu[j]:cu[j] + len(want)]
            wrong += int((got != want).any(axis=-1).sum())
            compared += want.shape[0] * want.shape[1]
            diff = max(diff, float(np.abs(logits[cu[j]:cu[j] + len(want)] - logits_truth[i]).max()))
            shift_diff = max(shift_diff, float(np.abs(shifted[cu[j]:cu[j] + len(want)] - logits_truth[i]).max()))
        # a record handed with another sample's token count is refused, naming the sample
        off = list(lengths)
        off[mine[0]] += 1
        try:
            rr_ray.rank_routing(refs, place, layer_map=layer_map, num_tokens=off, final_token="repeat", align=ALIGN)
            refused = None
        except rr_ray.RecordMismatchError as e:
            refused = str(e)
        return {"dp_rank": self.dp_rank, "samples": len(mine), "rows": compared, "wrong_rows": wrong,
                "max_logit_diff": diff, "shifted_max_logit_diff": shift_diff, "route_bytes": int(routing.nbytes),
                "refused": refused, "pass": wrong == 0 and diff <= tolerance and shift_diff > tolerance and refused is not None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4, help="batch size (a multiple of --ranks)")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel trainer ranks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="max |logit difference|, float32")
    args = parser.parse_args(argv)

    started = not ray.is_initialized()
    if started:
        # the actors import this file's modules by name: hand the workers its folder
        path = os.pathsep.join([HERE] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR", log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        rng = np.random.default_rng(args.seed + 1)
        prompts = [rng.integers(1, 256, size=int(rng.integers(4, 20))).tolist() for _ in range(args.requests)]
        rollout = ray.remote(num_cpus=0)(Rollout).remote(args.seed)
        sequences, refs, logits = ray.get(rollout.run.remote(prompts, args.new_tokens))
        trainer_cls = ray.remote(num_cpus=0)(Trainer)
        trainers = [trainer_cls.remote(args.seed, r, args.ranks) for r in range(args.ranks)]
        results = ray.get([t.step.remote(sequences, refs, logits, args.tolerance) for t in trainers])
        ok = True
        for r in results:
            ok = ok and r["pass"]
            print(f"rank {r['dp_rank']}: {r['samples']} requests, {r['rows']} (token, layer) rows replayed from "
                  f"route records through Ray ({r['route_bytes']} bytes of routing on the rank), {r['wrong_rows']} "
                  f"differ from the rollout; max |logit diff| {r['max_logit_diff']:.2e} (tolerance "
                  f"{args.tolerance:.0e}), one row off: {r['shifted_max_logit_diff']:.2e}; a wrong token count refused: "
                  f"{r['refused'] is not None} -> "
                  f"{'PASS' if r['pass'] else 'FAIL'}")
        for actor in trainers + [rollout]:
            ray.kill(actor)
        return 0 if ok else 1
    finally:
        if started:
            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
