#!/usr/bin/env python3
"""Checks that each part's files are reached only through the part's public header.

    python3 tests/check_part_includes.py [--root CHECKOUT] [--no-python-src]

include/routing_replay/detail/ holds one folder per part (block_tier/, host_storage/, wire/...)
and, at its top level, what every part uses (at most TOP_LEVEL_MAX files). An include of
<routing_replay/detail/PART/...> is allowed
  - in detail/PART/ itself;
  - in a public header (include/routing_replay/, outside detail/) that PUBLIC_PARTS maps to PART;
  - in a python/src file of a folder that PYTHON_DETAIL_PARTS maps to PART.
A file under detail/'s top level includes no part's file. Public headers and detail/'s top level
may be included from anywhere. PUBLIC_PARTS names existing headers, and some header reaches each
part. tests/, benchmarks/ and examples/ are not checked: unit tests reach into a part on purpose.

python/src follows the same plan with quoted includes (resolved against the including file's
folder, then python/src; a generated NAME is found as NAME.in): a file may include python/src's
top level (at most TOP_LEVEL_MAX files), files of its own folder, and the public headers of the
other folders (PYTHON_PUBLIC). Each offending line is printed as path:line; the exit status is 1
when there is one.
"""
import argparse
import os
import re
import sys

TOP_LEVEL_MAX = 12

# public header, or public folder (ending in "/"), relative to include/routing_replay/ -> the
# detail/ parts it may include
PUBLIC_PARTS = {
    "block_tier.hpp": {"block_tier"},
    "buffer_layout.hpp": {"policies"},
    "host_backend.hpp": {"policies"},
    "host_storage.hpp": {"host_storage"},
    "kept_rows_pool.hpp": {"kept_pool"},
    "route_record.hpp": {"wire"},
    "row_streams.hpp": {"row_streams"},
    "slot_rows.hpp": {"slot_rows"},
    "extract_record.hpp": {"slot_rows"},
    "data_path/": {"data_path"},
    "parallel/": {"parallel"},
}

# python/src folder -> the library's detail/ parts its files may include
PYTHON_DETAIL_PARTS = {
    "row_streams": {"row_streams"},
}

# python/src: each folder's public headers (relative to python/src; generated ones by their name)
PYTHON_PUBLIC = {
    "instances/instances.hpp",
    "instances/jit_loader.hpp",  # the modules load first-use instantiations through it
    "instances/cuda_instances.hpp",
    "instances/instance_registry.hpp",
    "row_streams/stream_bindings.hpp",
    "slot_rows/slot_rows_bindings.hpp",
}

SOURCES = (".hpp", ".cuh", ".cpp", ".cu", ".in")
LIBRARY_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]routing_replay/detail/([^>"]+)[>"]')
QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')


def source_files(top):
    for folder, dirs, files in os.walk(top):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(SOURCES):
                yield os.path.relpath(os.path.join(folder, name), top).replace(os.sep, "/")


def folder_of(rel):
    """'a/b/c.hpp' -> 'a'; 'c.hpp' -> '' (the top level)."""
    return rel.split("/", 1)[0] if "/" in rel else ""


def lines(path):
    with open(path, encoding="utf-8") as f:
        yield from enumerate(f, 1)

def allowed_parts_of_public(rel):
    """The detail parts a public header (relative to include/routing_replay/) may include."""
    return set().union(*(v for k, v in PUBLIC_PARTS.items() if k == rel or (k.endswith("/") and rel.startswith(k))))


def check_detail_include(where, line, target, allowed, problems):
    part = folder_of(target)
    if part and part not in allowed:
        reach = ", ".join(sorted(allowed)) if allowed else "no part"
        problems.append(f"{where}:{line}: includes detail/{target}, a file of part '{part}' "
                        f"(this file may reach {reach}; include the part's public header)")


def check_library(root, problems):
    top = os.path.join(root, "include", "routing_replay")
    for rel in source_files(top):
        where = f"include/routing_replay/{rel}"
        detail = rel.startswith("detail/")
        allowed = {folder_of(rel[len("detail/"):])} - {""} if detail else allowed_parts_of_public(rel)
        for number, text in lines(os.path.join(top, rel)):
            match = LIBRARY_INCLUDE.match(text)
            if match:
                check_detail_include(where, number, match.group(1), allowed, problems)
    detail = os.path.join(top, "detail")
    count_top_level(detail, "include/routing_replay/detail", problems)
    stale = [k for k in PUBLIC_PARTS if not os.path.exists(os.path.join(top, k))]
    stale += [f"detail/{d}/ (no public header reaches it)" for d in sorted(os.listdir(detail))
              if os.path.isdir(os.path.join(detail, d)) and d not in set().union(*PUBLIC_PARTS.values())]
    problems += [f"tests/check_part_includes.py: PUBLIC_PARTS is out of date: {k}" for k in stale]


def resolve(src, rel, name):
    """Where the quoted include `name` of python/src/`rel` resolves, relative to python/src."""
    for base in (os.path.dirname(rel), ""):
        candidate = os.path.normpath(os.path.join(base, name)).replace(os.sep, "/")
        if os.path.isfile(os.path.join(src, candidate)) or os.path.isfile(os.path.join(src, candidate + ".in")):
            return candidate
    return None


def check_python_src(root, problems):
    src = os.path.join(root, "python", "src")
    for rel in source_files(src):
        where, own = f"python/src/{rel}", folder_of(rel)
        for number, text in lines(os.path.join(src, rel)):
            match = LIBRARY_INCLUDE.match(text)
            if match:
                check_detail_include(where, number, match.group(1), PYTHON_DETAIL_PARTS.get(own, set()),
                                     problems)
                continue
            match = QUOTED_INCLUDE.match(text)
            if not match:
                continue
            target = resolve(src, rel, match.group(1))
            if target is None:
                problems.append(f'{where}:{number}: #include "{match.group(1)}" names no file of python/src')
            elif folder_of(target) not in ("", own) and target not in PYTHON_PUBLIC:
                public = sorted(p for p in PYTHON_PUBLIC if folder_of(p) == folder_of(target))
                problems.append(f"{where}:{number}: includes {target}, inside folder '{folder_of(target)}' "
                                f"(include one of its public headers: {', '.join(public) or 'none'})")
    count_top_level(src, "python/src", problems)


def count_top_level(folder, name, problems):
    files = sorted(n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n)) and n[0] != ".")
    if len(files) > TOP_LEVEL_MAX:
        problems.append(f"{name}/: {len(files)} files at the top level, at most {TOP_LEVEL_MAX} "
                        f"(move a part's files into its folder): {' '.join(files)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                        help="the checkout (default: this file's)")
    parser.add_argument("--no-python-src", action="store_true", help="check include/ only")
    args = parser.parse_args()
    problems = []
    check_library(args.root, problems)
    if not args.no_python_src:
        check_python_src(args.root, problems)
    print("\n".join(problems) if problems else "ok: every part's files are reached through its public header")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
