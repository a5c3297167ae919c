"""Staged decode with the stripe search and the window computed once per KV group on tensor
cores, spans split into chunks, and one merge that applies the gate (``grouped_kernels``)."""

from __future__ import annotations

import torch

from ..kernels.launch import KernelConfig
from ..settings import SpanSettings
from .tables import decode_tables


def grouped_decode(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    settings: SpanSettings,
    config: KernelConfig,
) -> torch.Tensor:
    """Decode output [B, Hq, 1, D] for validated inputs (two launches, no host synchronisation)."""
    from .grouped_kernels import grouped_decode_attention  # imports Triton on first use only

    settings = settings.for_keys(k.shape[2])
    tables = decode_tables(k.shape[2], settings, q1.device)
    return grouped_decode_attention(
        q1, q2, k, v, cache_position, attention_mask, tables.offsets, tables.back, tables.forward,
        settings.window_for(k.shape[2]), settings.topk, tables.longest_span,
        block_k=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages, chunk=config.chunk,
    )
