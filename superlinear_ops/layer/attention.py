"""Steps 2-5 of the whole layer around any search: spans from the anchors, span + window attention,
and the gate (SPEC section 7).

Differentiable in Q1 (through the gate scores), Q2, K and V: the anchors carry no gradient, the
span attention's gradient comes from its own op, the gate scores v_j = Q1 . K[anchor_j] are
recomputed here (``gate_scores``, with a hand-written backward) and the gate has its own backward
(``gate_backward``). The short-prefix rule needs nothing extra: when t <= W no stripe precedes the
window, every slot is empty, every O_j is the causal attention over [0, pos] and the uniform gate
returns it. No host synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import geometry
from ..decode.settings import DecodeSettings
from ..kernels.launch import unit_stride
from ..problem import device_identity

EMPTY_SCORE = -1e9  # the gate score of an empty slot (SPEC section 7, step 4)

# span_attention(qstart, qend) -> per-span outputs [B, Hq, Lq, K, D] (window included in each)
SpanAttention = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def spans_of_anchors(
    anchors: torch.Tensor,
    cache_position: torch.Tensor,
    key_length: int,
    attention_mask: torch.Tensor | None,
    settings: DecodeSettings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(qstart, qend) [B, Hq, Lq, topk] of the anchors (step 2): -1 where the anchor is -1."""
    qstart = geometry.span_starts(
        anchors, cache_position, key_length, attention_mask, settings.backward_factor, settings.span_power
    )
    qend = geometry.span_ends(
        anchors, cache_position, key_length, settings.window_for(key_length), attention_mask,
        settings.forward_factor, settings.span_power,
    )
    return qstart, qend.to(torch.int64, copy=True)  # a copy: with ff = 0 qend is the anchors themselves


