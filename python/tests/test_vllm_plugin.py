"""The vLLM general plugin (routing_replay.vllm.plugin) against a minimal vLLM tree made in a temporary
folder: its modules at vLLM 0.33's paths (vllm.plugins.load_general_plugins reading the
``vllm.general_plugins`` entry points; vllm.distributed.aux_output_connector.worker with the
connector class and the factory that looks it up; a model runner that binds the factory by name at
import time and one that looks it up at call time) and its own distribution metadata, so that a real
vLLM installed beside it is neither imported nor asked for its entry points; each case in a fresh
interpreter.

Checked: off by default (the variable unset, or "0"), and then vLLM's own class is built; on, the
library's is built through every path, whether the model runner was imported before or after the
plugin ran; VLLM_PLUGINS naming other plugins leaves vLLM alone; a vLLM without the connector module
(before 0.33) is refused with a clear error; the entry point is declared in the installed metadata.
The library's connector is a stand-in there (so the patching is checked without it); with
routing_replay.vllm built, the real one is built and runs a step.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import routing_replay
from _vllm_harness import have_library

SITE = str(Path(routing_replay.__file__).resolve().parents[1])

FAKE_VLLM = {
    "vllm/__init__.py": '__version__ = "0.33.0"\n',
    # Its own distribution metadata, first on the path: importlib.metadata keeps the first
    # distribution of a name it finds, so the entry points a real vLLM installed beside declares
    # (its LoRA resolvers and others, in modules this tree lacks) are not seen here.
    "vllm-0.33.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n",
    "vllm-0.33.0.dist-info/entry_points.txt": "",
    "vllm/plugins/__init__.py": '''
        import os
        from importlib.metadata import entry_points

        plugins_loaded = False


        def load_general_plugins():
            global plugins_loaded
            if plugins_loaded:
                return
            plugins_loaded = True
            allowed = os.environ.get("VLLM_PLUGINS")
            allowed = None if allowed is None else allowed.split(",")
            for plugin in entry_points(group="vllm.general_plugins"):
                if allowed is None or plugin.name in allowed:
                    plugin.load()()
        ''',
    "vllm/distributed/__init__.py": "",
    "vllm/distributed/parallel_state.py": '''
        from types import SimpleNamespace


        def get_tp_group():
            return SimpleNamespace(is_first_rank=True, world_size=1, rank_in_group=0, all_gather=None)
        ''',
    "vllm/forward_context.py": '''
        from types import SimpleNamespace

        _CONTEXT = SimpleNamespace(dp_metadata=None, batch_descriptor=None)


        def get_forward_context():
            return _CONTEXT
        ''',
    "vllm/distributed/aux_output_connector/__init__.py": "",
    "vllm/distributed/aux_output_connector/worker.py": '''
        class AuxOutputWorkerConnector:
            """vLLM's own."""

            def __init__(self, *, vllm_config, model, kv_cache_config):
                self.vllm_config = vllm_config


        def get_aux_output_connector(model, vllm_config, kv_cache_config):
            return AuxOutputWorkerConnector(model=model, kv_cache_config=kv_cache_config, vllm_config=vllm_config)
        ''',
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/layers/__init__.py": "",
    "vllm/model_executor/layers/fused_moe/__init__.py": "",
    "vllm/model_executor/layers/fused_moe/routed_experts_capturer.py": '''
        BOUND = []


        def bind_routed_experts_capturer(model, capturer):
            BOUND.append((model, capturer))
        ''',
    "vllm/v1/__init__.py": "",
    "vllm/v1/worker/__init__.py": "",
    "vllm/v1/worker/gpu/__init__.py": "",
    "vllm/v1/worker/gpu/model_runner.py": '''
        from vllm.distributed.aux_output_connector.worker import get_aux_output_connector


        def init_aux_output(model, vllm_config, kv_cache_config):
            return get_aux_output_connector(model, vllm_config, kv_cache_config)


        def init_aux_output_at_call_time(model, vllm_config, kv_cache_config):
            from vllm.distributed.aux_output_connector import worker

            return worker.get_aux_output_connector(model, vllm_config, kv_cache_config)
        ''',
}

# a stand-in for the library's connector, so that the patching is checked on its own
STAND_IN = '''
import sys, types
import routing_replay.vllm.plugin as plugin

