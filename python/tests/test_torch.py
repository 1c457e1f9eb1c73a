"""torch integration: the custom op, capture under torch.compile (no graph break) and inside
torch.cuda.graph (fixed addresses, the graph's stream). The compile cases run on the CPU with the
host backend wherever torch is installed, and on CUDA where a GPU is present."""

from __future__ import annotations

import numpy as np
import pytest

import routing_replay as rr
from conftest import BACKENDS, requires_cuda, requires_torch

pytestmark = requires_torch

E, K, L, H = 32, 4, 3, 16


@pytest.fixture
def torch():
    import torch

    from routing_replay import torch_ops

    assert torch_ops.capture_op() is torch.ops.routing_replay.capture  # importing it registered the op
    return torch


def weights(torch, device):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(H, E, generator=g).to(device) for _ in range(L)]


def forward(torch, target, x, ws):
    """A toy MoE forward: each layer routes with top-k of its router logits and captures them.
    Returns the hidden state and the top-k it routed with, [n, L, K]: the reference (recomputing it
    outside a graph could round differently and flip a near tie)."""
    chosen = []
    for layer, w in enumerate(ws):
        logits = x @ w
        topk = torch.topk(logits, K, dim=-1).indices
        target.capture(layer, topk)
        chosen.append(topk)
        x = x + torch.tanh(logits[:, :H])
    return x, torch.stack(chosen, dim=1)


def test_op_is_registered(torch):
    op = torch.ops.routing_replay.capture.default
    assert "routing_replay::capture" in str(op._schema)


