"""The SGLang peer over the installed SGLang 0.5.23's own classes: the names of the stubbed peer
(``sglang_0_5_23_capturer.py``, see ``_peers``) that the SGLang tests use, each SGLang's own.

What SGLang's launcher would have set up, and is set up here instead, once per process:

- the runtime context: SGLang's own ``ServerArgs`` (a small Qwen3-MoE config.json written to a
  temporary folder as the model path, no weights; routed-experts return on; device "cpu" where
  torch sees no GPU) published with SGLang's ``runtime_context.publish`` for one scheduler rank,
  so that the capturer's ``get_exec`` / ``get_schedule`` / ``get_parallel`` read SGLang's bags;
- on a machine without a CUDA driver only: SGLang's host cache allocates through
  ``ALLOC_MEMORY_FUNCS[device]``, whose default registers the buffer with ``cudaHostRegister``
  (``torch.cuda.cudart()``, which fails without a driver), and unregisters it the same way when the
  capturer goes; there the "cpu" entry is a plain, unpinned allocation and the unregistering is
  skipped (the same substitution the stubbed peer makes). With a GPU nothing is replaced.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

import sglang
import sglang.srt.state_capturer.base as _base
from sglang.srt import runtime_context
from sglang.srt.mem_cache.pool_host import common as _host_pool
from sglang.srt.server_args import ServerArgs
from sglang.srt.state_capturer.routed_experts import (  # noqa: F401  (the peer's names)
    RoutedExpertsCapturer,
    extract_routed_experts_from_meta_info,
    pybase64,
)

VERSION = sglang.__version__
LOCATION = str(Path(sglang.__file__).parent)
if VERSION != "0.5.23":
    raise ImportError(f"the installed SGLang is {VERSION} at {LOCATION}; these tests restate 0.5.23")

_MODEL = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
          "intermediate_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 1000,
          "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "decoder_sparse_step": 1,
          "mlp_only_layers": []}


def _publish() -> None:
    folder = Path(tempfile.mkdtemp(prefix="routing_replay_sglang_"))
    (folder / "config.json").write_text(json.dumps(_MODEL))
    args = ServerArgs(model_path=str(folder), skip_tokenizer_init=True, enable_return_routed_experts=True,
                      chunked_prefill_size=8192, device="cuda" if torch.cuda.is_available() else "cpu")
    runtime_context.publish(args, role="scheduler", ranks=runtime_context.SpawnRanks(world_rank=0))


_publish()

if not torch.cuda.is_available():
    def _unpinned(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
        return torch.empty(dims, dtype=dtype, device=device)

    _base.ALLOC_MEMORY_FUNCS["cpu"] = _unpinned
    _base._cuda_host_unregister = lambda tensor: None
    assert _base.ALLOC_MEMORY_FUNCS is _host_pool.ALLOC_MEMORY_FUNCS


def model_config(num_layers, top_k):
    """The ModelConfig fields the capturer reads."""
    return SimpleNamespace(hf_text_config=SimpleNamespace(num_hidden_layers=num_layers, num_experts_per_tok=top_k))