class LibraryConnector:
    def __init__(self, *, vllm_config, model, kv_cache_config, device=None):
        self.vllm_config = vllm_config

def library_factory(model, vllm_config, kv_cache_config):
    return LibraryConnector(model=model, vllm_config=vllm_config, kv_cache_config=kv_cache_config)

plugin._library = lambda: types.SimpleNamespace(AuxOutputWorkerConnector=LibraryConnector,
                                                get_aux_output_connector=library_factory)
'''

ENTRY_POINT = '''
import importlib.metadata, importlib.util, sys
if not any(ep.name == "routing_replay" for ep in importlib.metadata.entry_points(group="vllm.general_plugins")):
    # a checkout without the installed metadata: register the entry point by hand
    import routing_replay.vllm.plugin as _p
    import os, vllm.plugins as _vp
    _vp.load_general_plugins = lambda: (os.environ.get("VLLM_PLUGINS") is None or "routing_replay" in
                                        os.environ["VLLM_PLUGINS"].split(",")) and _p.register()
'''


@pytest.fixture
def fake_vllm(tmp_path):
    for path, text in FAKE_VLLM.items():
        target = tmp_path / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(textwrap.dedent(text))
    return tmp_path


def run_python(fake_vllm, body: str, *, env: dict | None = None, stand_in: bool = True) -> dict:
    """Runs ``body`` in a fresh interpreter seeing the fake vLLM; returns the JSON it prints last."""
    script = ENTRY_POINT + (STAND_IN if stand_in else "") + textwrap.dedent(body)
    environment = {k: v for k, v in os.environ.items() if k not in ("ROUTING_REPLAY_VLLM", "VLLM_PLUGINS")}
    environment["PYTHONPATH"] = os.pathsep.join([str(fake_vllm), SITE, environment.get("PYTHONPATH", "")])
    environment.update(env or {})
    done = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


BUILD_BOTH_WAYS = '''
import json
from types import SimpleNamespace
{before}
import vllm.plugins
vllm.plugins.load_general_plugins()
import vllm.v1.worker.gpu.model_runner as runner
config = SimpleNamespace(name="config")
built = [type(runner.init_aux_output(None, config, None)).__name__,
         type(runner.init_aux_output_at_call_time(None, config, None)).__name__]