def _key_rows(k: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K as rows [B * Hkv * Lkv, D], each slot's row index [B, Hq, Lq, topk]; an empty slot's is its
    group's first row)."""
    batch, hq, lq, slots = anchors.shape
    hkv, lkv = k.shape[1], k.shape[2]
    rows = torch.arange(batch * hkv, device=k.device).view(batch, hkv, 1, 1, 1) * lkv
    rows = rows.expand(batch, hkv, hq // hkv, lq, slots).reshape(batch, hq, lq, slots) + anchors.clamp(min=0)
    return k.reshape(batch * hkv * lkv, -1), rows


def _triton_serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton gate kernels serve: 16- or 32-bit data where Triton kernels run (a GPU, or
    the interpreter); PyTorch serves the CPU reference and float64."""
    identity = device_identity(device)
    return dtype != torch.float64 and (identity.is_gpu or identity.interpreter)


def gate_scores_forward(q1: torch.Tensor, k: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """v_j = Q1[b, h, q] . K[b, kv(h), anchor_j] [B, Hq, Lq, topk], fp32 (float64 for float64 inputs),
    EMPTY_SCORE where the anchor is -1."""
    if _triton_serves(q1.device, q1.dtype):
        from .gate_kernel import gate_scores_forward as kernel  # imports Triton on first use only

        return kernel(unit_stride(q1), unit_stride(k), anchors.contiguous())
    k_rows, rows = _key_rows(k, anchors)
    keys = k_rows.index_select(0, rows.reshape(-1)).view(*rows.shape, -1)  # [B, Hq, Lq, topk, D]
    cdt = torch.float64 if q1.dtype == torch.float64 else torch.float32
    scores = (keys.to(cdt) * q1.to(cdt)[..., None, :]).sum(dim=-1)
    return torch.where(anchors >= 0, scores, torch.full_like(scores, EMPTY_SCORE))


def gate_scores_backward(q1: torch.Tensor, k: torch.Tensor, anchors: torch.Tensor, grad: torch.Tensor):
    """(dQ1, dK) of ``gate_scores_forward`` for ``grad`` [B, Hq, Lq, topk]: dQ1 = sum_j dv_j K[anchor_j]
    and dK[anchor_j] += dv_j Q1 (fp32 atomics or index_add: many slots share a row)."""
    if _triton_serves(q1.device, q1.dtype):
        from .gate_kernel import gate_scores_backward as kernel

        return kernel(unit_stride(q1), unit_stride(k), anchors.contiguous(), grad.to(torch.float32).contiguous())
    k_rows, rows = _key_rows(k, anchors)
    used = (anchors >= 0)[..., None]
    # An empty slot's score is a constant: it passes no gradient, and reads neither its stand-in key
    # row nor Q1 (a zero gradient times a NaN there would still be NaN). The kernel masks the same.
    keys = k_rows.index_select(0, rows.reshape(-1)).view(*rows.shape, -1).to(grad.dtype)
    d_q1 = torch.where(used, grad[..., None] * keys, 0.0).sum(dim=-2).to(q1.dtype)
    d_k = torch.zeros(k_rows.shape, dtype=grad.dtype, device=k.device)
    contributions = torch.where(used, grad[..., None] * q1.to(grad.dtype)[..., None, :], 0.0)
    d_k.index_add_(0, rows.reshape(-1), contributions.reshape(-1, k_rows.shape[1]))
    return d_q1, d_k.view(k.shape).to(k.dtype)


def gate_scores(q1: torch.Tensor, k: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """``gate_scores_forward`` as the custom op ``superlinear_ops::layer_gate_scores`` (``torch_ops``),
    differentiable in Q1 and K."""
    return torch.ops.superlinear_ops.layer_gate_scores(q1, k, anchors)


def gate_forward(scores: torch.Tensor, span_out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """O = sum_j softmax(scores)_j O_j [B, Hq, Lq, D] in ``dtype`` (step 4) for scores [B, Hq, Lq, topk]
    and span outputs [B, Hq, Lq, topk, D]: the Triton gate (``gate_kernel``) where it serves, PyTorch
    otherwise (the CPU and float64 path)."""
    if scores.dtype == torch.float32 and _triton_serves(span_out.device, span_out.dtype):
        from .gate_kernel import gate_forward as kernel  # imports Triton on first use only

        return kernel(scores.contiguous(), span_out.contiguous(), dtype)
    gate = torch.softmax(scores, dim=-1)
    return (gate[..., None] * span_out.to(gate.dtype)).sum(dim=3).to(dtype)


def gate_backward(scores: torch.Tensor, span_out: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d scores, d span outputs) of ``gate_forward`` for ``grad`` [B, Hq, Lq, D]: dO_j = g_j grad and
    dv_j = g_j (s_j - sum_k g_k s_k) with s_j = grad . O_j."""
    if scores.dtype == torch.float32 and _triton_serves(span_out.device, span_out.dtype):
        from .gate_kernel import gate_backward as kernel

        return kernel(scores.contiguous(), span_out.contiguous(), grad.contiguous())
    gate = torch.softmax(scores, dim=-1)
    grad = grad.to(gate.dtype)
    s = (grad[..., None, :] * span_out.to(gate.dtype)).sum(dim=-1)
    d_scores = gate * (s - (gate * s).sum(dim=-1, keepdim=True))
    return d_scores.to(scores.dtype), (gate[..., None] * grad[..., None, :]).to(span_out.dtype)


def attention_layer(
    q1: torch.Tensor,
    k: torch.Tensor,
    anchors: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    settings: DecodeSettings,
    span_attention: SpanAttention,
    dtype: torch.dtype,
) -> torch.Tensor:
    """O [B, Hq, Lq, D] in ``dtype`` from the search's anchors [B, Hq, Lq, topk] (steps 2-5). The
    spans and the gate run as the custom ops ``superlinear_ops::layer_spans`` and ``::layer_gate``
    (``torch_ops``), so that torch.compile traces the layer without entering the exact geometry."""
    power = settings.params.arguments
    qstart, qend = torch.ops.superlinear_ops.layer_spans(
        anchors, cache_position, attention_mask, k.shape[2], settings.sw_index, settings.backward_factor,
        settings.forward_factor, settings.span_power, power["search_power"], power["inv_search_power_int"],
    )
    span_out = span_attention(qstart, qend)  # [B, Hq, Lq, topk, D]
    return torch.ops.superlinear_ops.layer_gate(gate_scores(q1, k, anchors), span_out, dtype)
