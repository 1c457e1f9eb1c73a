"""Expert-load counting (numpy only) and the picture (matplotlib, skipped without it)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import routing_replay as rr
from routing_replay import plot

requires_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                         reason="matplotlib is not installed (the `plot` extra)")


def test_expert_load_counts_and_skips_sentinels():
    a = np.array([[[0, 1], [2, 2]], [[1, 1], [-1, -1]]], dtype=np.int16)  # [T=2, L=2, K=2], a missing row
    b = np.array([[[3, 0], [0, 255]]], dtype=np.uint8)  # 255 is uint8's sentinel
    counts = plot.expert_load([a, b])
    assert counts.shape == (2, 4)
    np.testing.assert_array_equal(counts, [[2, 3, 0, 1], [1, 0, 2, 0]])
    np.testing.assert_array_equal(plot.expert_load([a], num_experts=2), [[1, 3], [0, 0]])
    with pytest.raises(ValueError):
        plot.expert_load([a, np.zeros((1, 3, 2), dtype=np.int16)])


@requires_matplotlib
def test_command_line_writes_a_picture(tmp_path):
    rng = np.random.default_rng(0)
    for i in range(3):
        rr.write_npy(tmp_path / f"request_{i}.npy", rng.integers(0, 16, size=(20, 4, 2)).astype(np.int16))
    out = tmp_path / "load.png"
    assert plot.main([str(tmp_path), "-o", str(out), "--top", "5", "--title", "test"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


@requires_matplotlib
def test_live_replay(tmp_path):
    replay = rr.Replay(num_experts=8, top_k=2, max_tokens_per_step=4, max_model_len=16, moe_layers=[0, 1],
                       device="cpu")
    replay.add_request("a")
    plan = rr.StepPlan()
    plan.schedule("a", 0, 3)
    with replay.step(plan):
        for layer in (0, 1):
            replay.capture(layer, np.array([[0, 1], [2, 3], [4, 5]]))
    fig = plot.plot_replay(replay, ["a"], tmp_path / "live.svg")
    assert (tmp_path / "live.svg").stat().st_size > 0
    assert len(fig.axes) >= 2
