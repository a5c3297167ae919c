"""Staged decode with the fused stripe search and chunked (flash-decoding) span attention whose
merge also applies the gate: three launches per step (search, partials, merge)."""

from __future__ import annotations

import torch

from .decode import DecodeSettings
from .decode_tables import decode_tables
from .kernels.launch import KernelConfig


def split_window_decode(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    settings: DecodeSettings,
    config: KernelConfig,
) -> torch.Tensor:
    """Decode output [B, Hq, 1, D] for validated inputs."""
    from .kernels.decode_search import stripe_search  # import Triton on first use only
    from .kernels.decode_split import split_decode_attention

    tables, window = decode_tables(k.shape[2], settings, q1.device), settings.window
    qstart, qend, scores = stripe_search(
        q1, k, tables.offsets, cache_position, attention_mask, tables.back, tables.forward, window, settings.topk
    )
    return split_decode_attention(
        q2, k, v, qstart, qend, cache_position[-1:], attention_mask, window, scores, tables.longest_span,
        block_k=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages,
    )
