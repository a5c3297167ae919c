"""Staged decode with the stripe search, top-k and span ends fused into one Triton kernel.

Computes exactly what ``decode.staged_decode`` computes (SPEC section 3); steps 1-3 run in
``kernels.decode_search`` instead of a chain of small PyTorch ops.
"""

from __future__ import annotations

import torch

from .decode import DecodeSettings, SpanForward
from .decode_tables import DecodeTables, decode_tables
from .kernels.launch import LaunchGeometry


def gate_and_combine(scores: torch.Tensor, span_out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Step 5: softmax of the chosen spans' scores [B, Hq, topk] (-inf: no span; all -inf: uniform)
    weighting the span outputs [B, Hq, 1, topk, D]; returns [B, Hq, 1, D] in ``dtype``."""
    any_chosen = (scores > float("-inf")).any(dim=-1, keepdim=True)
    gate = torch.softmax(torch.where(any_chosen, scores, torch.zeros_like(scores)), dim=-1)
    cdt = torch.float64 if span_out.dtype == torch.float64 else torch.float32
    return (gate[:, :, None, :, None].to(cdt) * span_out.to(cdt)).sum(dim=3).to(dtype)


def search_spans(
    q1: torch.Tensor,
    k: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    settings: DecodeSettings,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DecodeTables]:
    """Steps 1-3 in one Triton kernel: (qstart, qend [B, Hq, 1, topk], chosen scores [B, Hq, topk], tables)."""
    from .kernels.decode_search import stripe_search  # imports Triton on first use only

    settings = settings.for_keys(k.shape[2])
    tables = decode_tables(k.shape[2], settings, q1.device)
    qstart, qend, scores = stripe_search(
        q1, k, tables.offsets, cache_position, attention_mask, tables.back, tables.forward,
        settings.window_for(k.shape[2]),
        settings.topk,
    )
    return qstart, qend, scores, tables


def fused_search_decode(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    settings: DecodeSettings,
    span_forward: SpanForward,
) -> torch.Tensor:
    """Staged decode with steps 1-3 in one Triton kernel (``kernels.decode_search``)."""
    qstart, qend, scores, _ = search_spans(q1, k, cache_position, attention_mask, settings)
    pos = cache_position[-1:].clamp(max=k.shape[2] - 1)  # before the kernels' int32 cast
    geo = LaunchGeometry.prepare(q2, k, v, qstart, qend, pos, attention_mask, settings.window_for(k.shape[2]))
    span_out, _ = span_forward(geo)
    return gate_and_combine(scores, span_out, q2.dtype)
