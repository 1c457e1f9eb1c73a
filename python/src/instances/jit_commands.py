"""Records, at install time, how routing_replay/_jit.py compiles a unit on first use: the compile
command CMake ran for a unit compiled ahead (compile_commands.json), without its source, output and
dependency-file arguments, with the build's include directories turned into the installed copies
({jit}: routing_replay/_jit_sources) and the CCCL headers marked ({cccl}: _jit.py finds them again where
the build's copy, e.g. in pip's temporary build environment, is gone). Run by python/CMakeLists.txt."""

import argparse
import json
import os
import shlex

_DROP_WITH_VALUE = {"-o", "-c", "-MT", "-MF", "-MQ"}
_DROP = {"-MD", "-MMD"}
_INCLUDE_FLAGS = ("-I", "-isystem")


def _map_path(path, args):
    path = os.path.normpath(path)
    for root, mapped in ((args.source_dir, "{jit}/src"), (args.include_dir, "{jit}/include")):
        root = os.path.normpath(root)
        if path == root or path.startswith(root + os.sep):
            return mapped + path[len(root):]
    if os.path.isfile(os.path.join(path, "cuda", "std", "mdspan")):
        args.cccl_include = path  # the toolkit's, or the nvidia-cuda-cccl wheel's in pip's build environment
        return "{cccl}"
    generated = os.path.normpath(args.generated_dir)
    if path == generated or path.startswith(generated + os.sep):
        return None  # the registry of the ahead-of-time units: no first-use unit includes it
    return path  # e.g. the toolkit's: kept; _jit.py leaves out those missing at run time


def _command(entry, args):
    words = entry["arguments"] if "arguments" in entry else shlex.split(entry["command"])
    compiler, out, i = words[0], [], 1
    while i < len(words):
        word = words[i]
        if word in _DROP_WITH_VALUE:
            i += 2
            continue
        if word in _DROP:
            i += 1
            continue
        if word in _INCLUDE_FLAGS and i + 1 < len(words):
            flag, value, i = word, words[i + 1], i + 2
        elif word.startswith("-isystem"):
            flag, value, i = "-isystem", word[len("-isystem"):].lstrip("="), i + 1
        elif word.startswith("-I"):
            flag, value, i = "-I", word[2:], i + 1
        else:
            if os.path.normpath(word) != os.path.normpath(entry["file"]):
                out.append(word)
            i += 1
            continue
        mapped = _map_path(value, args)
        if mapped is not None:
            out += [flag, mapped]
    return {"compiler": compiler, "args": out}


def main():
    parser = argparse.ArgumentParser()
    for name in ("compile-commands", "host-unit", "cuda-unit", "source-dir", "include-dir", "generated-dir",
                 "cudart-dir", "out"):
        parser.add_argument("--" + name, default="")
    args = parser.parse_args()
    with open(args.compile_commands) as f:
        entries = {os.path.normpath(e["file"]): e for e in json.load(f)}
    args.cccl_include = ""
    record = {"cudart_dir": args.cudart_dir}
    for backend, unit in (("host", args.host_unit), ("cuda", args.cuda_unit)):
        if unit:
            record[backend] = _command(entries[os.path.normpath(unit)], args)
    record["cccl_include"] = args.cccl_include
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
