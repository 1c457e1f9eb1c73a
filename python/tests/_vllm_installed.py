"""The vLLM peer over the installed vLLM 0.33's own classes: the same names as the stubbed peer
(``vllm_0_33_routed_experts.py``, see ``_peers``), each one vLLM's own object, so that the
differential and upstream-restated tests run against the engine as released where it is installed.

What vLLM's model runner would have set up, and is set up here instead, once per process:

- the distributed state: one rank, vLLM's own ``init_distributed_environment`` and
  ``ensure_model_parallel_initialized`` over gloo (a file rendezvous in a temporary folder), so
  that ``get_tp_group()`` is vLLM's tensor-parallel group of one;
- the platform: where vLLM finds none (a machine without a GPU: ``UnspecifiedPlatform``, whose
  device type is empty) the capturer module's ``current_platform`` is given device type "cpu" (its
  buffer would otherwise be allocated on device ""); on a GPU machine vLLM's own platform stays;
- the forward context: the tests call ``capture`` as the MoE layers do, but outside a model
  forward, so the context of an eager one-rank forward (no DP metadata, no batch descriptor: the
  capturer takes the rows as given) is held for the process with vLLM's
  ``override_forward_context``.

``make_worker_connector`` builds vLLM's ``AuxOutputWorkerConnector`` as the model runner does
(``vllm_config``, ``model``, ``kv_cache_config``), with vLLM's own ``SchedulerConfig``,
``CacheConfig``, ``ParallelConfig``, ``AuxOutputConfig``, ``KVCacheConfig`` and
``FullAttentionSpec``; the model is a module tree of capture sources, one per layer, which vLLM's
``bind_routed_experts_capturer`` binds (``RoutedExpertsCaptureSource``). Only the model config is a
stand-in (the three counts and the model type the capturer reads): a real ``ModelConfig`` loads a
Hugging Face config, which ``test_vllm_scheduler.py`` does for its single engine.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

import vllm
import vllm.model_executor.layers.fused_moe.routed_experts_capturer as _capturer_module
from vllm.config import CacheConfig, DeviceConfig, ParallelConfig, SchedulerConfig, VllmConfig, set_current_vllm_config
from vllm.config.aux_output import AuxOutputConfig
from vllm.distributed import parallel_state
from vllm.distributed.aux_output_connector.connector import (  # noqa: F401  (the peer's names)
    AuxOutputConnectorMetadata,
    AuxOutputSchedulerConnector,
    AuxRequestOutput,
    PackedBlockHashes,
)
from vllm.distributed.aux_output_connector.store import BlockObjectStoreError  # noqa: F401
from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector
from vllm.forward_context import ForwardContext, override_forward_context
from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCapturer  # noqa: F401
from vllm.platforms import current_platform as _vllm_platform
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

VERSION = vllm.__version__
LOCATION = str(Path(vllm.__file__).parent)
if not VERSION.startswith("0.33."):
    raise ImportError(f"the installed vLLM is {VERSION} at {LOCATION}; these tests restate 0.33")

#: The device type vLLM's capturer allocates on: vLLM's platform's, or "cpu" where it has none.
if _vllm_platform.device_type:
    current_platform = _vllm_platform
else:
    current_platform = SimpleNamespace(device_type="cpu")
    _capturer_module.current_platform = current_platform


def device_config() -> DeviceConfig:
    """vLLM's device config for this machine ("cpu" where vLLM finds no platform)."""
    return DeviceConfig(device="auto" if _vllm_platform.device_type else "cpu")


def init_one_rank() -> None:
    """vLLM's distributed state for one process (what its worker sets up before the model runner)."""
    if parallel_state.model_parallel_is_initialized():
        return
    rendezvous = Path(tempfile.mkdtemp(prefix="routing_replay_vllm_")) / "rendezvous"
    parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                distributed_init_method=f"file://{rendezvous}")
    with set_current_vllm_config(VllmConfig(device_config=device_config())):
        parallel_state.ensure_model_parallel_initialized(1, 1)


init_one_rank()

# an eager forward on one rank, entered for good (see above)
_FORWARD = override_forward_context(ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={}))
_FORWARD.__enter__()


class _CaptureSource(torch.nn.Module):
    """One MoE layer as vLLM's binder sees a capture source (``layer_id``, ``capture_fn``)."""

    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.capture_fn = None


def capture_model(num_layers: int) -> torch.nn.Module:
    """A model whose MoE layers are capture sources, for ``bind_routed_experts_capturer``."""
    return torch.nn.Sequential(*(_CaptureSource(layer) for layer in range(num_layers)))


def kv_cache_config(block_size: int, num_blocks: int) -> KVCacheConfig:
    """vLLM's KV cache config of one full-attention group."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn"], spec)])


def make_vllm_config(num_layers, num_experts, top_k, max_num_batched_tokens, max_num_seqs, *, block_size=16,
                     max_concurrent_batches=2, max_bytes=None):
    """The VllmConfig the worker connector and the capturer read: vLLM's own sub-configs, and its
    own ``max_concurrent_batches`` (2 under asynchronous scheduling, 1 without), with a model config
    stand-in carrying the counts."""
    if max_concurrent_batches not in (1, 2):
        raise ValueError(f"vLLM 0.33 runs 1 or 2 batches concurrently with one pipeline stage, not "
                         f"{max_concurrent_batches}")
    model = SimpleNamespace(get_total_num_hidden_layers=lambda: num_layers, get_num_experts=lambda: num_experts,
                            get_num_experts_per_tok=lambda: top_k, max_model_len=1 << 20,
                            hf_text_config=SimpleNamespace(model_type="routing_replay_tests"))
    # vLLM's engine refuses fewer batched tokens than sequences; some traces have that shape (the
    # connector only sizes its buffer and store queue by the two), so it is set past validation
    scheduler = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                max_num_seqs=min(max_num_seqs, max_num_batched_tokens), max_model_len=1 << 20,
                                is_encoder_decoder=False, async_scheduling=max_concurrent_batches > 1)
    scheduler.max_num_seqs = max_num_seqs
    config = SimpleNamespace(
        model_config=model, parallel_config=ParallelConfig(), cache_config=CacheConfig(block_size=block_size),
        scheduler_config=scheduler,
        aux_output_config=AuxOutputConfig(enable_return_routed_experts=True, max_bytes=max_bytes),
        use_v2_model_runner=True)
    config.max_concurrent_batches = VllmConfig.max_concurrent_batches.fget(config)
    assert config.max_concurrent_batches == max_concurrent_batches
    return config


def make_worker_connector(num_layers, num_experts, top_k, max_num_batched_tokens, max_num_seqs, *,
                          block_size=16, num_kv_blocks=65536, max_concurrent_batches=2, max_bytes=None):
    """vLLM's ``AuxOutputWorkerConnector``, built as its model runner builds it."""
    config = make_vllm_config(num_layers, num_experts, top_k, max_num_batched_tokens, max_num_seqs,
                              block_size=block_size, max_concurrent_batches=max_concurrent_batches,
                              max_bytes=max_bytes)
    return AuxOutputWorkerConnector(vllm_config=config, model=capture_model(num_layers),
                                    kv_cache_config=kv_cache_config(block_size, num_kv_blocks))


def pack_hashes(hashes):
    """PackedBlockHashes from a list of equal-length bytes."""
    return PackedBlockHashes(b"".join(hashes), len(hashes[0])) if hashes else None
