"""Public whole-layer API (SPEC section 7): what model code calls for prefill chunks and training.

``superlinear_attention`` is the canonical function. The original ``superlinear`` 0.1.0 names and
signatures (``prefill``, ``prefill_gqa``, ``prefill_mha``, ``fused_prefill_with_swtriton``,
``fused_prefill_with_swtriton_gqa``, ``fused_prefill_with_swtriton_bucketed_gqa``) are drop-in
aliases; their tile arguments (``block_k``, ``search_block_q``) are hints this library ignores (the
dispatcher chooses). Any topk >= 1 and any cache_position (a chunk starting anywhere, a static
cache longer than the filled prefix) work; nothing synchronises with the host, so a prefill chunk
can be captured in a CUDA graph (run it once eagerly first: that builds the geometry tables).
"""

from __future__ import annotations

import torch

from . import geometry, torch_ops, validation
from .api import clamped_positions
from .decode.settings import DecodeSettings
from .layer.attention import attention_layer


def superlinear_attention(
    Q1: torch.Tensor,
    Q2: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    sw_index: int = 0,
    topk: int = 3,
    backward_factor: float = 2.0,
    forward_factor: float = 0.0,
    span_power: float = 0.5,
    search_power: float | None = None,
    inv_search_power_int: int | None = 2,
    *,
    validate: bool | None = None,
) -> torch.Tensor:
    """The whole attention layer: O [B, Hq, Lq, D] in Q2's dtype (SPEC section 7).

    Q1 (search and gate query) and Q2 (attention query) [B, Hq, Lq, D]; K, V [B, Hkv, Lkv, D];
    cache_position [Lq] (absolute position of each query, Lkv >= pos + 1); attention_mask
    [B, >= Lkv] (nonzero: the key may be attended; left padding allowed). Differentiable in Q1
    (through the gate), Q2, K and V. ``validate`` also runs the checks that read tensor values.
    """
    validation.check_layer_inputs(Q1, Q2, K, V, cache_position, attention_mask, topk)
    params = geometry.power_params(search_power=search_power, inv_search_power_int=inv_search_power_int)
    sw_index = geometry.check_non_negative_int("sw_index", sw_index)
    geometry.check_window_bound(sw_index, params)
    backward_factor = geometry.check_factor("backward_factor", backward_factor, allow_zero=True)
    forward_factor = geometry.check_factor("forward_factor", forward_factor, allow_zero=True)
    span_power = geometry.check_span_power(span_power)
    if validation.validation_requested(validate) and bool((cache_position < 0).any()):
        raise ValueError("cache_position must be >= 0")
    if Q2.numel() == 0:
        return torch.empty_like(Q2)
    positions = clamped_positions(cache_position, K.shape[2])
    anchors = torch_ops.layer_search(
        Q1, K, positions, attention_mask, sw_index, topk, backward_factor, forward_factor, span_power,
        search_power, inv_search_power_int,
    )
    settings = DecodeSettings(sw_index, topk, backward_factor, forward_factor, span_power, params)

    def span_attention(qstart: torch.Tensor, qend: torch.Tensor) -> torch.Tensor:
        return torch_ops.span_forward(
            Q2, K, V, qstart, qend, positions, attention_mask, sw_index, search_power, inv_search_power_int, 0
        )[0]

    return attention_layer(Q1, K, anchors, positions, attention_mask, settings, span_attention, Q2.dtype)


def prefill(
    Q1: torch.Tensor,
    Q2: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    sw_index: int = 0,
    num_spans: int = 3,
    block_k: int = 64,
    search_block_q: int = 128,
    backward_factor: float = 2.0,
    forward_factor: float = 0.0,
    span_power: float = 0.5,
    search_power: float | None = None,
    inv_search_power_int: int | None = 2,
    *,
    topk: int | None = None,
) -> torch.Tensor:
    """The original's preferred prefill name (MHA and GQA alike); ``topk`` overrides ``num_spans``."""
    return superlinear_attention(
        Q1, Q2, K, V, cache_position, attention_mask, sw_index, num_spans if topk is None else topk,
        backward_factor, forward_factor, span_power, search_power, inv_search_power_int,
    )


prefill_mha = prefill


def fused_prefill_with_swtriton_gqa(
    Q1: torch.Tensor,
    Q2: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    cache_pos: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    sw_index: int = 0,
    num_spans: int = 3,
    block_k: int = 64,
    search_block_q: int = 128,
    backward_factor: float = 2.0,
    forward_factor: float = 0.0,
    span_power: float = 0.5,
    search_power: float | None = None,
    inv_search_power_int: int | None = 2,
    *,
    cache_position: torch.Tensor | None = None,
    topk: int | None = None,
) -> torch.Tensor:
    """The original's fused prefill signature: positions as ``cache_pos`` or ``cache_position`` (which
    wins when both are given); ``topk`` overrides ``num_spans``."""
    position = cache_position if cache_position is not None else cache_pos
    if position is None:
        raise TypeError("missing the query positions: give 'cache_pos' or 'cache_position' (a [Lq] int tensor)")
    return prefill(
        Q1, Q2, K, V, position, attention_mask, sw_index, num_spans, block_k, search_block_q, backward_factor,
        forward_factor, span_power, search_power, inv_search_power_int, topk=topk,
    )


prefill_gqa = fused_prefill_with_swtriton_gqa
fused_prefill_with_swtriton = fused_prefill_with_swtriton_gqa
fused_prefill_with_swtriton_bucketed_gqa = fused_prefill_with_swtriton_gqa
