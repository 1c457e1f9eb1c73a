"""Megatron-core on real ranks: the rollout's routing, handed to every rank by routing_replay.megatron.

scripts/training_gpu_check_multi.sh runs it (megatron-core from its wheel, two GPUs, NCCL):

    python3 python/tests/megatron_ranks.py reference --dir DIR                      # one GPU
    torchrun --nproc-per-node 2 python/tests/megatron_ranks.py layout --layout tp2_sp --dir DIR

``reference`` (one process): a small MoE ``GPTModel`` (8 layers, layer 1 dense, 8 experts, top-2,
float32) serves a rollout, each request alone with its routers in ``RECORD`` mode; each request's
routing becomes vLLM's base64 ``routed_experts`` field. The router weights are then perturbed (so
that the routers' own choice differs from the rollout's) and one training step runs under replay
through Megatron-core's own schedule (``get_forward_backward_func``): 4 micro-batches of 2
right-padded sequences, each micro-batch's routing set in its forward step. Its per-micro-batch
losses and router weight gradients, and the losses with one request's routing shifted by one
position, go to ``DIR/reference.pt`` with both sets of weights.

``layout`` (every rank): the same model split over the ranks of a layout (``LAYOUTS``), each rank
loading its tensor-parallel slices and pipeline layers of the reference's weights, then:

A. forward at the rollout's weights, no replay: the experts each router chose equal the rollout's
   for every token the rank holds. Which token a router row is comes from plain loops over
   Megatron-core's documented placement (sequence-parallel slices, ``[s, b]`` flattening), not from
   routing_replay, so this pass checks where Megatron-core really puts each token;
B. forward at the perturbed weights, no replay: some experts differ (the replay has work to do);
C. the training step under replay (``routing_replay.megatron.set_replay_data`` in every forward
   step, ``vp_stage`` per model chunk when interleaved): the experts every router used equal the
   rollout's for every token on every rank; each micro-batch's loss equals the single-GPU one
   within ``LOSS_TOLERANCE``; the router weight gradients (summed over the tensor-parallel group
   under sequence parallelism) equal the single-GPU ones within ``GRAD_TOLERANCE``;
D. the same with request ``SHIFTED``'s routing shifted by one position: every rank that holds a
   token of it sees experts differ from the rollout's, the others none, and the loss of its
   micro-batch leaves the tolerance (while matching the single-GPU run of the same shifted routing).

Rank 0 prints one line, ``PASS ...`` or ``FAIL ...``, and writes ``DIR/<layout>.json``.

``--cpu``: gloo and CPU tensors, with the few CUDA calls of Megatron-core's router and schedules
pointed at the CPU; only for running this program where there is no GPU (the check of the program
itself); the results that count come from GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

E, K, HIDDEN, HEADS, FFN, MOE_FFN, VOCAB = 8, 2, 64, 4, 128, 32, 128
LAYER_FREQ = [1, 0, 1, 1, 1, 1, 1, 1]  # model layer 1 is dense, the other seven MoE
MOE_LAYERS = [i for i, f in enumerate(LAYER_FREQ) if f]
LENGTHS = [16, 9, 13, 5, 16, 11, 7, 14]  # tokens per request (prompt + generated)
WIDTH = 16  # padded sequence length of every micro-batch
MICRO_BATCH = 2  # sequences per micro-batch: 4 micro-batches
SHIFTED = 5  # the request whose routing is shifted by one position in pass D (micro-batch 2)
#: float32; the ranks sum in another order than one GPU (tensor-parallel reductions, the
#: micro-batches of the interleaved schedule): a difference of that kind is around 1e-6.
LOSS_TOLERANCE = 1e-4
#: router weight gradients: max |ours - single GPU| over max |single GPU|, per layer
GRAD_TOLERANCE = 1e-3

LAYOUTS = {
    "tp2_sp": {"label": "(a) tensor parallel 2 + sequence parallel", "tp": 2, "pp": 1, "vpp": None, "sp": True},
    # With two stages each rank's previous and next stage are the same rank, and megatron-core's
    # default batched exchange (batch_p2p_comm) posts the activation and the gradient for it in an
    # order the receiver does not share: the activations of later micro-batches arrive wrong (seen
    # here on gloo: every router replayed the right experts, the loss of micro-batches 2 and 3 was
    # off by 1e-2). Megatron-LM's training loop overlaps the exchange instead, which keeps the two
    # apart; the check does the same.
    "pp2_vpp2": {"label": "(b) pipeline parallel 2 x 2 virtual stages (interleaved)", "tp": 1, "pp": 2, "vpp": 2,
                 "sp": False, "p2p": {"overlap_p2p_comm": True, "batch_p2p_comm": False}},
    # the same with megatron-core's default exchange: not a pass condition, it shows what a trainer
    # on these defaults gets (scripts/training_gpu_check_multi.sh prints it as a note)
    "pp2_vpp2_batch_p2p": {"label": "(b) with megatron-core's default batched p2p exchange", "tp": 1, "pp": 2,
                           "vpp": 2, "sp": False},
}
SINGLE = {"label": "one GPU", "tp": 1, "pp": 1, "vpp": None, "sp": False}


# ---- setup --------------------------------------------------------------------------------------

def emulate_cuda_on_cpu() -> None:
    """Points the CUDA calls a forward and backward of this model make (router gating, the causal
    mask, the schedules' token counter, pipeline send/receive buffers) at the CPU. For running this
    program without a GPU."""
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as tp_random
    import megatron.core.transformer.utils as transformer_utils

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None

    class _Torch:  # a module's `torch`, where device="cuda" means the CPU
        def __getattr__(self, name):
            value = getattr(torch, name)
            if not callable(value) or isinstance(value, type):
                return value

            def call(*args, **kwargs):
                if kwargs.get("device") == "cuda":
                    kwargs["device"] = "cpu"
                return value(*args, **kwargs)
            return call

    schedules.torch = _Torch()
    transformer_utils.torch = _Torch()

    # dropout is 0: the attention's fork of the CUDA RNG state has nothing to fork on the CPU
    tp_random.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()


def init(cpu: bool, layout: dict) -> torch.device:
    """Process group (NCCL, or gloo with --cpu) and Megatron's model-parallel state."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core import parallel_state as ps

    if not hasattr(moe_utils, "te_general_gemm"):
        # megatron-core 0.16.1 without Transformer Engine: router_gating_linear tests
        # `te_general_gemm is not None`, a name bound only when TE imports; None selects torch.mm
        moe_utils.te_general_gemm = None
    if cpu:
        emulate_cuda_on_cpu()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 500))
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if cpu:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if cpu else "nccl", rank=rank, world_size=world)
    ps.initialize_model_parallel(tensor_model_parallel_size=layout["tp"], pipeline_model_parallel_size=layout["pp"],
                                 virtual_pipeline_model_parallel_size=layout["vpp"])
    if not cpu:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
    return device


