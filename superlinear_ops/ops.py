"""Span-attention op: routes to the Triton kernels or the PyTorch reference, with autograd.

Tensors on a GPU run the Triton kernels; CPU tensors run the reference, or the Triton kernels
under Triton's interpreter when TRITON_INTERPRET=1. float64 always runs the reference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .reference import span_forward_reference


def runs_triton(t: torch.Tensor) -> bool:
    """True when ops on ``t`` run the Triton kernels (GPU, or CPU under TRITON_INTERPRET=1)."""
    if t.dtype == torch.float64:
        return False
    if t.is_cuda:
        return True
    return t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class BackwardVariant:
    """How the span backward is laid out: per-span or fused-span programs, shared or split dK/dV."""

    fused_spans: bool = True
    split_dkv: bool = True

    @property
    def name(self) -> str:
        """Short name, e.g. 'fused_split'."""
        return f"{'fused' if self.fused_spans else 'per_span'}_{'split' if self.split_dkv else 'shared'}"


BACKWARD_VARIANTS = tuple(BackwardVariant(f, s) for f in (False, True) for s in (False, True))


def _kernels():
    # Imported lazily so that importing the package never compiles or needs a GPU.
    from .kernels import span_backward, span_forward
    from .kernels.launch import KernelConfig, LaunchGeometry

    return span_forward, span_backward, KernelConfig, LaunchGeometry


class _TritonSpanAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, qstart, qend, cache_position, attention_mask, window, config, backward):
        span_forward, _, _, LaunchGeometry = _kernels()
        geo = LaunchGeometry.prepare(q, k, v, qstart, qend, cache_position, attention_mask, window)
        out, lse = span_forward.span_forward(geo, config)
        ctx.geo, ctx.config, ctx.backward = geo, config, backward
        ctx.save_for_backward(out, lse)
        ctx.mark_non_differentiable(lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        _, span_backward, _, _ = _kernels()
        out, lse = ctx.saved_tensors
        dq, dk, dv = span_backward.span_backward(
            ctx.geo,
            ctx.config,
            out,
            lse,
            grad_out,
            fused_spans=ctx.backward.fused_spans,
            split_dkv=ctx.backward.split_dkv,
        )
        return dq, dk, dv, None, None, None, None, None, None, None


def span_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qstart: torch.Tensor,
    qend: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    window: int,
    *,
    block_k: int | None = None,
    backward: BackwardVariant = BackwardVariant(),
) -> torch.Tensor:
    """Per-span outputs [B, Hq, Lq, K, D] of validated inputs, differentiable in q, k and v."""
    if not runs_triton(q):
        return span_forward_reference(q, k, v, qstart, qend, cache_position, attention_mask, window)
    _, _, KernelConfig, _ = _kernels()
    config = KernelConfig() if block_k is None else KernelConfig(block_k=block_k)
    return _TritonSpanAttention.apply(
        q, k, v, qstart, qend, cache_position, attention_mask, window, config, backward
    )
