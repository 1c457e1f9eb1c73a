"""Combinations not compiled ahead of time compile on first use (routing_replay._jit): into the
cache folder, with a notice, once (a second process loads the cached unit), and they run as the
ones compiled ahead do. Where no compiler is found, the error names it, the combination and the
install option that compiles everything ahead.

One host unit is compiled (about 20 s on a 2-core machine at -O2; on a GPU machine, one CUDA unit too): int32 with token_major, forced
even where the build compiled it ahead (ROUTING_REPLAY_PYTHON_ALL_COMBINATIONS=ON, as CI), so that
the first-use path is tested by every build. The unit then replaces the build's own factories of
that combination, which is itself a check that both are made the same way."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from conftest import requires_cuda
from routing_replay import _build

HERE = pathlib.Path(__file__).resolve().parent

# a schedule against the reference (_sim.Engine) on the unit loaded first
SCRIPT = """
import sys
sys.path.insert(0, {here!r})
import routing_replay as rr
from routing_replay import _core, _jit
from _sim import Engine
from conftest import Device

backend = {backend!r}
_jit.load(backend, "int32", "token_major", _core if backend == "host" else rr._cuda())
policies = {{(p["index"], p["layout"], p["copy"], p["storage"]) for p in rr.policies(backend)}}
assert ("int32", "token_major", "device_scatter", "block_slot") in policies, policies
device = Device(backend)
for copy, storage in (("sync", "per_request"), ("device_scatter", "block_slot")):
    replay = rr.Replay(num_experts=40, top_k=3, max_tokens_per_step=24, max_model_len=40, moe_layers=[1, 2, 4],
                       num_model_layers=5, num_fused_shared_experts=1, device=device.name, index="int32",
                       layout="token_major", copy=copy, storage=storage, block_size=4, num_blocks=64)
    assert replay.policies["index"] == "int32" and replay.policies["layout"] == "token_major"
    engine = Engine(replay, device, seed=7, num_experts=40, moe_layers=[1, 2, 4], num_model_layers=5, top_k=3,
                    shared=1, max_tokens=24, max_len=40, block_size=4, num_blocks=64)
    engine.run(steps=20)
    assert engine.checked >= 1
    replay.drain()
print("ok")
"""


def _run(env: dict, backend: str = "host") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(here=str(HERE), backend=backend)], env=env,
                          capture_output=True, text=True, timeout=900, check=False)


def _compiles_once(tmp_path, backend: str) -> None:
    env = dict(os.environ, ROUTING_REPLAY_CACHE_DIR=str(tmp_path))
    first = _run(env, backend)
    assert first.returncode == 0, first.stderr
    assert "ok" in first.stdout
    notice = [line for line in first.stderr.splitlines() if "routing_replay: compiling" in line]
    assert len(notice) == 1, first.stderr
    assert f"index int32, layout token_major for the {backend} backend (first use; cached in" in notice[0]
    assert str(tmp_path) in notice[0] and notice[0].endswith(" s")
    folder = tmp_path / next(p.name for p in tmp_path.iterdir())
    assert folder.name.endswith(_build.BUILD_HASH)
    libraries = list(folder.glob(f"{backend}_int32_token_major-*.so"))
    assert len(libraries) == 1
    assert not list(folder.glob(".build-*"))  # the build folder went, the library was renamed in

    second = _run(env, backend)
    assert second.returncode == 0, second.stderr
    assert "routing_replay: compiling" not in second.stderr  # loaded from the cache
    assert list(folder.glob(f"{backend}_int32_token_major-*.so")) == libraries


def test_a_unit_compiles_on_first_use_once(tmp_path):
    _compiles_once(tmp_path, "host")


@requires_cuda
def test_a_cuda_unit_compiles_on_first_use_once(tmp_path):
    """The CUDA module's first use: nvcc, the build's architectures, the module's CUDA runtime (about
    a minute of nvcc; the GPU machines run it, CI builds no CUDA module)."""
    _compiles_once(tmp_path, "cuda")


def test_no_compiler_says_what_and_how(tmp_path):
    env = dict(os.environ, ROUTING_REPLAY_CACHE_DIR=str(tmp_path), ROUTING_REPLAY_CXX="/nonexistent/g++")
    done = _run(env)
    assert done.returncode != 0
    assert "index int32, layout token_major for the host backend is not compiled ahead of time" in done.stderr
    assert "/nonexistent/g++" in done.stderr
    assert "ROUTING_REPLAY_PYTHON_ALL_COMBINATIONS=ON" in done.stderr


@pytest.mark.skipif(_build.AOT_UNITS == tuple(f"{i}/{l}" for i in ("uint8", "uint16", "int16", "int32")
                                              for l in ("layer_major", "token_major")),
                    reason="this build compiled every combination ahead of time")
def test_replay_compiles_what_it_needs_and_errs_clearly(tmp_path):
    """Replay itself goes through the first-use path; without a compiler it raises RuntimeError."""
    code = ("import routing_replay as rr\n"
            "try:\n"
            "    rr.Replay(num_experts=8, top_k=2, max_tokens_per_step=8, max_model_len=16, moe_layers=[0],\n"
            "              device='cpu', index='uint8', layout='token_major')\n"
            "except RuntimeError as e:\n"
            "    print('refused:', e)\n")
    env = dict(os.environ, ROUTING_REPLAY_CACHE_DIR=str(tmp_path), ROUTING_REPLAY_CXX="/nonexistent/g++")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "refused:" in done.stdout and "index uint8, layout token_major" in done.stdout
