"""SGLang 0.5's routed-experts capturer on routing_replay (docs/engines.md, "SGLang 0.5").

:class:`RoutedExpertsCapturer` has SGLang's constructor and calls and returns SGLang's outputs,
stored at KV slots in a pinned pool of the narrowest index type; :mod:`routing_replay.sglang.install`
puts it into an SGLang server (``python -m routing_replay.sglang.launch_server <server args>``).
"""

from .capturer import (
    RoutedExpertsCapturer,
    TopkCaptureOutput,
    destroy_global_experts_capturer,
    disable_routed_experts_capture_for_draft,
    extract_routed_experts_from_meta_info,
    get_global_experts_capturer,
    index_type_for,
    set_global_experts_capturer,
)

__all__ = [
    "RoutedExpertsCapturer",
    "TopkCaptureOutput",
    "destroy_global_experts_capturer",
    "disable_routed_experts_capture_for_draft",
    "extract_routed_experts_from_meta_info",
    "get_global_experts_capturer",
    "index_type_for",
    "set_global_experts_capturer",
]
