"""Run by Python at start-up in every process whose PYTHONPATH starts with this folder
(routing_replay.sglang.launch_server puts it there): installs routing_replay's capturer into SGLang
when ROUTING_REPLAY_SGLANG=1, so that the scheduler and model workers SGLang spawns use it too; then
runs the sitecustomize module this one shadows, if there is one."""

import importlib.machinery
import importlib.util
import os
import sys


def _install() -> None:
    if os.environ.get("ROUTING_REPLAY_SGLANG") != "1":
        return
    try:
        from routing_replay.sglang.install import install

        install()
    except Exception as e:  # the process starts regardless; say why SGLang's capturer stays
        sys.stderr.write(f"routing_replay: the SGLang capturer was not installed in process {os.getpid()}: {e!r}\n")


def _run_shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_install()
_run_shadowed()
