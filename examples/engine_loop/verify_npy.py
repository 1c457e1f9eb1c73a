#!/usr/bin/env python3
"""Checks the demo's output with numpy: every request_<id>.npy in DIR loads as [T, 48, 8] of the
expected dtype and equals the synthetic router, id(req, pos, layer, k) =
(req*7919 + pos*31 + layer*131 + k*17) mod 128.

Usage: verify_npy.py DIR [DTYPE]   (DTYPE: uint8, uint16, int16 (default), int32)
"""
import glob
import os
import re
import sys

import numpy as np


def main() -> int:
    out_dir = sys.argv[1]
    dtype = np.dtype(sys.argv[2] if len(sys.argv) > 2 else "int16")
    files = sorted(glob.glob(os.path.join(out_dir, "request_*.npy")))
    if not files:
        print(f"no request_*.npy in {out_dir}")
        return 1
    bad = 0
    for path in files:
        req = int(re.search(r"request_(\d+)\.npy$", path).group(1))
        rows = np.load(path)
        t = rows.shape[0]
        pos = np.arange(t).reshape(t, 1, 1)
        layer = np.arange(48).reshape(1, 48, 1)
        k = np.arange(8).reshape(1, 1, 8)
        expected = (req * 7919 + pos * 31 + layer * 131 + k * 17) % 128
        ok = rows.dtype == dtype and rows.shape == (t, 48, 8) and np.array_equal(rows, expected)
        bad += 0 if ok else 1
        print(f"{os.path.basename(path)}: shape {rows.shape} {rows.dtype} {'ok' if ok else 'MISMATCH'}")
    print(f"verify_npy: {len(files) - bad}/{len(files)} files match the synthetic router")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
