"""``python -m routing_replay.sglang.launch_server <SGLang server arguments>``: an SGLang 0.5 server
whose routed-experts capturer is routing_replay's, in every process it starts.

It sets ``ROUTING_REPLAY_SGLANG=1`` and puts ``routing_replay/sglang/_site`` first on ``PYTHONPATH``
(its ``sitecustomize`` installs ours in each process SGLang spawns, then runs the one it shadows),
installs ours here, and runs ``sglang.launch_server`` with the arguments given.
"""

from __future__ import annotations

import os
import runpy
import sys

from .install import ENV_FLAG, install

#: The folder whose sitecustomize installs the capturer in spawned processes.
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")


def prepare_environment(environ=os.environ) -> None:
    """Makes every Python process started from `environ` install the capturer."""
    environ[ENV_FLAG] = "1"
    rest = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != SITE_DIR]
    environ["PYTHONPATH"] = os.pathsep.join([SITE_DIR, *rest])


def main(argv=None) -> None:
    """Runs ``sglang.launch_server`` with `argv` (default: this command's arguments)."""
    args = sys.argv[1:] if argv is None else list(argv)
    prepare_environment()
    install()
    sys.argv = ["sglang.launch_server", *args]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
