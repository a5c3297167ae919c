"""Public whole-layer API (semantics section 4): what model code calls for prefill chunks and training.

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

from . import torch_ops, validation
from .api import clamped_positions, empty_result
from .ops.layer.composition import attention_layer
from .settings import SpanSettings


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
    """The whole attention layer: O [B, Hq, Lq, D] in Q2's dtype (semantics section 4).

    Q1 (search and gate query) and Q2 (attention query) [B, Hq, Lq, D]; K, V [B, Hkv, Lkv, D];
    cache_position [Lq] (absolute position of each query, Lkv >= pos + 1); attention_mask
    [B, >= Lkv] (nonzero: the key may be attended; left padding allowed). Differentiable in Q1
    (through the gate), Q2, K and V. ``validate`` also runs the checks that read tensor values.
    """
    validation.check_layer_inputs(Q1, Q2, K, V, cache_position, attention_mask, topk)
    settings = SpanSettings.checked(
        K.shape[2], sw_index, topk, backward_factor, forward_factor, span_power, search_power, inv_search_power_int
    )
    if validation.validation_requested(validate) and bool((cache_position < 0).any()):
        raise ValueError("cache_position must be >= 0")
    if Q2.numel() == 0:
        return empty_result(Q2.shape, Q2, Q1, Q2, K, V)
    # int32, the kernels' index type, once: the spans and span attention below take it unclamped
    positions = clamped_positions(cache_position, K.shape[2]).to(torch.int32)
    anchors, scores = torch_ops.run(torch_ops.layer_search, Q1, K, positions, attention_mask, *settings.op_arguments())
    power = settings.params.arguments

    def span_attention(qstart: torch.Tensor, qend: torch.Tensor) -> torch.Tensor:
        return torch_ops.run(
            torch_ops.span_forward, Q2, K, V, qstart, qend, positions, attention_mask, settings.sw_index, power["search_power"],
            power["inv_search_power_int"], 0,
        )[0]

    return attention_layer(Q1, K, anchors, positions, attention_mask, settings, span_attention, Q2.dtype,
                           torch_ops.LAYER_STEPS, search_scores=scores)


def _slots(num_spans: int, topk: int | None) -> int:
    """The alias's slot count: ``topk`` when given, else ``num_spans``, checked under the name the caller used."""
    name, value = ("num_spans", num_spans) if topk is None else ("topk", topk)
    return validation.check_topk(value, name)


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
        Q1, Q2, K, V, cache_position, attention_mask, sw_index, _slots(num_spans, topk),
        backward_factor, forward_factor, span_power, search_power, inv_search_power_int,
    )


prefill_mha = prefill


def check_key_positions(key_cache_position: torch.Tensor | None, key_length: int, batch: int) -> None:
    """The original's ``key_cache_position`` ([Lkv] or [B, Lkv], the position of each key, which its
    window selects keys by): None or the identity (key i at position i), which is what this library
    computes; ValueError for anything else. A tensor is compared on the host (one device sync: pass
    None inside a captured CUDA graph)."""
    if key_cache_position is None:
        return
    if not isinstance(key_cache_position, torch.Tensor):
        raise TypeError(f"key_cache_position must be a torch.Tensor or None, got {type(key_cache_position).__name__}")
    if key_cache_position.shape not in ((key_length,), (batch, key_length)):
        raise ValueError(
            f"key_cache_position must be [Lkv={key_length}] or [B={batch}, Lkv={key_length}], got {tuple(key_cache_position.shape)}"
        )
    identity = torch.arange(key_length, device=key_cache_position.device)
    if not bool((key_cache_position == identity).all()):
        raise ValueError(
            "key_cache_position other than the identity (key i at position i) is not supported: this library "
            "takes a key's position to be its index; pass None, or lay the cache out so that key i holds position i"
        )


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
    key_cache_position: torch.Tensor | None = None,
    sw_block_k: int = 64,
    sw_block_m_dense: int = 16,
    sw_num_warps: int = 4,
    sw_num_stages: int = 2,
    span_block_k: int = 64,
    span_block_p: int = 64,
    span_num_warps: int = 4,
    span_num_stages: int = 3,
    use_bf16_pv: bool = True,
) -> torch.Tensor:
    """The original's fused prefill signatures (its api module's and, keyword-only, its ``_prefill``
    module's): positions as ``cache_pos`` or ``cache_position`` (which wins when both are given);
    ``topk`` overrides ``num_spans``; ``key_cache_position`` must be None or the identity
    (``check_key_positions``); the tile hints (``block_k``, ``search_block_q``, ``sw_*``,
    ``span_block_*``, ``span_num_*``, ``use_bf16_pv``) are accepted and ignored."""
    position = cache_position if cache_position is not None else cache_pos
    if position is None:
        raise TypeError("missing the query positions: give 'cache_pos' or 'cache_position' (a [Lq] int tensor)")
    if isinstance(K, torch.Tensor) and K.dim() == 4:
        check_key_positions(key_cache_position, K.shape[2], K.shape[0])
    return prefill(
        Q1, Q2, K, V, position, attention_mask, sw_index, num_spans, block_k, search_block_q, backward_factor,
        forward_factor, span_power, search_power, inv_search_power_int, topk=topk,
    )


prefill_gqa = fused_prefill_with_swtriton_gqa
fused_prefill_with_swtriton = fused_prefill_with_swtriton_gqa
fused_prefill_with_swtriton_bucketed_gqa = fused_prefill_with_swtriton_gqa