print(json.dumps(built))
'''


@pytest.mark.parametrize("value", [None, "0", ""])
def test_off_by_default(fake_vllm, value):
    env = {} if value is None else {"ROUTING_REPLAY_VLLM": value}
    assert run_python(fake_vllm, BUILD_BOTH_WAYS.format(before=""), env=env) == ["AuxOutputWorkerConnector"] * 2


@pytest.mark.parametrize("runner_first", [False, True], ids=["plugin-first", "runner-imported-first"])
def test_on_builds_the_librarys_connector(fake_vllm, runner_first):
    before = "import vllm.v1.worker.gpu.model_runner" if runner_first else ""
    built = run_python(fake_vllm, BUILD_BOTH_WAYS.format(before=before), env={"ROUTING_REPLAY_VLLM": "1"})
    assert built == ["LibraryConnector"] * 2


def test_worker_module_is_not_imported_until_vllm_imports_it(fake_vllm):
    body = '''
    import json, sys
    import vllm.plugins
    vllm.plugins.load_general_plugins()
    imported = "vllm.distributed.aux_output_connector.worker" in sys.modules
    import vllm.distributed.aux_output_connector.worker as worker
    print(json.dumps([imported, worker.AuxOutputWorkerConnector.__name__]))
    '''
    assert run_python(fake_vllm, body, env={"ROUTING_REPLAY_VLLM": "1"}) == [False, "LibraryConnector"]


def test_vllm_plugins_naming_others_leaves_vllm_alone(fake_vllm):
    built = run_python(fake_vllm, BUILD_BOTH_WAYS.format(before=""),
                       env={"ROUTING_REPLAY_VLLM": "1", "VLLM_PLUGINS": "someone_else"})
    assert built == ["AuxOutputWorkerConnector"] * 2


def test_loading_twice_patches_once(fake_vllm):
    body = '''
    import json
    import routing_replay.vllm.plugin as plugin
    plugin.register(); plugin.register()
    import vllm.distributed.aux_output_connector.worker as worker
    plugin.register()
    print(json.dumps([worker._routing_replay_originals["AuxOutputWorkerConnector"].__doc__, plugin.installed()]))
    '''
    assert run_python(fake_vllm, body, env={"ROUTING_REPLAY_VLLM": "1"}) == ["vLLM's own.", True]


def test_vllm_without_the_connector_is_refused(fake_vllm):
    (fake_vllm / "vllm/distributed/aux_output_connector/worker.py").unlink()
    body = '''
    import json
    import routing_replay.vllm.plugin as plugin
    try:
        plugin.register()
        print(json.dumps("accepted"))
    except RuntimeError as error:
        print(json.dumps(str(error)))
    '''
    message = run_python(fake_vllm, body, env={"ROUTING_REPLAY_VLLM": "1"})
    assert "aux_output_connector" in message and "0.33" in message


def test_entry_point_is_declared():
    try:
        dist = importlib.metadata.distribution("routing-replay")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("routing_replay runs from a checkout without its installed metadata")
    entry = [ep for ep in dist.entry_points if ep.group == "vllm.general_plugins"]
    assert [(ep.name, ep.value) for ep in entry] == [("routing_replay", "routing_replay.vllm.plugin:register")]


@pytest.mark.skipif(not have_library(), reason="routing_replay.vllm is not built here")
def test_on_builds_the_real_connector_and_it_runs_a_step(fake_vllm):
    body = '''
    import json
    from types import SimpleNamespace
    import numpy as np
    import vllm.plugins
    vllm.plugins.load_general_plugins()
    import vllm.v1.worker.gpu.model_runner as runner
    import routing_replay.vllm as library
    model = SimpleNamespace(modules=lambda: [])
    mc = SimpleNamespace(get_total_num_hidden_layers=lambda: 2, get_num_experts=lambda: 8,
                         get_num_experts_per_tok=lambda: 2, hf_text_config=SimpleNamespace(model_type="test"))
    config = SimpleNamespace(model_config=mc,
                             parallel_config=SimpleNamespace(data_parallel_rank=0, tensor_parallel_size=1),
                             scheduler_config=SimpleNamespace(max_num_batched_tokens=16, max_num_seqs=4),
                             max_concurrent_batches=2, aux_output_config=SimpleNamespace(max_bytes=None))
    spec = SimpleNamespace(block_size=4)
    kv = SimpleNamespace(num_blocks=64, block_size=4,
                         kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["layer"])])
    conn = runner.init_aux_output(model, config, kv)
    capturer = getattr(conn, "_capturer", None) or conn.capturer
    conn.begin_step(library.AuxOutputConnectorMetadata(0, {"r": 0}, {}, ()))
    ids = np.array([[1, 2], [3, 4], [5, 6]], dtype=np.int64)
    if capturer.device.startswith("cuda"):  # vLLM's runner puts the capturer on the GPU where there is one
        import torch
        ids = torch.from_numpy(ids).to(capturer.device)
    for layer in range(2):
        capturer.capture(layer, ids)
    pending = conn.prepare_output(SimpleNamespace(req_ids=["r"], query_start_loc_np=np.array([0, 3], np.int32),
                                                  num_computed_tokens_np=np.array([0], np.int32)))
    pending.enqueue_cpu_copy(num_sampled=np.array([1], np.int32), num_rejected=np.array([0], np.int32))
    out = pending.process_output()["r"]
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import BOUND
    print(json.dumps([type(conn).__module__, int(out.token_start), out.rows.tolist(), len(BOUND)]))
    conn.close()
    '''
    module, token_start, rows, bound = run_python(fake_vllm, body, env={"ROUTING_REPLAY_VLLM": "1"}, stand_in=False)
    assert module.startswith("routing_replay.vllm")
    assert token_start == 0 and rows == [[[1, 2], [1, 2]], [[3, 4], [3, 4]], [[5, 6], [5, 6]]]
    assert bound == 1, "the capturer was not bound to the model's MoE layers through vLLM's binder"


@pytest.mark.skipif(not have_library(), reason="routing_replay.vllm is not built here")
def test_outputs_cross_to_the_scheduler_process_by_pickle():
    """vLLM's worker sends ModelRunnerOutput (with aux_output_connector_output, {request:
    AuxRequestOutput}) to the scheduler process by pickle; the rows come back as equal numpy arrays."""
    import pickle

    import numpy as np

    import routing_replay.vllm as library

    rows = np.arange(24, dtype=np.uint8).reshape(4, 3, 2)
    outputs = {"r": library.AuxRequestOutput(5, rows)}
    back = pickle.loads(pickle.dumps(outputs, protocol=pickle.HIGHEST_PROTOCOL))
    assert back["r"].token_start == 5
    assert isinstance(back["r"].rows, np.ndarray) and back["r"].rows.dtype == np.uint8
    np.testing.assert_array_equal(back["r"].rows, rows)


def test_warns_when_vllm_plugins_leaves_it_out(monkeypatch):
    """ROUTING_REPLAY_VLLM set but VLLM_PLUGINS (vLLM's allow-list, split on commas, matched exactly)
    leaving routing_replay out: vLLM never calls the plugin, so the library says it in one line, once,
    when its vLLM code is imported; nothing where the allow-list names it or is unset."""
    import routing_replay.vllm.plugin as plugin

    monkeypatch.setenv("ROUTING_REPLAY_VLLM", "1")
    for allowed in ("someone_else", "", "someone_else, routing_replay"):
        monkeypatch.setenv("VLLM_PLUGINS", allowed)
        message = plugin.left_out_warning()
        assert message is not None and "\n" not in message, allowed
        assert f"VLLM_PLUGINS={allowed!r}" in message and "vLLM will not load the routing_replay plugin" in message
    assert "' routing_replay', and vLLM matches names exactly" in message
    for allowed in ("routing_replay", "someone_else,routing_replay"):
        monkeypatch.setenv("VLLM_PLUGINS", allowed)
        assert plugin.left_out_warning() is None, allowed
    monkeypatch.delenv("VLLM_PLUGINS")
    assert plugin.left_out_warning() is None
    monkeypatch.setenv("VLLM_PLUGINS", "someone_else")
    monkeypatch.setenv("ROUTING_REPLAY_VLLM", "0")
    assert plugin.left_out_warning() is None

    # in a fresh interpreter, as a process would meet it: one line on stderr at the import, not two
    environment = {k: v for k, v in os.environ.items() if k not in ("ROUTING_REPLAY_VLLM", "VLLM_PLUGINS")}
    environment.update(ROUTING_REPLAY_VLLM="1", VLLM_PLUGINS="someone_else")
    done = subprocess.run([sys.executable, "-c", "import routing_replay.vllm, routing_replay.vllm.plugin as p; "
                           "assert p.warn_if_left_out()"], env=environment, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "VLLM_PLUGINS" in line]
    assert len(lines) == 1 and "leaves routing_replay out" in lines[0], done.stderr
