"""Policy combinations compiled on first use.

The package compiles ahead of time what the engines' adapters and the defaults need (index int16,
layout layer_major: ``routing_replay._build.AOT_UNITS``). Any other index type and layout is one
unit of 8 instantiations (every copy strategy and storage), compiled the first time a replay asks
for it, into a shared library the native module loads into its factory table (``_load_instances``),
and kept in a per-user cache for the next processes:

- the cache: ``$ROUTING_REPLAY_CACHE_DIR``, else ``$XDG_CACHE_HOME/routing_replay`` (else
  ``~/.cache/routing_replay``), in a folder named by the package version and its build hash (the
  compilers, flags and headers it was built with), file names with a hash of the compiler's
  version and command: a unit is only ever loaded by the build that compiled it;
- the compile: the same compiler and flags as the build's own units (``_jit_sources/commands.json``,
  recorded at install time), from the headers and templates installed in ``_jit_sources/``; a file lock
  (``fcntl.flock``) so that concurrent processes compile once, then an atomic rename into place;
- a notice on stderr says what is compiled, where it is cached and how long it took;
- ``ROUTING_REPLAY_CXX`` / ``ROUTING_REPLAY_NVCC`` replace the recorded compilers.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from . import _build

_HERE = pathlib.Path(os.path.abspath(__file__)).parent
_JIT = _HERE / "_jit_sources"
_CPP_TYPES = {"uint8": "std::uint8_t", "uint16": "std::uint16_t", "int16": "std::int16_t", "int32": "std::int32_t"}
_TEMPLATES = {"host": ("host_instances.cpp.in", ".cpp"), "cuda": ("cuda_instances_of.cu.in", ".cu")}
_COMPILER_ENV = {"host": "ROUTING_REPLAY_CXX", "cuda": "ROUTING_REPLAY_NVCC"}
_ALL_OPTION = "pip install ./python -C cmake.define.ROUTING_REPLAY_PYTHON_ALL_COMBINATIONS=ON"
_lock = threading.Lock()
_loaded: set[tuple[str, str, str]] = set()  # (backend, index, layout) loaded into this process


def cache_dir() -> pathlib.Path:
    """The folder of this build's first-use compiles."""
    root = os.environ.get("ROUTING_REPLAY_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "routing_replay")
    from . import __version__

    return pathlib.Path(root) / f"{__version__}-{_build.BUILD_HASH}"


def ahead_of_time(index: str, layout: str) -> bool:
    """Whether the package compiled this index type and layout ahead of time."""
    return f"{index}/{layout}" in _build.AOT_UNITS


def _commands() -> dict:
    with open(_JIT / "commands.json") as f:
        return json.load(f)


def _cccl_include(recorded: str) -> str | None:
    """The CCCL headers: the build's, else those of the nvidia-cuda-cccl wheel in this environment."""
    if recorded and os.path.isdir(recorded):
        return recorded
    spec = importlib.util.find_spec("nvidia")
    for d in (spec.submodule_search_locations if spec else None) or []:
        candidate = pathlib.Path(d, "cu13", "include", "cccl")
        if (candidate / "cuda" / "std" / "mdspan").is_file():
            return str(candidate)
    return None


def _what(backend: str, index: str, layout: str) -> str:
    return f"index {index}, layout {layout} for the {backend} backend"


def _command(backend: str, index: str, layout: str) -> tuple[list[str], dict]:
    """The compile command of a unit, its source and output left out; raises when no compiler."""
    record = _commands()
    if backend not in record:
        raise RuntimeError(f"routing_replay: cannot compile {_what(backend, index, layout)}: this build has no "
                           f"{backend} module; reinstall with {_ALL_OPTION}")
    compiler = os.environ.get(_COMPILER_ENV[backend]) or record[backend]["compiler"]
    found = shutil.which(compiler)
    if found is None:
        raise RuntimeError(
            f"routing_replay: {_what(backend, index, layout)} is not compiled ahead of time, and its first-use "
            f"compile needs the compiler {compiler} (${_COMPILER_ENV[backend]} overrides it), which is not "
            f"found here; install it, or get every combination ahead of time: {_ALL_OPTION}")
    args = []
    words = iter(record[backend]["args"])
    for word in words:
        if word in ("-I", "-isystem"):
            path = next(words)
            if path == "{cccl}":
                path = _cccl_include(record.get("cccl_include", ""))
                if path is None:
                    raise RuntimeError(f"routing_replay: compiling {_what(backend, index, layout)} needs CCCL's "
                                       "headers (the CUDA Toolkit's, or pip install nvidia-cuda-cccl)")
            path = path.replace("{jit}", str(_JIT))
            if os.path.isdir(path):  # the build's Python and nanobind headers: not needed by a unit
                args += [word, path]
        else:
            args.append(word)
    return [found] + args, record


def _library_name(backend: str, index: str, layout: str, command: list[str]) -> str:
    version = subprocess.run([command[0], "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256("\0".join([version] + command).encode()).hexdigest()[:12]
    return f"{backend}_{index}_{layout}-{key}.so"


def _compile(backend: str, index: str, layout: str, command: list[str], record: dict, target: pathlib.Path) -> None:
    template, suffix = _TEMPLATES[backend]
    text = (_JIT / "src" / "instances" / template).read_text()
    for name, value in (("INDEX_TYPE", _CPP_TYPES[index]), ("INDEX", index), ("LAYOUT", layout)):
        text = text.replace(f"@{name}@", value)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        source = pathlib.Path(tmp, f"{backend}_{index}_{layout}{suffix}")
        source.write_text(text)
        obj, library = source.with_suffix(".o"), pathlib.Path(tmp, target.name)
        link = [command[0], "-shared", str(obj), "-o", str(library)]
        if backend == "cuda":  # against the CUDA runtime the module loaded (the same soname)
            link[1:1] = ["-cudart", "shared"]
            if record.get("cudart_dir"):
                link += ["-L", record["cudart_dir"], f"-Xlinker=-rpath,{record['cudart_dir']}"]
        for step in (command + ["-DROUTING_REPLAY_JIT_UNIT=1", "-c", str(source), "-o", str(obj)], link):
            done = subprocess.run(step, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"routing_replay: compiling {_what(backend, index, layout)} failed "
                                   f"({' '.join(step)}):\n{done.stderr[-4000:]}")
        os.replace(library, target)  # atomic: other processes see a whole library or none


def load(backend: str, index: str, layout: str, module) -> None:
    """Makes the unit of ``index`` and ``layout`` available in ``module`` (``_core`` or
    ``_core_cuda``): from the cache, else compiled now (with a notice on stderr)."""
    with _lock:
        if (backend, index, layout) in _loaded:
            return
        command, record = _command(backend, index, layout)
        folder = cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / _library_name(backend, index, layout, command)
        if not target.exists():
            with open(folder / (target.name + ".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be compiling it: wait for it
                if not target.exists():
                    print(f"routing_replay: compiling {_what(backend, index, layout)} (first use; cached in "
                          f"{folder})", end="", file=sys.stderr, flush=True)
                    start = time.monotonic()
                    try:
                        _compile(backend, index, layout, command, record, target)
                    finally:
                        print(f": {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
        module._load_instances(str(target))
        _loaded.add((backend, index, layout))


def ensure(backend: str, index: str, layout: str, module) -> None:
    """Loads the unit first if the combination was not compiled ahead of time (cheap otherwise)."""
    if not ahead_of_time(index, layout) and (backend, index, layout) not in _loaded:
        load(backend, index, layout, module)