def test_fake_tensor_mode_runs_nothing(torch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    replay = rr.Replay(num_experts=E, top_k=K, max_tokens_per_step=8, max_model_len=64, moe_layers=range(L),
                       device="cpu")
    with FakeTensorMode():
        ids = torch.zeros((2, K), dtype=torch.int64)
        torch.ops.routing_replay.capture(ids, replay._id, 0, -1, 0, None)
    assert replay.steps_in_flight == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("copy", ["sync", "double_buffered"])
def test_compile_fullgraph(torch, backend, copy):
    device = "cpu" if backend == "host" else "cuda"
    torch._dynamo.reset()
    replay = rr.Replay(num_experts=E, top_k=K, max_tokens_per_step=16, max_model_len=64, moe_layers=range(L),
                       device=device, copy=copy)
    ws = weights(torch, device)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)

    compiled = torch.compile(lambda x: forward(torch, replay, x, ws), fullgraph=True, backend=record, dynamic=False)
    expected = {}
    position = 0
    replay.add_request("a")
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        n = 5 if step == 0 else 1
        x = torch.randn(n, H, generator=g).to(device)
        plan = rr.StepPlan()
        plan.schedule("a", position, n)
        with replay.step(plan):
            _, chosen = compiled(x)
        expected.update(zip(range(position, position + n), chosen.cpu().numpy()))
        position += n
    assert graphs and all("routing_replay.capture" in gm.code for gm in graphs)
    got = replay.extract("a")
    np.testing.assert_array_equal(got, np.stack([expected[p] for p in range(position)]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_capturer_under_compile(torch, backend):
    from routing_replay.capturer import RoutedExpertsCapturer

    device = "cpu" if backend == "host" else "cuda"
    torch._dynamo.reset()
    capturer = RoutedExpertsCapturer(L, K, 16, 64, 0, device, num_experts=E)
    ws = weights(torch, device)
    compiled = torch.compile(lambda x: forward(torch, capturer, x, ws), fullgraph=True)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, H, generator=g).to(device)
    _, chosen = compiled(x)
    capturer.sync_fwd_experts_buffer_DtoH(torch.tensor([0, 1, 0]), {"a": 2, "b": 1})
    want = chosen.cpu().numpy()
    np.testing.assert_array_equal(capturer.get_routed_experts("a"), want[:2])
    np.testing.assert_array_equal(capturer.get_routed_experts("b"), want[2:3])


@requires_cuda
def test_capture_inside_cuda_graph(torch):
    """Record the forward once, outside any step (as engines do at start-up); replay it every step
    with a different batch; the plan declares the graph's padded rows."""
    replay = rr.Replay(num_experts=E, top_k=K, max_tokens_per_step=16, max_model_len=64, moe_layers=range(L),
                       device="cuda", copy="double_buffered")
    ws = weights(torch, "cuda")
    static_x = torch.zeros(8, H, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch recommends before capture
        forward(torch, replay, static_x, ws)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, static_chosen = forward(torch, replay, static_x, ws)

    g = torch.Generator().manual_seed(3)
    expected = {"a": {}, "b": {}}
    positions = {"a": 0, "b": 0}
    replay.add_request("a")
    replay.add_request("b")
    for step in range(5):
        runs = [("a", 3 if step == 0 else 1), ("b", 2 if step < 2 else 1)]
        n = sum(c for _, c in runs)
        x = torch.randn(8, H, generator=g)
        static_x.copy_(x.cuda())
        plan = rr.StepPlan()
        for rid, count in runs:
            plan.schedule(rid, positions[rid], count)
        plan.set_padded_rows(8)
        with replay.step(plan):
            graph.replay()
        want = static_chosen.cpu().numpy()
        row = 0
        for rid, count in runs:
            for t in range(count):
                expected[rid][positions[rid] + t] = want[row + t]
            positions[rid] += count
            row += count
        assert row == n
    for rid in ("a", "b"):
        got = replay.extract(rid)
        np.testing.assert_array_equal(got, np.stack([expected[rid][p] for p in range(positions[rid])]))


@requires_cuda
def test_capturer_inside_cuda_graph(torch):
    from routing_replay.capturer import RoutedExpertsCapturer

    capturer = RoutedExpertsCapturer(L, K, 16, 64, 0, "cuda", num_experts=E)
    ws = weights(torch, "cuda")
    static_x = torch.zeros(4, H, device="cuda")
    graph = torch.cuda.CUDAGraph()
    forward(torch, capturer, static_x, ws)  # warm-up: rows no step files
    capturer.reset_device_buffer()
    with torch.cuda.graph(graph):
        _, static_chosen = forward(torch, capturer, static_x, ws)
    g = torch.Generator().manual_seed(4)
    want = []
    for step in range(3):
        x = torch.randn(4, H, generator=g).cuda()
        static_x.copy_(x)
        graph.replay()
        capturer.sync_fwd_experts_buffer_DtoH(torch.tensor([step, step, step]), {"a": 1, "b": 1, "c": 1})
        want.append(static_chosen.cpu().numpy())
    capturer.finalize_pending_copy()
    for i, rid in enumerate("abc"):
        np.testing.assert_array_equal(capturer.get_routed_experts(rid), np.stack([w[i] for w in want]))


@requires_cuda
def test_compile_reduce_overhead(torch):
    """torch.compile's CUDA graphs (mode="reduce-overhead") record the custom op too."""
    torch._dynamo.reset()
    replay = rr.Replay(num_experts=E, top_k=K, max_tokens_per_step=16, max_model_len=64, moe_layers=range(L),
                       device="cuda", copy="double_buffered")
    ws = weights(torch, "cuda")
    compiled = torch.compile(lambda x: forward(torch, replay, x, ws), mode="reduce-overhead", fullgraph=True)
    g = torch.Generator().manual_seed(5)
    replay.add_request("a")
    expected = []
    for step in range(6):
        x = torch.randn(2, H, generator=g).cuda()
        plan = rr.StepPlan()
        plan.schedule("a", 2 * step, 2)
        plan.set_padded_rows(2)
        with replay.step(plan):
            _, chosen = compiled(x)
        expected.append(chosen.cpu().numpy())
    np.testing.assert_array_equal(replay.extract("a"), np.concatenate(expected))