class SequenceParallelNorm(torch.nn.LayerNorm):
    """torch's LayerNorm with its parameters marked ``sequence_parallel`` (under sequence
    parallelism their gradients are partial sums over the tensor-parallel group, as with Megatron's
    own fused norms). megatron-core 0.16.1's ``WrappedTorchNorm``, the norm of its local layers
    when neither Apex nor Transformer Engine is installed, refuses sequence parallelism for want of
    that mark; the arithmetic is the same per token."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs) -> None:
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel


def with_sequence_parallel_norms(spec):
    """`spec` with every WrappedTorchNorm replaced by SequenceParallelNorm (same parameters)."""
    import dataclasses

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return SequenceParallelNorm
    if isinstance(spec, list):
        return [with_sequence_parallel_norms(s) for s in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: with_sequence_parallel_norms(getattr(spec, f.name))
                                            for f in dataclasses.fields(spec) if f.init})
    return spec


def build_chunks(layout: dict, device: torch.device, seed: int = 0) -> list:
    """This rank's model chunks (one per virtual pipeline stage), routers replaying."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.transformer_config import TransformerConfig

    RouterReplay.clear_global_router_replay_instances()
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=len(LAYER_FREQ), hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=MOE_FFN, moe_layer_freq=LAYER_FREQ,
        moe_enable_routing_replay=True, moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
        add_bias_linear=False, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, moe_router_dtype="fp32", tensor_model_parallel_size=layout["tp"],
        sequence_parallel=layout["sp"], pipeline_model_parallel_size=layout["pp"],
        virtual_pipeline_model_parallel_size=layout["vpp"], pipeline_dtype=torch.float32, **layout.get("p2p", {}))
    chunks = []
    for v in range(layout["vpp"] or 1):
        vp_stage = v if layout["vpp"] else None
        spec = with_sequence_parallel_norms(
            get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage))
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=WIDTH,
                         position_embedding_type="rope",
                         pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                         post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                         vp_stage=vp_stage)
        chunks.append(model.to(device).train())
    return chunks


