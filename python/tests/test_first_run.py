"""What a new user meets first: the README's Python example runs as written and prints what the
README says; ``python -m routing_replay`` is a few lines (``--list`` adds the combinations); asking
for CUDA where it cannot run says why and points at the host backend; the demo's check names a
dtype mismatch as such."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import routing_replay as rr
from routing_replay import _build

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
VERIFY_NPY = ROOT / "examples" / "engine_loop" / "verify_npy.py"


def readme_python_example() -> tuple[str, str]:
    """The README's runnable ``Replay`` example and the output the README shows under it."""
    if not README.is_file():
        pytest.skip("no README.md beside python/ (an installed copy of the tests)")
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    runnable = [b for b in blocks if "rr.Replay(" in b and "print(" in b]
    assert len(runnable) == 1, "the README has one runnable Replay example (with a print)"
    shown = re.search(re.escape(runnable[0]) + r"```\n\nIt prints[^`]*```\n(.*?)```", text, flags=re.S)
    assert shown is not None, "the README shows the example's output right after it ('It prints ...')"
    return runnable[0], shown.group(1)


def test_readme_python_example_runs_as_written():
    code, shown = readme_python_example()
    if rr.cuda_available() and importlib.util.find_spec("torch") is None:
        pytest.skip("the example makes its GPU arrays with torch, which is not installed")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})
    printed = out.getvalue()
    backend = "cuda" if rr.cuda_available() else "host"
    # the README shows the host backend's line; on a GPU the backend's name is the one difference
    assert printed == shown.replace("host", backend, 1), (printed, shown)


def run_main(*args: str) -> list[str]:
    done = subprocess.run([sys.executable, "-m", "routing_replay", *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_python_m_routing_replay_is_a_few_lines_and_lists_on_request():
    short = run_main()
    assert len(short) <= 6, short
    assert short[0].startswith(f"routing_replay {rr.__version__}")
    assert any(line.startswith("backends: host") for line in short)
    assert any(line.startswith("CUDA module: ") for line in short)
    # a fresh process has those compiled ahead of time (8 per unit); this one may have loaded more
    ahead = 8 * len(_build.AOT_UNITS)
    counts = [line for line in short if line.startswith("policy combinations compiled: ")]
    assert counts and f"host {ahead}" in counts[0] and "--list" in counts[0]
    full = run_main("--list")
    listed = [line.strip() for line in full if line.startswith("  ")]
    assert len(listed) == ahead * len(rr.backends())
    assert "int16/layer_major/sync/per_request" in listed


@pytest.mark.skipif(rr.cuda_available(), reason="a CUDA device is usable here")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_a_device_says_why_and_names_the_host_backend(device):
    with pytest.raises(RuntimeError) as e:
        rr.Replay(num_experts=8, top_k=2, max_tokens_per_step=4, max_model_len=16, moe_layers=[0], device=device)
    message = str(e.value)
    assert "device='cpu' runs on the host backend" in message, message
    assert "cudaError" not in message, message
    if "cuda" in rr.backends():  # the module is there, the device is not
        assert isinstance(e.value, rr.Error) and e.value.code == "backend_error"
        assert "no CUDA device is usable here (no GPU, or no NVIDIA driver" in message, message
    else:
        assert "not built" in message or "does not import" in message, message


def write_demo_files(directory: Path, dtype: str) -> None:
    """Two request files as the demo writes them (the synthetic router), in ``dtype``."""
    for req, t in ((1, 5), (2, 3)):
        pos = np.arange(t).reshape(t, 1, 1)
        layer = np.arange(48).reshape(1, 48, 1)
        k = np.arange(8).reshape(1, 1, 8)
        np.save(directory / f"request_{req}.npy", ((req * 7919 + pos * 31 + layer * 131 + k * 17) % 128).astype(dtype))


def run_verify(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(VERIFY_NPY), *args], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(not VERIFY_NPY.is_file(), reason="examples/ is not beside python/")
def test_demo_check_names_a_dtype_mismatch(tmp_path):
    write_demo_files(tmp_path, "int16")
    ok = run_verify(str(tmp_path))
    assert ok.returncode == 0 and "2/2 files match the synthetic router as int16" in ok.stdout, ok.stdout
    wrong = run_verify(str(tmp_path), "uint8")
    assert wrong.returncode == 1
    assert "(5, 48, 8) int16, expected uint8; ids ok" in wrong.stdout, wrong.stdout
    assert f"pass int16 (verify_npy.py {tmp_path} int16), or rerun the demo with --index uint8" in wrong.stdout
