"""The steps of the whole layer after the search (SPEC section 7): spans from the anchors (step 2;
on a GPU one launch of ``spans_kernel``) and the gate scores and gate with their backwards
(step 4); ``composition`` puts them together with the span attention as custom ops.

Each gate step is an op of the registry (``gate_ops``: gate scores, the gate, and their backwards)
with two launchers here, the Triton kernels (``gate_kernel``) and the PyTorch path (the reference:
CPU and float64); ``variants.py`` declares them. The step functions run the dispatcher's choice for
the call's problem (its op spec's ``problem_of``), or an explicit (variant, configuration).
"""

from __future__ import annotations

import torch

from ... import dispatch, geometry
from ...launch import KernelConfig
from ...registry import REGISTRY, Variant
from ...settings import SpanSettings
from ..gate.names import EMPTY_SCORE, GATE, GATE_BACKWARD, GATE_SCORES, GATE_SCORES_BACKWARD

Chosen = tuple[Variant, KernelConfig]  # an explicit choice: a gate op's variant and its configuration


def spans_of_anchors(
    anchors: torch.Tensor,
    cache_position: torch.Tensor,
    key_length: int,
    attention_mask: torch.Tensor | None,
    settings: SpanSettings,
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


def anchor_spans(
    anchors: torch.Tensor,
    cache_position: torch.Tensor,
    key_length: int,
    attention_mask: torch.Tensor | None,
    settings: SpanSettings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``spans_of_anchors``'s (qstart, qend) as int32 (the span kernels' index type): one Triton
    launch on a GPU (``spans_kernel``), its tensor ops elsewhere (CPU, where they are the faster path)."""
    if anchors.device.type == "cuda":
        from .spans_kernel import spans_by_kernel  # imports Triton on first use only

        return spans_by_kernel(anchors, cache_position, key_length, attention_mask, settings)
    qstart, qend = spans_of_anchors(anchors, cache_position, key_length, attention_mask, settings)
    return qstart.to(torch.int32), qend.to(torch.int32)


def _key_rows(k: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K as rows [B * Hkv * Lkv, D], each slot's row index [B, Hq, Lq, topk]; an empty slot's is its
    group's first row)."""
    batch, hq, lq, slots = anchors.shape
    hkv, lkv = k.shape[1], k.shape[2]
    rows = torch.arange(batch * hkv, device=k.device).view(batch, hkv, 1, 1, 1) * lkv
    rows = rows.expand(batch, hkv, hq // hkv, lq, slots).reshape(batch, hq, lq, slots) + anchors.clamp(min=0)
    return k.reshape(batch * hkv * lkv, -1), rows


# --- launchers (the registry's signatures; variants.py declares them) ---------------------------


def triton_gate_scores(q1: torch.Tensor, k: torch.Tensor, anchors: torch.Tensor, config: KernelConfig) -> torch.Tensor:
    """The Triton gate scores, ``config.block_r`` rows per program."""
    from ..gate.kernels import gate_scores_forward  # imports Triton on first use only

    return gate_scores_forward(q1, k, anchors, config)


def torch_gate_scores(q1: torch.Tensor, k: torch.Tensor, anchors: torch.Tensor, config: KernelConfig) -> torch.Tensor:
    """The PyTorch gate scores (nothing to configure): a gather of the anchors' key rows."""
    k_rows, rows = _key_rows(k, anchors)
    keys = k_rows.index_select(0, rows.reshape(-1)).view(*rows.shape, -1)  # [B, Hq, Lq, topk, D]
    cdt = torch.float64 if q1.dtype == torch.float64 else torch.float32
    scores = (keys.to(cdt) * q1.to(cdt)[..., None, :]).sum(dim=-1)
    return torch.where(anchors >= 0, scores, torch.full_like(scores, EMPTY_SCORE))


def triton_gate_scores_backward(q1: torch.Tensor, k: torch.Tensor, anchors: torch.Tensor, grad: torch.Tensor,
                                config: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton gate-score backward (dK by fp32 atomics)."""
    from ..gate.kernels import gate_scores_backward

    return gate_scores_backward(q1, k, anchors, grad, config)


def torch_gate_scores_backward(q1: torch.Tensor, k: torch.Tensor, anchors: torch.Tensor, grad: torch.Tensor,
                               config: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch gate-score backward (dK by index_add)."""
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


def triton_gate(scores: torch.Tensor, span_out: torch.Tensor, dtype: torch.dtype, config: KernelConfig) -> torch.Tensor:
    """The Triton gate, ``config.block_r`` rows per program."""
    from ..gate.kernels import gate_forward

    return gate_forward(scores, span_out, dtype, config)


def torch_gate(scores: torch.Tensor, span_out: torch.Tensor, dtype: torch.dtype, config: KernelConfig) -> torch.Tensor:
    """The PyTorch gate (nothing to configure)."""
    gate = torch.softmax(scores, dim=-1)
    return (gate[..., None] * span_out.to(gate.dtype)).sum(dim=3).to(dtype)


def triton_gate_backward(scores: torch.Tensor, span_out: torch.Tensor, grad: torch.Tensor,
                         config: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton gate backward."""
    from ..gate.kernels import gate_backward

    return gate_backward(scores, span_out, grad, config)


def torch_gate_backward(scores: torch.Tensor, span_out: torch.Tensor, grad: torch.Tensor,
                        config: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch gate backward."""
    gate = torch.softmax(scores, dim=-1)
    grad = grad.to(gate.dtype)
    s = (grad[..., None, :] * span_out.to(gate.dtype)).sum(dim=-1)
    d_scores = gate * (s - (gate * s).sum(dim=-1, keepdim=True))
    return d_scores.to(scores.dtype), (gate[..., None] * grad[..., None, :]).to(span_out.dtype)


# --- the gate steps: the dispatcher's choice, or an explicit one ---------------------------------


def _chosen(op: str, choice: Chosen | None, *call: torch.Tensor) -> Chosen:
    """``choice`` when given, else the dispatcher's for the problem of ``op``'s call on ``call``
    (memoised per key: no host synchronisation, safe during CUDA graph capture)."""
    if choice is not None:
        return choice
    selected = dispatch.select(REGISTRY.spec(op).problem_of(*call))
    return selected.variant, selected.config


def gate_scores_forward(q1: torch.Tensor, k: torch.Tensor, anchors: torch.Tensor, choice: Chosen | None = None) -> torch.Tensor:
    """v_j = Q1[b, h, q] . K[b, kv(h), anchor_j] [B, Hq, Lq, topk], fp32 (float64 for float64 inputs),
    EMPTY_SCORE where the anchor is -1."""
    variant, config = _chosen(GATE_SCORES, choice, q1, k, anchors)
    return variant.launch(q1, k, anchors, config)


def gate_scores_backward(q1: torch.Tensor, k: torch.Tensor, anchors: torch.Tensor, grad: torch.Tensor,
                         choice: Chosen | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dQ1, dK) of ``gate_scores_forward`` for ``grad`` [B, Hq, Lq, topk]: dQ1 = sum_j dv_j K[anchor_j]
    and dK[anchor_j] += dv_j Q1 (many slots share a row); empty slots pass no gradient."""
    variant, config = _chosen(GATE_SCORES_BACKWARD, choice, q1, k, anchors)
    return variant.launch(q1, k, anchors, grad, config)


def gate_forward(scores: torch.Tensor, span_out: torch.Tensor, dtype: torch.dtype, choice: Chosen | None = None) -> torch.Tensor:
    """O = sum_j softmax(scores)_j O_j [B, Hq, Lq, D] in ``dtype`` (step 4) for scores [B, Hq, Lq, topk]
    and span outputs [B, Hq, Lq, topk, D]."""
    variant, config = _chosen(GATE, choice, scores, span_out)
    return variant.launch(scores, span_out, dtype, config)


def gate_backward(scores: torch.Tensor, span_out: torch.Tensor, grad: torch.Tensor,
                  choice: Chosen | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(d scores, d span outputs) of ``gate_forward`` for ``grad`` [B, Hq, Lq, D]: dO_j = g_j grad and
    dv_j = g_j (s_j - sum_k g_k s_k) with s_j = grad . O_j."""
    variant, config = _chosen(GATE_BACKWARD, choice, scores, span_out)
    return variant.launch(scores, span_out, grad, config)
