"""Installing routing_replay's capturer into SGLang: the import-time patch, the launcher, and the
sitecustomize that reaches the processes SGLang spawns. Tested on a fake minimal ``sglang`` package
tree written here: its ``routed_experts`` module, a model runner that imports the class by name and
builds it through ``create``, and a ``launch_server`` that builds one in its own process and one in
a spawned process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import routing_replay

pytest.importorskip("torch")

OURS = "routing_replay.sglang.capturer.RoutedExpertsCapturer"
SGLANGS = "sglang.srt.state_capturer.routed_experts.RoutedExpertsCapturer"

FAKE_SGLANG = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/state_capturer/__init__.py": "",
    "sglang/srt/state_capturer/routed_experts.py": """
        from types import SimpleNamespace

        _CTX = SimpleNamespace(
            exec=SimpleNamespace(features=SimpleNamespace(enable_return_routed_experts=True)),
            schedule=SimpleNamespace(chunked_prefill_size=64),
            parallel=SimpleNamespace(num_dp_ranks=1),
            resources=SimpleNamespace(experts_capturer=None),
        )
        get_exec = lambda: _CTX.exec
        get_schedule = lambda: _CTX.schedule
        get_parallel = lambda: _CTX.parallel
        is_dp_attention_enabled = lambda: False


        def _is_scattered_a2a_backend():
            return False


        class RoutedExpertsCapturer:
            @staticmethod
            def create(*, model, model_config, num_tokens, max_running_requests, device):
                return RoutedExpertsCapturer()


        def get_global_experts_capturer():
            return _CTX.resources.experts_capturer


        def set_global_experts_capturer(capturer):
            _CTX.resources.experts_capturer = capturer
        """,
    "sglang/srt/model_executor/__init__.py": "",
    "sglang/srt/model_executor/model_runner.py": """
        from types import SimpleNamespace

        from sglang.srt.state_capturer.routed_experts import (
            RoutedExpertsCapturer,
            get_global_experts_capturer,
            set_global_experts_capturer,
        )


        def build():
            model = SimpleNamespace(shared_experts_config=SimpleNamespace(num_fused_shared_experts=1))
            text = SimpleNamespace(num_hidden_layers=2, num_experts_per_tok=2, num_experts=8)
            set_global_experts_capturer(RoutedExpertsCapturer.create(
                model=model, model_config=SimpleNamespace(hf_text_config=text), num_tokens=32,
                max_running_requests=4, device="cpu"))
            cap = get_global_experts_capturer()
            kind = type(cap).__module__ + "." + type(cap).__name__
            rows = cap.native.config.max_tokens_per_step if hasattr(cap, "native") else None
            return {"class": kind, "rows": rows}
        """,
    "sglang/launch_server.py": """
        import json
        import multiprocessing
        import os
        import sys


        def record(out, where):
            from sglang.srt.model_executor import model_runner

            with open(out, "a") as f:
                f.write(json.dumps(dict(model_runner.build(), where=where, pid=os.getpid())) + "\\n")


        if __name__ == "__main__":
            out = sys.argv[sys.argv.index("--out") + 1]
            record(out, "launcher")
            child = multiprocessing.get_context("spawn").Process(target=record, args=(out, "spawned"))
            child.start()
            child.join()
            sys.exit(child.exitcode)
        """,
}


@pytest.fixture
def fake_sglang(tmp_path):
    for name, text in FAKE_SGLANG.items():
        path = tmp_path / "tree" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def run(tmp_path, args, *, extra_paths=(), env=None):
    """Runs `python args` with the fake tree and routing_replay importable; returns its records."""
    package_root = os.path.dirname(os.path.dirname(routing_replay.__file__))
    environ = {k: v for k, v in os.environ.items() if k not in ("ROUTING_REPLAY_SGLANG", "PYTHONPATH")}
    environ["PYTHONPATH"] = os.pathsep.join([*extra_paths, str(tmp_path / "tree"), package_root])
    environ.update(env or {})
    out = tmp_path / "records.jsonl"
    done = subprocess.run([sys.executable, *args, "--out", str(out)], env=environ, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in out.read_text().splitlines()], done


def test_the_launcher_installs_ours_in_its_process_and_in_spawned_ones(fake_sglang):
    records, _ = run(fake_sglang, ["-m", "routing_replay.sglang.launch_server"])
    assert {r["where"] for r in records} == {"launcher", "spawned"}
    assert len({r["pid"] for r in records}) == 2
    for r in records:
        assert r["class"] == OURS, r
        assert r["rows"] == 64  # SGLang's chunked-prefill size, read through its own module


def test_sglang_alone_keeps_its_own_capturer(fake_sglang):
    records, _ = run(fake_sglang, ["-m", "sglang.launch_server"])
    assert [r["class"] for r in records] == [SGLANGS, SGLANGS]


def test_a_module_that_imported_sglangs_class_before_the_install_builds_ours(fake_sglang):
    script = fake_sglang / "early.py"
    script.write_text(textwrap.dedent("""
        import json, sys
        from sglang.srt.model_executor import model_runner  # binds SGLang's class now
        from routing_replay.sglang.install import install, installed
        assert not installed()
        install()
        assert installed()
        import sglang.srt.state_capturer.routed_experts as m
        assert m.RoutedExpertsCapturer.__module__ == "routing_replay.sglang.capturer"
        with open(sys.argv[sys.argv.index("--out") + 1], "w") as f:
            f.write(json.dumps(model_runner.build()) + "\\n")
        """))
    records, _ = run(fake_sglang, [str(script)])
    assert records[0]["class"] == OURS


def test_create_returns_none_where_sglang_returns_no_routed_experts(fake_sglang):
    script = fake_sglang / "disabled.py"
    script.write_text(textwrap.dedent("""
        import json, sys
        from routing_replay.sglang.install import install
        install()
        import sglang.srt.state_capturer.routed_experts as m
        m._CTX.exec.features.enable_return_routed_experts = False
        from sglang.srt.model_executor import model_runner
        with open(sys.argv[sys.argv.index("--out") + 1], "w") as f:
            f.write(json.dumps(model_runner.build()) + "\\n")
        """))
    records, _ = run(fake_sglang, [str(script)])
    assert records == [{"class": "builtins.NoneType", "rows": None}]


def test_the_site_hook_runs_the_sitecustomize_it_shadows(fake_sglang):
    other = fake_sglang / "other_site"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_SITECUSTOMIZE_RAN'] = '1'\n")
    script = fake_sglang / "probe.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        from routing_replay.sglang.install import installed
        import sglang.srt.state_capturer.routed_experts  # patched on import by the hook
        with open(sys.argv[sys.argv.index("--out") + 1], "w") as f:
            f.write(json.dumps({"installed": installed(),
                                "shadowed": os.environ.get("SHADOWED_SITECUSTOMIZE_RAN")}) + "\\n")
        """))
    from routing_replay.sglang.launch_server import SITE_DIR

    records, _ = run(fake_sglang, [str(script)], extra_paths=[SITE_DIR, str(other)],
                     env={"ROUTING_REPLAY_SGLANG": "1"})
    assert records == [{"installed": True, "shadowed": "1"}]
    records, _ = run(fake_sglang, [str(script)], extra_paths=[SITE_DIR, str(other)])
    assert records == [{"installed": False, "shadowed": "1"}]


def test_prepare_environment_puts_the_site_folder_first_once():
    from routing_replay.sglang.launch_server import SITE_DIR, prepare_environment

    env = {"PYTHONPATH": os.pathsep.join(["/a", SITE_DIR, "/b"])}
    prepare_environment(env)
    assert env["ROUTING_REPLAY_SGLANG"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [SITE_DIR, "/a", "/b"]