def routers(chunks) -> dict[int, torch.nn.Module]:
    """This rank's routers by 0-based model layer (their own layer_number: pipeline offsets included)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return {int(m.layer_number) - 1: m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)}


def full_name(chunk, name: str) -> str:
    """A chunk's parameter name in the one-GPU model: decoder.layers.<local>. -> <global layer>."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(chunk.decoder.layers[int(parts[2])].layer_number - 1)
    return ".".join(parts)


def load_weights(chunks, weights: dict[str, torch.Tensor], tp: int, tp_rank: int) -> list[str]:
    """Copies this rank's part of the one-GPU model's weights into its chunks; returns the names."""
    loaded = []
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            key = full_name(chunk, name)
            value = weights[key]
            if getattr(param, "tensor_model_parallel", False) and tp > 1:
                if getattr(param, "partition_stride", 1) != 1:
                    raise RuntimeError(f"{key}: partition stride {param.partition_stride} is not handled")
                value = value.chunk(tp, dim=param.partition_dim)[tp_rank]
            if value.shape != param.shape:
                raise RuntimeError(f"{key}: rank's shape {tuple(param.shape)}, slice {tuple(value.shape)}")
            with torch.no_grad():
                param.copy_(value)
            loaded.append(key)
    return loaded


# ---- data ---------------------------------------------------------------------------------------

def requests():
    """Token ids per request (fixed seed)."""
    rng = np.random.default_rng(7)
    return [rng.integers(1, VOCAB, size=n).astype(np.int64) for n in LENGTHS]


