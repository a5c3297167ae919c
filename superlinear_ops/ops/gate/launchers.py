"""The gate ops' launchers: the Triton kernels (``kernels``) and the PyTorch paths (the reference:
CPU and float64), in the registry's signatures (``variants``)."""

from __future__ import annotations

import torch

from ...launch import KernelConfig
from . import EMPTY_SCORE


def _key_rows(k: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K as rows [B * Hkv * Lkv, D], each slot's row index [B, Hq, Lq, topk]; an empty slot's is its
    group's first row)."""
    batch, hq, lq, slots = anchors.shape
    hkv, lkv = k.shape[1], k.shape[2]
    rows = torch.arange(batch * hkv, device=k.device).view(batch, hkv, 1, 1, 1) * lkv
    rows = rows.expand(batch, hkv, hq // hkv, lq, slots).reshape(batch, hq, lq, slots) + anchors.clamp(min=0)
    return k.reshape(batch * hkv * lkv, -1), rows




def triton_gate_scores(q1: torch.Tensor, k: torch.Tensor, anchors: torch.Tensor, config: KernelConfig) -> torch.Tensor:
    """The Triton gate scores, ``config.block_r`` rows per program."""
    from .kernels import gate_scores_forward  # imports Triton on first use only

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
    from .kernels import gate_scores_backward

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
    from .kernels import gate_forward

    return gate_forward(scores, span_out, dtype, config)


def torch_gate(scores: torch.Tensor, span_out: torch.Tensor, dtype: torch.dtype, config: KernelConfig) -> torch.Tensor:
    """The PyTorch gate (nothing to configure)."""
    gate = torch.softmax(scores, dim=-1)
    return (gate[..., None] * span_out.to(gate.dtype)).sum(dim=3).to(dtype)


def triton_gate_backward(scores: torch.Tensor, span_out: torch.Tensor, grad: torch.Tensor,
                         config: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton gate backward."""
    from .kernels import gate_backward

    return gate_backward(scores, span_out, grad, config)


def torch_gate_backward(scores: torch.Tensor, span_out: torch.Tensor, grad: torch.Tensor,
                        config: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch gate backward."""
    gate = torch.softmax(scores, dim=-1)
    grad = grad.to(gate.dtype)
    s = (grad[..., None, :] * span_out.to(gate.dtype)).sum(dim=-1)
    d_scores = gate * (s - (gate * s).sum(dim=-1, keepdim=True))
    return d_scores.to(scores.dtype), (gate[..., None] * grad[..., None, :]).to(span_out.dtype)
