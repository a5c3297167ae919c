"""Public span-attention API, drop-in for the ``superlinear`` 0.1.0 span API.

Argument names, order and defaults follow the original, except ``block_k``, whose default is
``None`` (the library chooses; an int forces it). ``span_len_factor`` is accepted and checked but
no longer bounds anything: spans of any length are computed exactly. Extra keyword-only
arguments: ``validate`` (run the checks that read tensor values, see ``validation``).

Out-of-range values are clamped where the result stays exact, never rejected: a cache position
past the keys (even past int32) acts as Lkv - 1 (SPEC: pos = min(cache_position, Lkv - 1)); a
window longer than the keys covers them all, span lengths stop at the keys and topk stops at the
number of stripes (extra slots would always be empty; ``SpanSettings.checked``).

Empty inputs (B = 0 or Lq = 0) give an empty result connected to the inputs in autograd, as torch
ops do. Decode has no backward kernel: when a gradient is required it runs the differentiable
reference variant (``torch_ops.staged_decode_differentiable``) instead of returning a detached
result.
"""

from __future__ import annotations

import torch

from . import geometry, torch_ops, validation
from .launch import check_block_k
from .settings import SpanSettings
from .validation import requires_grad

FORCE_MODES = (None, "sdpa", "span")


def clamped_positions(cache_position: torch.Tensor, key_length: int) -> torch.Tensor:
    """cache_position clamped to [-1, Lkv - 1] (the same attention, semantics section 2), so that the
    kernels' int32 cast never wraps a position past int32 and every kernel reads the position it
    attends from (int32 input too; the kernels clamp again)."""
    return cache_position.clamp(-1, key_length - 1)


