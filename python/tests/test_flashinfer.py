"""FlashInfer's fused DeepSeek-V3 router writing routing straight into the library's device buffer.

``flashinfer.fused_moe.fused_topk_deepseek`` (FlashInfer 0.7.2.post1; SM89, SM90, SM100+) routes a
step's router logits ``[n, E]`` and writes each token's top-k experts into ``topk_indices`` (int32)
and, when given ``routing_replay_out`` (int16, contiguous, ``shape[0] >= n``, ``shape[1] == K``),
the same ids into that buffer, rows ``[0, n)`` only. A ``Replay`` with layout ``layer_major`` and
index ``int16`` hands out exactly such a buffer for each MoE layer: ``layer_view(layer, rows)``, a
window of its device buffer. Here the kernel runs on DeepSeek-V3's routing (256 experts in 8 groups,
the top 4 groups, top-8, routed scaling factor 2.5, float32 correction bias; router logits in float32
as the model's gate gives them, and in bfloat16) for four MoE layers (model layers 3 to 6: DeepSeek-V3's
first three are dense) over steps of varying token counts (chunked prefills, decodes), writing the
view of each layer:

- eagerly, each step's views taken inside the step, for the step's rows or for ``max_tokens_per_step``;
- inside one CUDA graph captured for the largest graph batch (views of that many rows taken at
  start-up) and replayed for smaller steps, the engine padding its inputs to the captured size and
  the plan declaring the padding (``set_padded_rows``), with an eager step between replays;

and checks that every request's extracted routing equals the kernel's own ``topk_indices``, and that
a step in which the kernel was not called for one layer is refused as ``missing_routing`` (naming that
layer), its rows read back as the sentinel -1, never as expert 0. The kernel's ids are also checked
against a torch reference of the grouped top-k on rows where the choice is clear.

The adapters' capturers hand out no view a kernel could write:

- the drop-in (``routing_replay.capturer``, vLLM PR 39917's interface): PR 39917's own capturer lets
  the kernel write ``get_device_cache().buffer[layer]``, but the drop-in learns a step's positions
  only after the forward and opens the library's step then, so it stages router outputs (int32) in a
  buffer of its own and has no ``get_device_cache``. It is tested here with the kernel's
  ``topk_indices`` passed to ``capture`` (eagerly and inside a CUDA graph), the way an engine on the
  drop-in uses this kernel, and with a layer not captured in one step;
- ``routing_replay.sglang`` stores rows at KV slots in a buffer of the narrowest index type (uint16
  for E = 256), and ``routing_replay.vllm``'s device buffer is token-major: engines on them pass the
  kernel's ``topk_indices`` to ``capture``, an int32 router output as any other, which their own
  tests cover (test_sglang_capturer.py, test_vllm_*.py); nothing FlashInfer-specific is left to test.

The ``flashinfer-cuda`` cases need FlashInfer importable and a CUDA GPU it supports, and are skipped
otherwise with the reason (``ROUTING_REPLAY_REQUIRE_FLASHINFER=1``, set by
scripts/flashinfer_gpu_check.sh, turns that skip into a failed run). The ``reference-host`` cases run
the same steps on the host backend with the torch reference standing in for the kernel (it checks the
buffer it is given as FlashInfer does), so that this module's own logic runs where there is no GPU;
they test the library's views, not FlashInfer's kernel.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import numpy as np
import pytest

import routing_replay as rr
from conftest import CUDA_SKIP
from routing_replay.capturer import RoutedExpertsCapturer

torch = pytest.importorskip("torch", reason="torch is not installed (the router and its reference are torch code)")

E, N_GROUP, TOPK_GROUP, K, SCALE = 256, 8, 4, 8, 2.5  # DeepSeek-V3's routing
MOE_LAYERS = (3, 4, 5, 6)  # model layers; 0 to 2 are dense
N_MAX, MAX_LEN, GRAPH_ROWS = 192, 512, 64
#: compute capabilities fused_topk_deepseek's default backend is compiled for (FlashInfer 0.7.2.post1)
SUPPORTED_CAPABILITIES = {(8, 9), (9, 0), (10, 0), (10, 3), (10, 7), (12, 0), (12, 1)}

# Steps: (request, first position, tokens) per scheduled run, in batch order.
EAGER_STEPS = (
    (("r0", 0, 37), ("r1", 0, 150)),                               # prefills: 187 rows
    (("r1", 150, 120), ("r2", 0, 5), ("r0", 37, 1)),               # a chunk, a prefill, a decode: 126
    (("r0", 38, 1), ("r1", 270, 1), ("r2", 5, 1), ("r3", 0, 64)),  # 67
    (("r0", 39, 1), ("r1", 271, 1), ("r2", 6, 1), ("r3", 64, 1)),  # decodes: 4
    (("r1", 272, 1), ("r3", 65, 1)),                               # 2
    (("r3", 66, 1),),                                              # 1
)
SKIPPED = (2, MOE_LAYERS[1])  # (step, model layer) the kernel is not called for in the unwritten-layer cases
GRAPH_STEPS = (  # steps of at most GRAPH_ROWS rows replay the graph, larger ones run eagerly
    (("q0", 0, 40), ("q1", 0, 24)),                  # 64: the captured size itself
    (("q0", 40, 1), ("q1", 24, 1), ("q2", 0, 15)),  # 17
    (("q0", 41, 1), ("q1", 25, 1), ("q2", 15, 1)),  # 3
    (("q2", 16, 1),),                                # 1
    (("q3", 0, 39), ("q2", 17, 1)),                  # 40
    (("q4", 0, 100), ("q3", 39, 1)),                 # 101: eager
    (("q4", 100, 1), ("q3", 40, 1)),                 # 2
)


def _flashinfer_skip_reason() -> str | None:
    if CUDA_SKIP is not None:
        return f"CUDA backend: {CUDA_SKIP}"
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed (scripts/stage_flashinfer.sh stages it for a GPU machine)"
    try:
        from flashinfer.fused_moe import fused_topk_deepseek  # noqa: F401
    except Exception as e:  # noqa: BLE001 - FlashInfer's import runs much code; any failure is a reason
        return f"flashinfer cannot be imported: {type(e).__name__}: {e}"
    capability = torch.cuda.get_device_capability()
    if capability not in SUPPORTED_CAPABILITIES:
        return f"fused_topk_deepseek is not built for SM{capability[0]}{capability[1]}"
    return None


FLASHINFER_SKIP = _flashinfer_skip_reason()
if FLASHINFER_SKIP is not None and os.environ.get("ROUTING_REPLAY_REQUIRE_FLASHINFER"):
    pytest.exit(f"ROUTING_REPLAY_REQUIRE_FLASHINFER is set, but the FlashInfer cases cannot run: {FLASHINFER_SKIP}",
                returncode=3)
requires_flashinfer = pytest.mark.skipif(FLASHINFER_SKIP is not None, reason=str(FLASHINFER_SKIP))


def reference_route(scores, bias):
    """DeepSeek-V3's grouped top-k (FlashInfer's fused_topk_deepseek docstring): sigmoid scores plus
    bias; groups ranked by the sum of their two best; the best experts of the top groups; weights the
    chosen sigmoid scores normalized and scaled. Returns (indices [n, K] int64, weights [n, K] float32,
    margin [n]: the smaller of the gaps that decided the groups and the experts)."""
    n = scores.shape[0]
    sig = torch.sigmoid(scores.float())
    biased = sig + bias.float()
    group_scores = biased.view(n, N_GROUP, E // N_GROUP).topk(2, dim=-1).values.sum(-1)
    ranked = group_scores.sort(dim=-1, descending=True)
    chosen = torch.zeros(n, N_GROUP, dtype=torch.bool, device=scores.device)
    chosen.scatter_(1, ranked.indices[:, :TOPK_GROUP], True)
    masked = biased.masked_fill(~chosen.repeat_interleave(E // N_GROUP, dim=1), float("-inf"))
    top = masked.topk(K + 1, dim=-1)
    indices = top.indices[:, :K]
    weights = sig.gather(1, indices)
    weights = weights / weights.sum(-1, keepdim=True) * SCALE
    margin = torch.minimum(ranked.values[:, TOPK_GROUP - 1] - ranked.values[:, TOPK_GROUP],
                           top.values[:, K - 1] - top.values[:, K])
    return indices, weights, margin


def reference_fused_topk_deepseek(scores, bias, n_group, topk_group, topk, routed_scaling_factor, topk_values,
                                  topk_indices, launch_with_pdl=True, routing_replay_out=None):
    """The host stand-in for fused_topk_deepseek: its signature, its checks of routing_replay_out,
    the reference's choice written to the outputs (rows [0, n) of routing_replay_out only)."""
    assert (n_group, topk_group, topk, routed_scaling_factor) == (N_GROUP, TOPK_GROUP, K, SCALE)
    n = scores.shape[0]
    if routing_replay_out is not None:
        if routing_replay_out.dtype != torch.int16:
            raise ValueError(f"routing_replay_out must be int16, got {routing_replay_out.dtype}")
        if routing_replay_out.dim() != 2 or routing_replay_out.shape[0] < n or routing_replay_out.shape[1] != topk:
            raise ValueError(f"routing_replay_out shape[0] must be >= {n} and shape[1] must be {topk}, "
                             f"got {tuple(routing_replay_out.shape)}")
        if not routing_replay_out.is_contiguous():
            raise ValueError(f"routing_replay_out must be contiguous, got strides {routing_replay_out.stride()}")
    indices, weights, _ = reference_route(scores, bias)
    topk_values.copy_(weights.to(topk_values.dtype))
    topk_indices.copy_(indices.to(torch.int32))
    if routing_replay_out is not None:
        routing_replay_out[:n].copy_(indices.to(torch.int16))