def micro_batches(tokens, device) -> list[dict]:
    """Right-padded micro-batches [MICRO_BATCH, WIDTH]: labels are the next token, the loss mask
    covers every token that has one."""
    out = []
    for m in range(len(tokens) // MICRO_BATCH):
        ids = np.zeros((MICRO_BATCH, WIDTH), dtype=np.int64)
        labels = np.zeros_like(ids)
        mask = np.zeros_like(ids)
        loss_mask = np.zeros((MICRO_BATCH, WIDTH), dtype=np.float32)
        for b in range(MICRO_BATCH):
            t = tokens[m * MICRO_BATCH + b]
            ids[b, :len(t)], mask[b, :len(t)] = t, 1
            labels[b, :len(t) - 1] = t[1:]
            loss_mask[b, :len(t) - 1] = 1.0
        out.append({"index": m, "mask": mask,
                    "tokens": torch.from_numpy(ids).to(device),
                    "positions": torch.arange(WIDTH, device=device).expand(MICRO_BATCH, WIDTH).contiguous(),
                    "labels": torch.from_numpy(labels).to(device),
                    "loss_mask": torch.from_numpy(loss_mask).to(device)})
    return out


def rank_positions(tp: int, tp_rank: int, sp: bool) -> list[int]:
    """The positions s of a [MICRO_BATCH, WIDTH] micro-batch this rank's routers see, in row order:
    router row i is sequence i % MICRO_BATCH at position rank_positions[i // MICRO_BATCH]. Plain
    loops over Megatron-core's placement (the embedding's output [s, b, h] is scattered along s to
    the tensor-parallel ranks under sequence parallelism), written apart from routing_replay."""
    positions = list(range(WIDTH))
    if sp and tp > 1:
        per_rank = WIDTH // tp
        positions = [s for s in positions if s // per_rank == tp_rank]
    return positions


# ---- one training step through Megatron-core's schedule ------------------------------------------

def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float()
    loss = torch.sum(losses * loss_mask) / loss_mask.sum()
    return loss, {"loss": loss.detach().clone()}


def run_schedule(chunks, batches, replay=None, forward_only=False) -> list[float]:
    """Megatron-core's schedule over the micro-batches; `replay`: per micro-batch, the padded batch
    routing handed to the routers in its forward step (None: the routers choose). Returns the
    per-micro-batch losses on the last pipeline stage, [] elsewhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from routing_replay import megatron as rrm
    from routing_replay import training as rrt

    layer_map = rrt.LayerMap(MOE_LAYERS, len(LAYER_FREQ))
    interleaved = len(chunks) > 1

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        if replay is not None:
            # interleaved: this chunk's routers only (the other chunk may be at another micro-batch)
            rrm.set_replay_data(chunks if interleaved else model, replay[mb["index"]], layer_map=layer_map,
                                vp_stage=model.vp_stage if interleaved else None)
        output = model(mb["tokens"], mb["positions"], None, labels=mb["labels"])
        return output, functools.partial(loss_func, mb["loss_mask"])

    forward_backward = get_forward_backward_func()
    try:
        out = forward_backward(
            forward_step_func=forward_step,
            data_iterator=[iter(batches) for _ in chunks] if interleaved else iter(batches),
            model=chunks if interleaved else chunks[0], num_microbatches=len(batches), seq_length=WIDTH,
            micro_batch_size=MICRO_BATCH, forward_only=forward_only)
    finally:
        RouterReplay.clear_global_indices()
        RouterReplay.clear_global_router_replay_action()
    return [float(x["loss"]) for x in out]


class ExpertLog:
    """Forward hooks on this rank's routers: per model layer, the experts of every row, per call."""

    def __init__(self, chunks) -> None:
        self.seen: dict[int, list[np.ndarray]] = {}
        self.handles = []
        for layer, router in routers(chunks).items():
            self.seen[layer] = []
            self.handles.append(router.register_forward_hook(functools.partial(self._hook, layer)))

    def _hook(self, layer, module, inputs, output):
        routing_map = output[1].detach().cpu().numpy()  # [rows, E] bool, rows in [s, b] order
        self.seen[layer].append(np.sort(np.nonzero(routing_map)[1].reshape(len(routing_map), K), axis=1))

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def compare(self, truth, positions) -> dict[int, list[int]]:
        """Per request: [rows compared, rows whose experts differ from `truth`], over every router
        and micro-batch of this rank; rows the rollout routed only (not the final token, not padding)."""
        stats = {q: [0, 0] for q in range(len(truth))}
        for layer, calls in self.seen.items():
            slot = MOE_LAYERS.index(layer)
            if len(calls) != len(truth) // MICRO_BATCH:
                raise RuntimeError(f"router of layer {layer} ran {len(calls)} times for "
                                   f"{len(truth) // MICRO_BATCH} micro-batches")
            for m, experts in enumerate(calls):
                if len(experts) != len(positions) * MICRO_BATCH:
                    raise RuntimeError(f"router of layer {layer} saw {len(experts)} rows, expected "
                                       f"{len(positions) * MICRO_BATCH}")
                for i, got in enumerate(experts):
                    q, s = m * MICRO_BATCH + i % MICRO_BATCH, positions[i // MICRO_BATCH]
                    if s < LENGTHS[q] - 1:
                        stats[q][0] += 1
                        stats[q][1] += int(not np.array_equal(got, np.sort(truth[q][s, slot])))
        return stats


def observe(chunks, batches, truth, positions, **kwargs) -> tuple[dict, list[float]]:
    log = ExpertLog(chunks)
    try:
        losses = run_schedule(chunks, batches, **kwargs)
    finally:
        log.close()
    return log.compare(truth, positions), losses


def replay_batches(fields, batches) -> list[np.ndarray]:
    from routing_replay import training as rrt

    return [rrt.padded_batch(fields[b["index"] * MICRO_BATCH:(b["index"] + 1) * MICRO_BATCH], b["mask"],
                             final_token="repeat", pad_rows="first_k") for b in batches]


def shifted_fields(fields) -> list[str]:
    import routing_replay as rr

    out = list(fields)
    r = rr.from_base64_npy(out[SHIFTED])
    out[SHIFTED] = rr.to_base64_npy(np.concatenate([r[1:], r[-1:]]))
    return out


def router_grads(chunks, layout) -> dict[int, torch.Tensor]:
    """Router weight gradients by model layer, summed over the tensor-parallel group where each
    rank saw its sequence-parallel slice of the tokens."""
    from megatron.core import parallel_state as ps

    grads = {}
    for layer, router in routers(chunks).items():
        g = router.weight.grad.detach().clone()
        if layout["sp"] and layout["tp"] > 1:
            dist.all_reduce(g, group=ps.get_tensor_model_parallel_group())
        grads[layer] = g.cpu()
    return grads


def weights_of(chunks) -> dict[str, torch.Tensor]:
    return {full_name(c, n): p.detach().cpu().clone() for c in chunks for n, p in c.named_parameters()}


# ---- the two commands ---------------------------------------------------------------------------

def reference(args) -> int:
    import routing_replay as rr
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    device = init(args.cpu, SINGLE)
    chunks = build_chunks(SINGLE, device, seed=3)
    model = chunks[0]
    tokens = requests()
    fields, truth = [], []
    with torch.no_grad():
        for t in tokens:  # the rollout: one request at a time, routers recording
            RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
            ids = torch.from_numpy(t[None]).to(device)
            model(ids, torch.arange(len(t), device=device)[None], None)
            recorded = RouterReplay.get_recorded_data()  # per MoE layer [T, K]
            RouterReplay.clear_global_indices()
            RouterReplay.clear_global_router_replay_action()
            routing = torch.stack(recorded, dim=1).cpu().numpy().astype(np.int16)[:-1]  # the last token: no row
            fields.append(rr.to_base64_npy(routing))
            truth.append(routing)
    rollout_weights = weights_of(chunks)
    batches = micro_batches(tokens, device)
    positions = rank_positions(1, 0, False)
    own_rollout, _ = observe(chunks, batches, truth, positions, forward_only=True)  # batched as in training
    torch.manual_seed(11)
    with torch.no_grad():  # routers pushed off their own choice
        for router in routers(chunks).values():
            router.weight.add_(torch.randn_like(router.weight))
    perturbed = weights_of(chunks)
    own, _ = observe(chunks, batches, truth, positions, forward_only=True)
    model.zero_grad(set_to_none=True)
    replayed, losses = observe(chunks, batches, truth, positions, replay=replay_batches(fields, batches))
    grads = router_grads(chunks, SINGLE)
    model.zero_grad(set_to_none=True)
    shifted, shifted_losses = observe(chunks, batches, truth, positions,
                                      replay=replay_batches(shifted_fields(fields), batches))
    result = {
        "rows": sum(v[0] for v in replayed.values()),
        "replayed_different": sum(v[1] for v in replayed.values()),
        "own_choice_at_rollout_weights_different": sum(v[1] for v in own_rollout.values()),
        "own_choice_perturbed_different": sum(v[1] for v in own.values()),
        "shifted_different": shifted[SHIFTED][1],
        "losses": losses, "shifted_losses": shifted_losses,
    }
    ok = (result["replayed_different"] == 0 and result["own_choice_at_rollout_weights_different"] == 0
          and result["own_choice_perturbed_different"] > 0 and result["shifted_different"] > 0
          and abs(shifted_losses[SHIFTED // MICRO_BATCH] - losses[SHIFTED // MICRO_BATCH]) > LOSS_TOLERANCE)
    os.makedirs(args.dir, exist_ok=True)
    torch.save({"fields": fields, "rollout_weights": rollout_weights, "perturbed_weights": perturbed,
                "losses": losses, "shifted_losses": shifted_losses, "grads": grads}, os.path.join(args.dir, "reference.pt"))
    with open(os.path.join(args.dir, "reference.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'reference' if ok else 'FAIL reference'} (one process): rollout of {len(tokens)} requests recorded; "
          f"under replay {result['replayed_different']} of {result['rows']} (token, MoE layer) rows differ from it; "
          f"own choice batched at the rollout's weights {result['own_choice_at_rollout_weights_different']} "
          f"different, after the perturbation {result['own_choice_perturbed_different']}; request {SHIFTED} shifted: "
          f"{result['shifted_different']} rows differ; losses {[round(x, 6) for x in losses]}")
    dist.destroy_process_group()
    return 0 if ok else 1


def layout_check(args) -> int:
    import routing_replay as rr
    from megatron.core import parallel_state as ps

    layout = LAYOUTS[args.layout]
    device = init(args.cpu, layout)
    start = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != layout["tp"] * layout["pp"]:
        raise SystemExit(f"layout {args.layout} needs {layout['tp'] * layout['pp']} ranks, got {world}")
    ref = torch.load(os.path.join(args.dir, "reference.pt"), weights_only=False)
    fields = ref["fields"]
    truth = [rr.from_base64_npy(f) for f in fields]
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    positions = rank_positions(tp, tp_rank, layout["sp"])
    chunks = build_chunks(layout, device)
    batches = micro_batches(requests(), device)
    last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)

    loaded = load_weights(chunks, ref["rollout_weights"], tp, tp_rank)
    own_rollout, _ = observe(chunks, batches, truth, positions, forward_only=True)  # A
    load_weights(chunks, ref["perturbed_weights"], tp, tp_rank)
    own_perturbed, _ = observe(chunks, batches, truth, positions, forward_only=True)  # B
    for c in chunks:
        c.zero_grad(set_to_none=True)
    replayed, losses = observe(chunks, batches, truth, positions, replay=replay_batches(fields, batches))  # C
    grads = router_grads(chunks, layout)
    grad_diff = {layer: float((g - ref["grads"][layer]).abs().max() / ref["grads"][layer].abs().max())
                 for layer, g in grads.items()}
    for c in chunks:
        c.zero_grad(set_to_none=True)
    shifted, shifted_losses = observe(chunks, batches, truth, positions,  # D
                                      replay=replay_batches(shifted_fields(fields), batches))
    mine = {"rank": rank, "tp_rank": tp_rank, "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "router_layers": sorted(routers(chunks)), "loaded": loaded, "positions": positions,
            "own_rollout": own_rollout, "own_perturbed": own_perturbed, "replayed": replayed, "shifted": shifted,
            "losses": losses if last_stage else None, "shifted_losses": shifted_losses if last_stage else None,
            "grad_diff": grad_diff}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    status = 0
    if rank == 0:
        verdict, line, summary = judge(args.layout, everyone, ref, time.time() - start)
        with open(os.path.join(args.dir, f"{args.layout}.json"), "w") as f:
            json.dump(summary, f, indent=1)
        print(line, flush=True)
        status = 0 if verdict else 1
    dist.barrier()
    dist.destroy_process_group()
    return status


def judge(name: str, ranks: list[dict], ref: dict, seconds: float) -> tuple[bool, str, dict]:
    """Rank 0's verdict over every rank's findings."""
    layout = LAYOUTS[name]
    problems = []
    missing = set(ref["rollout_weights"]) - {k for r in ranks for k in r["loaded"]}
    if missing:
        problems.append(f"weights on no rank: {sorted(missing)[:4]}")
    layers = sorted({layer for r in ranks for layer in r["router_layers"]})
    if layers != MOE_LAYERS:
        problems.append(f"routers of layers {layers} on the ranks, MoE layers {MOE_LAYERS}")

    def total(r, key, i):
        return sum(v[i] for v in r[key].values())

    for r in ranks:
        if total(r, "own_rollout", 0) == 0:
            problems.append(f"rank {r['rank']} compared no rows")
        if total(r, "own_rollout", 1):
            problems.append(f"rank {r['rank']}: own choice at the rollout's weights differs in "
                            f"{total(r, 'own_rollout', 1)} rows (placement)")
        if total(r, "own_perturbed", 1) == 0:
            problems.append(f"rank {r['rank']}: perturbed routers still choose the rollout's experts")
        if total(r, "replayed", 1):
            problems.append(f"rank {r['rank']}: {total(r, 'replayed', 1)} replayed rows differ")
        for q, (rows, different) in r["shifted"].items():
            if q == SHIFTED and rows and not different:
                problems.append(f"rank {r['rank']} holds {rows} rows of the shifted request, none differ")
            if q != SHIFTED and different:
                problems.append(f"rank {r['rank']}: request {q} (not shifted) differs in {different} rows")
        bad = {layer: d for layer, d in r["grad_diff"].items() if not d <= GRAD_TOLERANCE}
        if bad:
            problems.append(f"rank {r['rank']}: router gradients off (max rel. diff per layer) {bad}")
    losses = [r["losses"] for r in ranks if r["losses"] is not None]
    loss_diff = max(abs(a - b) for got in losses for a, b in zip(got, ref["losses"])) if losses else float("nan")
    if not losses or not loss_diff <= LOSS_TOLERANCE:
        problems.append(f"loss differs from one GPU's by {loss_diff} (tolerance {LOSS_TOLERANCE})")
    shifted_mb = SHIFTED // MICRO_BATCH
    moved = min((abs(r["shifted_losses"][shifted_mb] - ref["losses"][shifted_mb]) for r in ranks
                 if r["shifted_losses"] is not None), default=0.0)
    shifted_vs_ref = max((abs(a - b) for r in ranks if r["shifted_losses"] is not None
                          for a, b in zip(r["shifted_losses"], ref["shifted_losses"])), default=float("nan"))
    if not moved > LOSS_TOLERANCE:
        problems.append(f"the shifted request moved its micro-batch's loss by only {moved}")
    if not shifted_vs_ref <= LOSS_TOLERANCE:
        problems.append(f"shifted losses differ from one GPU's shifted run by {shifted_vs_ref}")
    holders = [r["rank"] for r in ranks if r["shifted"][SHIFTED][0]]
    rows = {r["rank"]: total(r, "replayed", 0) for r in ranks}
    grad_max = max(d for r in ranks for d in r["grad_diff"].values())
    ok = not problems
    line = (f"{'PASS' if ok else 'FAIL'} {layout['label']}: {len(ranks)} ranks, {len(ref['losses'])} micro-batches; "
            f"rollout experts on every rank for every token ({', '.join(f'rank {k}: {v} rows' for k, v in rows.items())}; "
            f"replayed {sum(total(r, 'replayed', 1) for r in ranks)} different, own choice at the rollout's weights "
            f"{sum(total(r, 'own_rollout', 1) for r in ranks)} different, perturbed without replay "
            f"{sum(total(r, 'own_perturbed', 1) for r in ranks)}); loss max |diff| {loss_diff:.2e} "
            f"(tol {LOSS_TOLERANCE:g}); router grads max rel diff {grad_max:.2e} (tol {GRAD_TOLERANCE:g}); "
            f"request {SHIFTED} shifted: differs on ranks {holders} "
            f"({', '.join(str(r['shifted'][SHIFTED][1]) for r in ranks if r['shifted'][SHIFTED][0])} rows), "
            f"loss moved {moved:.2e}; {seconds:.0f} s")
    if problems:
        line += " | " + "; ".join(problems)
    summary = {"layout": name, "label": layout["label"], "pass": ok, "problems": problems, "seconds": round(seconds, 1),
               "loss_tolerance": LOSS_TOLERANCE, "grad_tolerance": GRAD_TOLERANCE, "reference_losses": ref["losses"],
               "loss_max_abs_diff": loss_diff, "shifted_request": SHIFTED, "shifted_loss_moved": moved,
               "ranks": [{k: v for k, v in r.items() if k != "loaded"} for r in ranks]}
    return ok, line, summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["reference", "layout"])
    parser.add_argument("--layout", choices=sorted(LAYOUTS))
    parser.add_argument("--dir", required=True, help="reference.pt and the results")
    parser.add_argument("--cpu", action="store_true", help="gloo and CPU tensors (checking this program only)")
    args = parser.parse_args(argv)
    if args.command == "reference":
        return reference(args)
    if args.layout is None:
        parser.error("layout needs --layout")
    return layout_check(args)


if __name__ == "__main__":
    sys.exit(main())
