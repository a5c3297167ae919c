"""superlinear-ops: fast, checked Superlinear span attention for NVIDIA GPUs (and CPU).

The public functions are drop-in replacements for the ``superlinear`` 0.1.0 span and decode API
(``api``) and its whole-layer prefill API (``layer_api``: ``superlinear_attention`` and the original
names); ``patch_superlinear()`` points an installed original package at them.

``SUPERLINEAR_OPS_PLUGINS`` (comma-separated module names) adds variants and ops of one's own: each
module is imported once the library's are registered, and its ``VARIANTS`` (and ``OPS``) declared
(``ops.register_plugin``); worker and sanitizer processes inherit the variable.
"""

import importlib
import os

from .api import (
    decode_span_attention,
    decode_span_attention_gqa,
    decode_span_attention_staged,
    decode_span_attention_staged_gqa,
    fused_span_attention,
    fused_span_attention_gqa,
    span_attention,
    span_attention_gqa,
)
from .cache.layers import use_cache
from .dispatch import explain, select
from .geometry import compute_qend_from_qanchor, max_stripe_index_for_token_pos, window_len_from_sw_index
from .layer_api import (
    fused_prefill_with_swtriton,
    fused_prefill_with_swtriton_bucketed_gqa,
    fused_prefill_with_swtriton_gqa,
    prefill,
    prefill_gqa,
    prefill_mha,
    superlinear_attention,
)
from .ops import register_builtin, register_plugin
from .patch import patch_superlinear, unpatch_superlinear
from .precompile import warmup
from .problem import Problem
from .registry import REGISTRY
from .version import __version__ as __version__

register_builtin(REGISTRY)  # the library's ops and variants
for _plugin in filter(None, (name.strip() for name in os.environ.get("SUPERLINEAR_OPS_PLUGINS", "").split(","))):
    try:
        _module = importlib.import_module(_plugin)
    except ImportError as err:
        raise ImportError(f"SUPERLINEAR_OPS_PLUGINS names {_plugin!r}, which cannot be imported: {err}") from err
    register_plugin(REGISTRY, _module)
use_cache()  # explicit cache (SUPERLINEAR_OPS_CACHE) > user store > shipped files > defaults

__all__ = [
    "Problem",
    "explain",
    "select",
    "use_cache",
    "warmup",
    "compute_qend_from_qanchor",
    "decode_span_attention",
    "decode_span_attention_gqa",
    "decode_span_attention_staged",
    "decode_span_attention_staged_gqa",
    "fused_span_attention",
    "fused_prefill_with_swtriton",
    "fused_prefill_with_swtriton_bucketed_gqa",
    "fused_prefill_with_swtriton_gqa",
    "fused_span_attention_gqa",
    "max_stripe_index_for_token_pos",
    "patch_superlinear",
    "prefill",
    "prefill_gqa",
    "prefill_mha",
    "span_attention",
    "span_attention_gqa",
    "superlinear_attention",
    "unpatch_superlinear",
    "window_len_from_sw_index",
]