def empty_result(shape: tuple[int, ...], like: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """An empty result of ``shape`` (like ``like``) connected to ``inputs`` in autograd, as torch ops
    return for empty inputs: its backward gives every input a zero gradient."""
    out = like.new_empty(shape)
    if not requires_grad(*inputs):
        return out
    return out + sum(t.sum() * 0 for t in inputs)


def _checked_block_k(block_k: int | None) -> int:
    """block_k as the ops take it: 0 lets the dispatcher choose."""
    if block_k is None:
        return 0
    return check_block_k(block_k)


def fused_span_attention_gqa(
    Q2: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    qstart: torch.Tensor,
    qend: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    sw_index: int = 0,
    block_k: int | None = None,
    span_len_factor: float = 2.0,
    span_power: float = 0.5,
    search_power: float | None = None,
    inv_search_power_int: int | None = 2,
    *,
    validate: bool | None = None,
) -> torch.Tensor:
    """Span attention for GQA or MHA: per-span outputs [B, Hq, Lq, K, D] (semantics section 2).

    Q2 [B, Hq, Lq, D]; K, V [B, Hkv, Lkv, D] with Hq % Hkv == 0; qstart/qend [B, Hq, Lq, K]
    inclusive (-1 marks an unused slot); cache_position [Lq]; attention_mask [B, >= Lkv].
    Differentiable in Q2, K and V.
    """
    validation.check_span_inputs(Q2, K, V, qstart, qend, cache_position, attention_mask)
    geometry.check_factor("span_len_factor", span_len_factor, allow_zero=False)
    geometry.check_span_power(span_power)
    sw_index = geometry.check_non_negative_int("sw_index", sw_index)
    params = geometry.power_params(search_power=search_power, inv_search_power_int=inv_search_power_int)
    geometry.check_window_bound(sw_index, params)
    block_k = _checked_block_k(block_k)
    if validation.validation_requested(validate):
        window = geometry.window_len_from_sw_index(
            sw_index, search_power=search_power, inv_search_power_int=inv_search_power_int
        )
        validation.check_span_contract(qstart, qend, cache_position, K.shape[2], window)
    if Q2.numel() == 0 or qstart.shape[-1] == 0:
        return empty_result((*qstart.shape, Q2.shape[-1]), Q2, Q2, K, V)
    out, _ = torch_ops.run(
        torch_ops.span_forward, Q2, K, V, qstart, qend, clamped_positions(cache_position, K.shape[2]), attention_mask, sw_index, search_power,
        inv_search_power_int, block_k,
    )
    return out


def fused_span_attention(
    Q2: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    qstart: torch.Tensor,
    qend: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    sw_index: int = 0,
    block_k: int | None = None,
    span_len_factor: float = 2.0,
    *,
    span_power: float = 0.5,
    search_power: float | None = None,
    inv_search_power_int: int | None = 2,
    validate: bool | None = None,
) -> torch.Tensor:
    """Span attention with the MHA signature of the original (same op as the GQA entry point)."""
    return fused_span_attention_gqa(
        Q2, K, V, qstart, qend, cache_position, attention_mask, sw_index, block_k, span_len_factor,
        span_power, search_power, inv_search_power_int, validate=validate,
    )


def decode_span_attention_staged_gqa(
    Q1: torch.Tensor,
    Q2: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    sw_index: int = 0,
    topk: int = 3,
    enable_gqa: bool = True,
    block_k: int | None = None,
    backward_factor: float = 2.0,
    forward_factor: float = 0.0,
    span_power: float = 0.5,
    search_power: float | None = None,
    inv_search_power_int: int | None = 2,
    force_mode: str | None = None,
    *,
    validate: bool | None = None,
) -> torch.Tensor:
    """Staged decode [B, Hq, 1, D] (semantics section 3); CUDA-graph safe, no host synchronisation.

    Q1 is the search query, Q2 the attention query, both [B, Hq, 1, D]; K, V [B, Hkv, Lkv, D]
    may be a static cache larger than the filled prefix; the last cache_position entry is the
    decode position. ``enable_gqa`` is accepted for compatibility (GQA always works).
    ``force_mode="sdpa"`` returns plain attention over keys [0, pos]; ``"span"`` and ``None``
    return the staged result (which already equals plain attention when t <= W).
    """
    validation.check_decode_inputs(Q1, Q2, K, V, cache_position, attention_mask, topk)
    if force_mode not in FORCE_MODES:
        raise ValueError(f"force_mode must be one of {FORCE_MODES}, got {force_mode!r}")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    settings = SpanSettings.checked(
        K.shape[2], sw_index, topk, backward_factor, forward_factor, span_power, search_power, inv_search_power_int
    )
    block_k = _checked_block_k(block_k)
    if validation.validation_requested(validate) and bool((cache_position < 0).any()):
        raise ValueError("cache_position must be >= 0")
    if Q2.shape[0] == 0:
        return empty_result(Q2.shape, Q2, Q1, Q2, K, V)
    if force_mode == "sdpa":
        # Plain attention over keys [0, pos]: one span covering them, no window.
        batch, hq = Q2.shape[:2]
        last = clamped_positions(cache_position[-1:].to(torch.int64), K.shape[2])
        qend = last.view(1, 1, 1, 1).expand(batch, hq, 1, 1)
        out, _ = torch_ops.run(
            torch_ops.span_forward, Q2, K, V, torch.zeros_like(qend), qend, last, attention_mask, 0, None, 2, block_k
        )
        return out[:, :, :, 0]
    if requires_grad(Q1, Q2, K, V):
        return torch_ops.staged_decode_differentiable(Q1, Q2, K, V, cache_position, attention_mask, settings)
    return torch_ops.run(torch_ops.staged_decode, Q1, Q2, K, V, cache_position, attention_mask,
                         *settings.op_arguments(), block_k)


def decode_span_attention_staged(
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
    *,
    span_power: float = 0.5,
    search_power: float | None = None,
    inv_search_power_int: int | None = 2,
    block_k: int | None = None,
    validate: bool | None = None,
) -> torch.Tensor:
    """Staged decode with the MHA signature of the original (same op as the GQA entry point)."""
    return decode_span_attention_staged_gqa(
        Q1, Q2, K, V, cache_position, attention_mask, sw_index, topk, True, block_k,
        backward_factor, forward_factor, span_power, search_power, inv_search_power_int,
        validate=validate,
    )


span_attention = fused_span_attention
span_attention_gqa = fused_span_attention_gqa
decode_span_attention = decode_span_attention_staged
decode_span_attention_gqa = decode_span_attention_staged_gqa
