"""Staged decode with the fused stripe search and chunked (flash-decoding) span attention whose
merge also applies the gate: three launches per step (search, partials, merge)."""

from __future__ import annotations

import functools

import torch

from . import geometry
from .decode import DecodeSettings
from .kernels.launch import KernelConfig


@functools.lru_cache(maxsize=256)
def longest_span(key_length: int, settings: DecodeSettings) -> int:
    """Upper bound on a decode span's key count for caches of ``key_length`` (shapes never depend on pos)."""
    back = geometry.ceil_scaled_power(settings.backward_factor, key_length, settings.span_power)
    forward = geometry.ceil_scaled_power(settings.forward_factor, key_length, settings.span_power)
    return back + forward + 1


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

    lkv, device, window = k.shape[2], q1.device, settings.window
    offsets = geometry.stripe_offsets_tensor(lkv, settings.sw_index, settings.params, device)
    back = geometry.span_length_table(settings.backward_factor, settings.span_power, lkv, device)
    forward = None
    if settings.forward_factor > 0:
        forward = geometry.span_length_table(settings.forward_factor, settings.span_power, lkv, device)
    qstart, qend, scores = stripe_search(q1, k, offsets, cache_position, attention_mask, back, forward, window, settings.topk)
    return split_decode_attention(
        q2, k, v, qstart, qend, cache_position[-1:], attention_mask, window, scores, longest_span(lkv, settings),
        block_k=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages,
    )
