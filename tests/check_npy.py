#!/usr/bin/env python3
"""numpy.load must read back the library's .npy files and base64(.npy) strings bit-exact.

Usage: check_npy.py HOST_TESTS_BINARY OUT_DIR. Runs the npy test case of the host tests with
ROUTING_REPLAY_NPY_DIR=OUT_DIR, then loads every sample with numpy and compares shape, dtype and
values with the ids the C++ side wrote as text.
"""
import base64
import io
import os
import subprocess
import sys

import numpy as np

DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "int16": np.int16, "int32": np.int32}


def main() -> int:
    binary, out_dir = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, ROUTING_REPLAY_NPY_DIR=out_dir)
    subprocess.run([binary, "--test-case=*as .npy and base64*"], check=True, env=env)
    for name, dtype in DTYPES.items():
        with open(os.path.join(out_dir, name + ".txt")) as f:
            shape = tuple(int(x) for x in f.readline().split())
            values = np.array([int(line) for line in f], dtype=dtype).reshape(shape)
        from_file = np.load(os.path.join(out_dir, name + ".npy"))
        with open(os.path.join(out_dir, name + ".b64")) as f:
            from_wire = np.load(io.BytesIO(base64.b64decode(f.read())))
        for label, array in (("file", from_file), ("base64", from_wire)):
            assert array.dtype == np.dtype(dtype), (name, label, array.dtype)
            assert array.shape == shape, (name, label, array.shape)
            assert array.flags["C_CONTIGUOUS"], (name, label)
            assert np.array_equal(array, values), (name, label)
        print(f"{name}: numpy read {shape} {np.dtype(dtype)} bit-exact from .npy and base64")
    return 0


if __name__ == "__main__":
    sys.exit(main())
