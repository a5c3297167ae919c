"""Steps 1-3 of staged decode (stripe search, top-k, span ends) in one Triton kernel
(``search_kernel``): exactly what ``staged.staged_decode`` computes with a chain of PyTorch ops."""

from __future__ import annotations

import torch

from ...settings import SpanSettings
from .tables import DecodeTables, decode_tables


def search_spans(
    q1: torch.Tensor,
    k: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    settings: SpanSettings,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DecodeTables]:
    """Steps 1-3 in one Triton kernel: (qstart, qend [B, Hq, 1, topk], chosen scores [B, Hq, topk], tables)."""
    from .stripe_search_kernel import stripe_search  # imports Triton on first use only

    settings = settings.for_keys(k.shape[2])
    tables = decode_tables(k.shape[2], settings, q1.device)
    qstart, qend, scores = stripe_search(
        q1, k, tables.offsets, cache_position, attention_mask, tables.back, tables.forward,
        settings.window_for(k.shape[2]), settings.topk,
    )
    return qstart, qend, scores, tables
