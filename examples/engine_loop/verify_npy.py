#!/usr/bin/env python3
"""Checks the demo's output with numpy: every request_<id>.npy in DIR loads as [T, 48, 8] of the
expected dtype and equals the synthetic router, id(req, pos, layer, k) =
(req*7919 + pos*31 + layer*131 + k*17) mod 128.

Usage: verify_npy.py DIR [DTYPE]   (DTYPE: uint8, uint16, int16 (default), int32: the demo's --index)

A file whose dtype is not DTYPE is reported as such (with the command that matches it), whether or
not its ids are right; exit status 0 only when every file matches in dtype, shape and ids.
"""
import glob
import os
import re
import sys

import numpy as np

DTYPES = ("uint8", "uint16", "int16", "int32")


def main() -> int:
    if len(sys.argv) not in (2, 3) or (len(sys.argv) == 3 and sys.argv[2] not in DTYPES):
        print(f"usage: verify_npy.py DIR [DTYPE]   (DTYPE: {', '.join(DTYPES)}; default int16)")
        return 2
    out_dir = sys.argv[1]
    dtype = np.dtype(sys.argv[2] if len(sys.argv) > 2 else "int16")
    files = sorted(glob.glob(os.path.join(out_dir, "request_*.npy")))
    if not files:
        print(f"no request_*.npy in {out_dir}: run scripts/demo.sh first")
        return 1
    bad = 0
    other_dtypes = set()
    for path in files:
        req = int(re.search(r"request_(\d+)\.npy$", path).group(1))
        rows = np.load(path)
        t = rows.shape[0]
        pos = np.arange(t).reshape(t, 1, 1)
        layer = np.arange(48).reshape(1, 48, 1)
        k = np.arange(8).reshape(1, 1, 8)
        expected = (req * 7919 + pos * 31 + layer * 131 + k * 17) % 128
        ids_ok = rows.shape == (t, 48, 8) and np.array_equal(rows, expected)
        dtype_ok = rows.dtype == dtype
        if not dtype_ok:
            other_dtypes.add(rows.dtype.name)
        bad += 0 if ids_ok and dtype_ok else 1
        verdict = (" ok" if ids_ok else " MISMATCH") if dtype_ok else \
            f", expected {dtype.name}; ids {'ok' if ids_ok else 'MISMATCH'}"
        print(f"{os.path.basename(path)}: shape {rows.shape} {rows.dtype}{verdict}")
    print(f"verify_npy: {len(files) - bad}/{len(files)} files match the synthetic router as {dtype.name}")
    if other_dtypes:
        found = ", ".join(sorted(other_dtypes))
        print(f"verify_npy: the files hold {found}, not {dtype.name}: pass {found} "
              f"(verify_npy.py {out_dir} {found}), or rerun the demo with --index {dtype.name}")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