@dataclass
class Platform:
    """Where a case runs: FlashInfer's kernel on CUDA, or the reference on the host backend."""

    name: str
    device: str  # the Replay's and the tensors' device
    route: object  # fused_topk_deepseek or its reference

    def view_tensor(self, view):
        """A layer_view as a torch tensor (the host backend's is a writable numpy array)."""
        return torch.from_numpy(view) if self.device == "cpu" else view


def make_platform(name: str) -> Platform:
    if name == "flashinfer-cuda":
        from flashinfer.fused_moe import fused_topk_deepseek

        return Platform(name, "cuda", fused_topk_deepseek)
    return Platform(name, "cpu", reference_fused_topk_deepseek)


@pytest.fixture(params=[pytest.param("flashinfer-cuda", marks=requires_flashinfer), "reference-host"])
def platform(request) -> Platform:
    return make_platform(request.param)


#: for the CUDA-graph cases, which have no host counterpart
FLASHINFER_ONLY = pytest.mark.parametrize("platform", [pytest.param("flashinfer-cuda", marks=requires_flashinfer)],
                                          indirect=True)


class Router:
    """The model's routing inputs: per-layer float32 correction bias, and router logits per (step,
    layer) drawn on the CPU from seeds (so both platforms see the same values), in `dtype`."""

    def __init__(self, platform: Platform, dtype) -> None:
        self.platform, self.dtype = platform, dtype
        self.bias = {layer: (torch.randn(E, generator=torch.Generator().manual_seed(layer)) * 0.1).to(platform.device)
                     for layer in MOE_LAYERS}

    def scores(self, step: int, layer: int, rows: int):
        g = torch.Generator().manual_seed(100_000 + 1000 * (step + 1) + layer)
        return (torch.randn(rows, E, generator=g) * 2).to(self.dtype).to(self.platform.device)

    def outputs(self, rows: int):
        """(topk_values, topk_indices) as FlashInfer wants them."""
        device = self.platform.device
        return torch.empty(rows, K, dtype=self.dtype, device=device), torch.empty(rows, K, dtype=torch.int32,
                                                                                  device=device)

    def route(self, scores, layer: int, values, indices, replay_out=None) -> None:
        self.platform.route(scores, self.bias[layer], N_GROUP, TOPK_GROUP, K, SCALE, values, indices,
                            launch_with_pdl=True, routing_replay_out=replay_out)

    def check_kernel(self, ids: np.ndarray, scores, layer: int, where: str) -> None:
        """The kernel's ids are a grouped top-k: in range, distinct, from at most TOPK_GROUP groups,
        and the reference's choice wherever that choice is clear: a margin above 1e-2, ten times what
        the kernel's float32 arithmetic under -use_fast_math (an approximate tanh) can move it; about
        two rows in five of these random logits."""
        assert ids.min() >= 0 and ids.max() < E, f"{where}: expert ids outside [0, {E}): {ids.min()}..{ids.max()}"
        ordered = np.sort(ids, axis=1)
        duplicated = np.flatnonzero((np.diff(ordered, axis=1) == 0).any(axis=1))
        assert duplicated.size == 0, f"{where}: row {duplicated[0]} repeats an expert: {ids[duplicated[0]].tolist()}"
        groups = np.sort(ids // (E // N_GROUP), axis=1)
        used = 1 + (np.diff(groups, axis=1) != 0).sum(axis=1)
        assert used.max() <= TOPK_GROUP, f"{where}: row {used.argmax()} uses {used.max()} groups: {ids[used.argmax()]}"
        reference, _, margin = reference_route(scores.cpu(), self.bias[layer].cpu())
        clear = margin.numpy() > 1e-2
        wrong = np.flatnonzero(clear & (np.sort(reference.numpy(), axis=1) != ordered).any(axis=1))
        assert wrong.size == 0, (f"{where}: {wrong.size} of {int(clear.sum())} clear rows differ from the reference, "
                                 f"first row {wrong[0]}: kernel {sorted(ids[wrong[0]].tolist())}, reference "
                                 f"{sorted(reference[wrong[0]].tolist())} (margin {float(margin[wrong[0]]):.4f})")


class Expected:
    """What each request must read back: per position, the kernel's ids [L, K] and where they came
    from (step, row), or None for a position of a step that was refused."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[int, tuple]] = {}

    def record(self, step: int, runs, ids_per_layer: list[np.ndarray] | None) -> None:
        stacked = None if ids_per_layer is None else np.stack(ids_per_layer, axis=1)  # [n, L, K]
        row = 0
        for rid, first, count in runs:
            for t in range(count):
                self.rows.setdefault(rid, {})[first + t] = (None if stacked is None else stacked[row + t], step, row + t)
            row += count

    def check(self, rid: str, got, sentinel: int, what: str, note: str = "") -> None:
        """`got` is what request `rid` read back; `note` is appended to a failure's message."""
        rows = self.rows[rid]
        length = 1 + max(p for p, (ids, _, _) in rows.items() if ids is not None)
        shape = (length, len(MOE_LAYERS), K)
        if got is None or got.shape != shape or got.dtype != np.int16:
            pytest.fail(f"{what}: request {rid!r} came back as "
                        f"{None if got is None else (got.shape, str(got.dtype))}, expected {shape} int16{note}")
        for p in range(length):
            ids, step, row = rows[p]
            if ids is None:
                if not (got[p] == sentinel).all():
                    pytest.fail(f"{what}: request {rid!r}, position {p} was in step {step} (row {row}), refused because "
                                f"the kernel did not write model layer {SKIPPED[1]}; it must read as the sentinel "
                                f"{sentinel} in every layer, never as expert 0, and reads {got[p].tolist()}{note}")
                continue
            for slot, layer in enumerate(MOE_LAYERS):
                if not np.array_equal(got[p, slot], ids[slot]):
                    pytest.fail(f"{what}: request {rid!r}, position {p} (step {step}, row {row}), model layer {layer}: "
                                f"extracted {got[p, slot].tolist()}, the kernel's topk_indices {ids[slot].tolist()}{note}")


def check_finished(expected: Expected, sink, rid: str, what: str) -> None:
    """Reads a finished request back (the sink releases it) and compares it with `expected`; a
    failure also lists the steps refused so far, which explain missing rows."""
    got = sink.finish(rid)
    note = "" if not sink.refusals else "; steps refused so far: " + " | ".join(str(e) for e in sink.refusals)
    expected.check(rid, got, sink.sentinel, what, note)


class ViewSink:
    """A Replay (layer_major, int16) whose layer_view the kernel writes."""

    takes_view = True

    def __init__(self, platform: Platform, copy: str) -> None:
        self.replay = rr.Replay(num_experts=E, top_k=K, max_tokens_per_step=N_MAX, max_model_len=MAX_LEN,
                                moe_layers=MOE_LAYERS, num_model_layers=max(MOE_LAYERS) + 1, device=platform.device,
                                index="int16", layout="layer_major", copy=copy)
        self.platform, self.refusals = platform, []

    def filing(self, call) -> None:
        try:
            call()
        except rr.Error as e:  # a refused step: the tests compare these with what they expect
            self.refusals.append(e)

    def begin(self, runs, padded_rows: int = 0) -> None:
        plan = rr.StepPlan()
        for rid, first, count in runs:
            if first == 0:
                self.replay.add_request(rid)
            plan.schedule(rid, first, count)
        if padded_rows:
            plan.set_padded_rows(padded_rows)
        self.replay.begin_step(plan)

    def view(self, layer: int, rows: int):
        return self.platform.view_tensor(self.replay.layer_view(layer, rows))

    def after_layer(self, layer: int, indices) -> None:
        pass

    def end(self, runs) -> None:
        self.filing(self.replay.end_step)

    def finish(self, rid: str):
        self.filing(self.replay.drain)
        got = self.replay.extract(rid, copy=True)
        self.replay.release(rid)
        return got

    @property
    def sentinel(self) -> int:
        return self.replay.sentinel


class DropInSink:
    """The drop-in capturer, handed the kernel's topk_indices (it has no view for the kernel)."""

    takes_view = False

    def __init__(self, platform: Platform) -> None:
        self.capturer = RoutedExpertsCapturer(len(MOE_LAYERS), K, N_MAX, MAX_LEN, 0, platform.device, num_experts=E,
                                              moe_layers=MOE_LAYERS)
        self.platform, self.refusals, self.kept = platform, [], []

    filing = ViewSink.filing

    def begin(self, runs, padded_rows: int = 0) -> None:
        pass  # the drop-in opens the step after the forward

    def after_layer(self, layer: int, indices) -> None:
        if self.platform.device == "cpu":  # the host backend stages int64 ids, read later on its stream
            indices = indices.to(torch.int64)
            self.kept.append(indices)
        self.capturer.capture(layer, indices)

    def end(self, runs) -> None:
        positions = torch.from_numpy(np.concatenate([np.arange(first, first + count) for _, first, count in runs]))
        scheduled = {rid: count for rid, _, count in runs}
        self.filing(lambda: self.capturer.sync_fwd_experts_buffer_DtoH(positions, scheduled))

    def finish(self, rid: str):
        self.filing(self.capturer.finalize_pending_copy)
        return self.capturer.get_routed_experts(rid)

    @property
    def sentinel(self) -> int:
        return self.capturer.sentinel


def last_steps(steps) -> dict[int, list[str]]:
    """step -> the requests whose last step it is (extracted and released right after it)."""
    last = {}
    for s, runs in enumerate(steps):
        for rid, _, _ in runs:
            last[rid] = s
    out: dict[int, list[str]] = {}
    for rid, s in last.items():
        out.setdefault(s, []).append(rid)
    return out


def eager_step(sink, router: Router, s: int, runs, view_rows: str = "step", skip=None) -> list[np.ndarray]:
    """One eager forward: the kernel for every layer (but `skip`), writing the step's views."""
    n = sum(count for _, _, count in runs)
    sink.begin(runs)
    ids = []
    for layer in MOE_LAYERS:
        if (s, layer) == skip:
            continue
        scores = router.scores(s, layer, n)
        values, indices = router.outputs(n)
        out = sink.view(layer, n if view_rows == "step" else N_MAX) if sink.takes_view else None
        router.route(scores, layer, values, indices, out)
        sink.after_layer(layer, indices)
        ids.append(indices.cpu().numpy())
        router.check_kernel(ids[-1], scores, layer, f"{router.platform.name}, step {s}, layer {layer}")
    sink.end(runs)
    return ids


def run_eager(sink, router: Router, what: str, view_rows: str = "step", skip=None) -> None:
    expected = Expected()
    finishing = last_steps(EAGER_STEPS)
    for s, runs in enumerate(EAGER_STEPS):
        ids = eager_step(sink, router, s, runs, view_rows, skip)
        expected.record(s, runs, None if skip is not None and s == skip[0] else ids)
        for rid in finishing.get(s, []):
            check_finished(expected, sink, rid, what)


def check_refusals(sink, skip, what: str) -> None:
    """Nothing refused but, with `skip`, that step, as missing routing of the skipped layer."""
    if skip is None:
        assert not sink.refusals, f"{what}: steps refused: {[str(e) for e in sink.refusals]}"
        return
    assert len(sink.refusals) == 1, f"{what}: expected one refused step, got {[str(e) for e in sink.refusals]}"
    error = sink.refusals[0]
    slot = MOE_LAYERS.index(skip[1])
    assert error.code == "missing_routing", f"{what}: the step without layer {skip[1]} was refused as " \
        f"{error.code!r}, not 'missing_routing': {error}"
    assert f"layer {skip[1]} (slot {slot})" in str(error), f"{what}: the refusal does not name layer {skip[1]} " \
        f"(slot {slot}): {error}"


SCORE_DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bfloat16")]


@pytest.mark.parametrize("copy", ["sync", "device_scatter"])
@pytest.mark.parametrize("view_rows", ["step", "max"])
@pytest.mark.parametrize("dtype", SCORE_DTYPES)
def test_kernel_writes_views_eagerly(platform, dtype, view_rows, copy):
    sink = ViewSink(platform, copy)
    what = f"{platform.name}, eager, views of {view_rows} rows, copy {copy}"
    run_eager(sink, Router(platform, dtype), what, view_rows)
    check_refusals(sink, None, what)


@pytest.mark.parametrize("copy", ["sync", "device_scatter"])
def test_layer_not_written_is_refused(platform, copy):
    sink = ViewSink(platform, copy)
    what = f"{platform.name}, eager, kernel not called for layer {SKIPPED[1]} in step {SKIPPED[0]}, copy {copy}"
    run_eager(sink, Router(platform, torch.float32), what, skip=SKIPPED)
    check_refusals(sink, SKIPPED, what)


@pytest.mark.parametrize("dtype", SCORE_DTYPES)
def test_dropin_with_kernel_ids(platform, dtype):
    sink = DropInSink(platform)
    what = f"{platform.name}, drop-in capturer fed topk_indices, eager"
    run_eager(sink, Router(platform, dtype), what)
    check_refusals(sink, None, what)


def test_dropin_layer_not_captured_is_refused(platform):
    sink = DropInSink(platform)
    what = f"{platform.name}, drop-in capturer, layer {SKIPPED[1]} not captured in step {SKIPPED[0]}"
    run_eager(sink, Router(platform, torch.float32), what, skip=SKIPPED)
    check_refusals(sink, SKIPPED, what)


def run_graph(sink, router: Router, what: str) -> None:
    """Records one forward (the kernel for every layer) for GRAPH_ROWS rows at start-up, outside any
    step; replays it for every step of at most that many rows, the real rows first and the rest
    whatever the static inputs held before (the engine's padding); runs larger steps eagerly."""
    static_scores = {layer: router.scores(-1, layer, GRAPH_ROWS) for layer in MOE_LAYERS}
    static_out = {layer: router.outputs(GRAPH_ROWS) for layer in MOE_LAYERS}
    views = {layer: sink.view(layer, GRAPH_ROWS) if sink.takes_view else None for layer in MOE_LAYERS}

    def forward():
        for layer in MOE_LAYERS:
            values, indices = static_out[layer]
            router.route(static_scores[layer], layer, values, indices, views[layer])
            sink.after_layer(layer, indices)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch recommends before capture: rows no step files
        forward()
    torch.cuda.current_stream().wait_stream(side)
    if not sink.takes_view:
        sink.capturer.reset_device_buffer()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()

    expected = Expected()
    finishing = last_steps(GRAPH_STEPS)
    for s, runs in enumerate(GRAPH_STEPS):
        n = sum(count for _, _, count in runs)
        if n > GRAPH_ROWS:
            ids = eager_step(sink, router, s, runs)
        else:
            step_scores = {layer: router.scores(s, layer, n) for layer in MOE_LAYERS}
            for layer in MOE_LAYERS:
                static_scores[layer][:n].copy_(step_scores[layer])
            sink.begin(runs, padded_rows=GRAPH_ROWS)
            graph.replay()
            sink.end(runs)
            ids = [static_out[layer][1][:n].cpu().numpy() for layer in MOE_LAYERS]
            for layer, layer_ids in zip(MOE_LAYERS, ids):
                router.check_kernel(layer_ids, step_scores[layer], layer, f"graph replay, step {s}, layer {layer}")
        expected.record(s, runs, ids)
        for rid in finishing.get(s, []):
            check_finished(expected, sink, rid, what)


@pytest.mark.parametrize("copy", ["sync", "device_scatter"])
@pytest.mark.parametrize("dtype", SCORE_DTYPES)
@FLASHINFER_ONLY
def test_kernel_writes_views_in_cuda_graph(platform, dtype, copy):
    sink = ViewSink(platform, copy)
    what = f"{platform.name}, CUDA graph of {GRAPH_ROWS} rows, copy {copy}"
    run_graph(sink, Router(platform, dtype), what)
    check_refusals(sink, None, what)


@FLASHINFER_ONLY
def test_dropin_with_kernel_ids_in_cuda_graph(platform):
    sink = DropInSink(platform)
    what = f"{platform.name}, drop-in capturer fed topk_indices, CUDA graph of {GRAPH_ROWS} rows"
    run_graph(sink, Router(platform, torch.float32), what)
    check_refusals(sink, None, what)


def test_reference_route_on_a_known_case():
    """The reference picks the best experts of the best groups, not the best experts overall."""
    scores = torch.full((1, E), -6.0)
    per_group = E // N_GROUP
    for g in range(TOPK_GROUP):  # groups 0..3: two strong experts each
        scores[0, g * per_group: g * per_group + 2] = 4.0 - g * 0.1
    scores[0, 7 * per_group] = 9.0  # group 7: one expert better than all, but a weak pair
    indices, weights, margin = reference_route(scores, torch.zeros(E))
    chosen = sorted(indices[0].tolist())
    assert chosen == sorted(g * per_group + i for g in range(TOPK_GROUP) for i in range(2)), chosen
    assert abs(float(weights.sum()) - SCALE) < 1e-5 and float(margin[0]) > 0.01
