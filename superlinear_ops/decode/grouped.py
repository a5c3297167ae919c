"""Staged decode with the stripe search and the window computed once per KV group on tensor
cores: the chosen spans in chunks per head after the search, merged by the last program
(``grouped_kernels``), or every stripe's span per group beside the search and a merge launch that
picks the chosen ones (``stripe_spans_kernels``)."""

from __future__ import annotations

import torch

from ..kernels.launch import KernelConfig
from ..settings import SpanSettings
from .tables import decode_tables


def _with_tables(attention, q1, q2, k, v, cache_position, attention_mask, settings: SpanSettings,
                 config: KernelConfig) -> torch.Tensor:
    """``attention`` (a launcher of the grouped kernels' modules) given the shape's tables."""
    settings = settings.for_keys(k.shape[2])
    tables = decode_tables(k.shape[2], settings, q1.device)
    return attention(
        q1, q2, k, v, cache_position, attention_mask, tables.offsets, tables.back, tables.forward,
        settings.window_for(k.shape[2]), settings.topk, tables.longest_span,
        block_k=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages, chunk=config.chunk,
    )


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

    return _with_tables(grouped_decode_attention, q1, q2, k, v, cache_position, attention_mask, settings, config)


def stripe_spans_decode(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    settings: SpanSettings,
    config: KernelConfig,
) -> torch.Tensor:
    """Decode output [B, Hq, 1, D] for validated inputs, every stripe's span attended beside the
    search (two launches, no host synchronisation)."""
    from .stripe_spans_kernels import stripe_spans_attention  # imports Triton on first use only

    return _with_tables(stripe_spans_attention, q1, q2, k, v, cache_position, attention_mask, settings, config)
