"""Stripe search and top-k for every query of a chunk (SPEC section 7, step 1), in PyTorch.

This is the layer's reference search (the CPU, float64 and fallback path); ``search_kernel`` is
the fast one. Both return anchors [B, Hq, Lq, topk] (int64, -1 for an empty slot) in no particular
slot order: everything downstream is a sum over slots.
"""

from __future__ import annotations

import torch

from .. import geometry
from ..kernels.launch import KernelConfig
from ..settings import SpanSettings

SCORE_CHUNK_BYTES = 1 << 28  # gathered stripe keys held at once


def stripe_offsets_and_lengths(cache_position: torch.Tensor, key_length: int, settings: SpanSettings):
    """(offsets [S], t [Lq]): the stripe offsets floor(i ** inv_p) for i = sw_index + 1 .. S in
    increasing order (sized from the keys, never from the data) and each query's t = pos + 1;
    stripe i's key for a query is t - offsets[i]."""
    offsets = geometry.stripe_offsets_tensor(key_length, settings.sw_index, settings.params, cache_position.device)
    return offsets, cache_position.to(torch.int64).clamp(-1, key_length - 1) + 1


def search_reference(
    q1: torch.Tensor,
    k: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    settings: SpanSettings,
    config: KernelConfig,
) -> torch.Tensor:
    """Anchors [B, Hq, Lq, topk]: the best ``topk`` valid stripes by Q1 . K (fp32, float64 for
    float64 inputs, unscaled; a NaN score counts as +inf); among equal scores the larger stripe
    index (the farther key) wins."""
    batch, hq, lq, dim = q1.shape
    hkv, lkv = k.shape[1], k.shape[2]
    rep = hq // hkv
    offsets, t = stripe_offsets_and_lengths(cache_position, lkv, settings)
    loc = t[:, None] - offsets[None, :]  # [Lq, S]
    n_stripes = loc.shape[1]
    cdt = torch.float64 if q1.dtype == torch.float64 else torch.float32
    valid = (loc >= 0).expand(batch, lq, n_stripes)
    safe = loc.clamp(min=0)
    if attention_mask is not None:
        valid = valid & (attention_mask[:, safe] != 0)
    chunk = max(1, SCORE_CHUNK_BYTES // max(1, batch * hkv * n_stripes * dim * 8))
    anchors = []
    for start in range(0, lq, chunk):
        rows = slice(start, start + chunk)
        keys = k[:, :, safe[rows]].to(cdt)  # [B, Hkv, q, S, D]
        queries = q1[:, :, rows].to(cdt).reshape(batch, hkv, rep, -1, dim)
        scores = torch.einsum("bgrqd,bgqsd->bgrqs", queries, keys).reshape(batch, hq, -1, n_stripes)
        scores = scores.nan_to_num(nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))
        scores = scores.masked_fill(~valid[:, None, rows], float("-inf"))
        # Farther stripes first, then a stable sort: among equal scores the larger stripe index wins.
        order = torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices[..., : settings.topk]
        best = torch.gather(scores.flip(-1), -1, order)
        stripe = n_stripes - 1 - order
        chosen_loc = torch.gather(loc[rows].expand(batch, hq, -1, -1), -1, stripe)
        anchors.append(torch.where(best > float("-inf"), chosen_loc, torch.full_like(chosen_loc, -1)))
    found = torch.cat(anchors, dim=2) if anchors else q1.new_empty(batch, hq, 0, 0, dtype=torch.int64)
    missing = settings.topk - found.shape[-1]  # fewer stripes than slots: the rest stay empty
    return torch.nn.functional.pad(found, (0, missing), value=-1) if missing > 0 else found
