"""routing_replay: capture the experts a Mixture-of-Experts router chose, per token and layer, move
them off the GPU, file them per request and hand them back as ``[T, L, K]`` numpy arrays.

Python bindings of the header-only C++20/CUDA library (docs/design.md). Two native modules:
``_core`` (host backend: "device" arrays are numpy arrays, streams are worker threads) is always
built; ``_core_cuda`` (CUDA backend) is built where nvcc was found. :func:`backends` says which.

One engine step::

    import routing_replay as rr
    replay = rr.Replay(num_experts=128, top_k=8, max_tokens_per_step=8192, max_model_len=32768,
                       moe_layers=range(48), device="cuda", copy="double_buffered")
    replay.add_request("chat-7", prompt_length=1024)
    plan = rr.StepPlan()
    plan.schedule("chat-7", first_position=0, num_tokens=512)  # positions come from the engine
    with replay.step(plan):                                     # begin_step ... end_step
        for layer in range(48):
            replay.capture(layer, topk_ids[layer])              # torch int64 [512, 8], graph safe
    routing = replay.extract("chat-7")                          # numpy [T, 48, 8] int16
    field = replay.extract_base64_npy("chat-7")                 # vLLM's `routed_experts`

Engines written against vLLM's capturer use :class:`routing_replay.capturer.RoutedExpertsCapturer`.
"""

from __future__ import annotations

from ._build import BACKENDS as _BUILT_BACKENDS
from ._build import CUDA_NOTE as _CUDA_NOTE
from ._core import Config, Error, HostEvent, HostStream, StepPlan
from ._native import (COPY_STRATEGIES, INDEX_TYPES, LAYOUTS, STORAGES, _cuda, _cuda_device, _parse_device,
                      _policy_error, _usable_cuda, backends, cuda_available, policies)
from ._replay import Replay, _live, _never_compiling, _replay_ids, _torch_capture_op
from ._wire import from_base64_npy, sentinel, to_base64_npy, to_npy, write_npy

__all__ = [
    "Config",
    "Error",
    "HostEvent",
    "HostStream",
    "Replay",
    "StepPlan",
    "INDEX_TYPES",
    "LAYOUTS",
    "COPY_STRATEGIES",
    "STORAGES",
    "backends",
    "cuda_available",
    "policies",
    "sentinel",
    "to_npy",
    "to_base64_npy",
    "from_base64_npy",
    "write_npy",
]

try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("routing-replay")
except PackageNotFoundError:  # imported from a source tree
    __version__ = "unknown"

# The public names are documented, and pickled, as the package's own.
for _name in ("Replay", "backends", "cuda_available", "policies", "sentinel", "to_npy", "to_base64_npy",
              "from_base64_npy", "write_npy"):
    globals()[_name].__module__ = __name__
del _name
