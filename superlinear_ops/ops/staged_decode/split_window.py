"""Staged decode with the fused stripe search and chunked (flash-decoding) span attention whose
merge also applies the gate: three launches per step (search, partials, merge)."""

from __future__ import annotations

import torch

from ...launch import KernelConfig
from ...settings import SpanSettings
from .stripe_search import search_spans


def split_window_decode(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    settings: SpanSettings,
    config: KernelConfig,
) -> torch.Tensor:
    """Decode output [B, Hq, 1, D] for validated inputs."""
    from .split_window_kernels import split_decode_attention  # imports Triton on first use only

    qstart, qend, scores, tables = search_spans(q1, k, cache_position, attention_mask, settings)
    return split_decode_attention(
        q2, k, v, qstart, qend, cache_position[-1:], attention_mask, settings.window_for(k.shape[2]), scores,
        tables.longest_span,
        block_k=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages,
    )
