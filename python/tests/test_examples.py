"""The Python examples, run as their users run them: examples/python/numpy_moe.py (host backend,
numpy only: runs everywhere), examples/python/hf_qwen3_moe.py and r3_closed_loop.py (transformers;
on the GPU, and on the CPU with the host backend where torch and transformers are installed) and
examples/python/ray_rollout_to_trainer.py (a Ray cluster of this machine, where Ray, torch and
transformers are installed)."""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest

from conftest import requires_cuda

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python")
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("torch")
requires_transformers = pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="torch and transformers are not installed")
HAVE_RAY = importlib.util.find_spec("ray") is not None
requires_ray = pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed (pip install './python[ray]')")


def have_wire() -> bool:
    try:
        import routing_replay.wire  # noqa: F401
    except ImportError:
        return False
    return True


requires_wire = pytest.mark.skipif(not have_wire(), reason="routing_replay.wire is not in this build")


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flags", [
    ["--copy", "sync"],
    ["--copy", "double_buffered", "--storage", "block_slot"],
    ["--copy", "device_scatter", "--storage", "block_slot", "--layout", "token_major"],
    ["--index", "uint8", "--copy", "device_scatter", "--storage", "block_slot"],
], ids=lambda f: " ".join(f))
def test_numpy_moe(tmp_path, capsys, flags):
    assert load("numpy_moe").main(flags + ["--out", str(tmp_path)]) == 0
    assert "bit-exact" in capsys.readouterr().out
    files = sorted(os.listdir(tmp_path))
    assert files == ["request_req-0.npy", "request_req-2.npy", "request_req-3.npy", "request_req-4.npy"]
    assert np.load(tmp_path / files[0]).shape[1:] == (3, 4)


@requires_transformers
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=requires_cuda), "cpu"])
def test_hf_qwen3_moe(tmp_path, capsys, device):
    flags = ["--device", device, "--out", str(tmp_path)]
    assert load("hf_qwen3_moe").main(flags) == 0
    assert "bit-exact" in capsys.readouterr().out
    assert len(os.listdir(tmp_path)) == 5


@requires_transformers
@requires_cuda
def test_hf_qwen3_moe_device_scatter():
    assert load("hf_qwen3_moe").main(["--copy", "device_scatter", "--storage", "block_slot", "--new-tokens", "8"]) == 0


@requires_transformers
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=requires_cuda), "cpu"])
def test_r3_closed_loop(tmp_path, capsys, device):
    assert load("r3_closed_loop").main(["--device", device, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("-> PASS") == 2
    assert sorted(os.listdir(tmp_path)) == ["routed_experts.json", "summary.json"]


@requires_transformers
@requires_ray
@requires_wire
def test_ray_rollout_to_trainer(capsys):
    assert load("ray_rollout_to_trainer").main([]) == 0
    out = capsys.readouterr().out
    assert out.count("-> PASS") == 2
