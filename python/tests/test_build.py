"""The native modules were compiled as their build type says: an optimized build type must reach
every language. (The CUDA module's host code, the library's whole step path, was once built
without optimization while the host module was: 5 to 8 times slower from Python than from C++.)"""

import re

import pytest

from routing_replay import _build

OPTIMIZED = {"Release", "RelWithDebInfo", "MinSizeRel"}


def _optimization(flags: str) -> str | None:
    found = re.findall(r"(?:^|\s)-O([0-3sz]|fast)(?=\s|$)", flags)
    return found[-1] if found else None


@pytest.mark.skipif(_build.BUILD_TYPE not in OPTIMIZED, reason=f"build type {_build.BUILD_TYPE!r} is not optimized")
def test_host_module_is_optimized():
    assert _optimization(_build.CXX_FLAGS) not in (None, "0"), _build.CXX_FLAGS


@pytest.mark.skipif(_build.BUILD_TYPE not in OPTIMIZED, reason=f"build type {_build.BUILD_TYPE!r} is not optimized")
@pytest.mark.skipif("cuda" not in _build.BACKENDS, reason="no CUDA module was built")
def test_cuda_module_is_optimized():
    assert _optimization(_build.CUDA_FLAGS) not in (None, "0"), _build.CUDA_FLAGS
