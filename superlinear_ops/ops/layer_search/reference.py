"""Stripe search and top-k for every query of a chunk (semantics section 4, step 1), in PyTorch.

This is the layer's reference search (the CPU, float64 and fallback path); ``search_kernel`` is
the fast one. Both return a ``Found``: anchors [B, Hq, Lq, topk] (int64, -1 for an empty slot) in no
particular slot order (everything downstream is a sum over slots) and, slot by slot, their search
scores Q1 . K[anchor] (EMPTY_SCORE for an empty slot): the gate scores of a forward that needs no
gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ... import geometry
from ...launch import KernelConfig
from ...settings import SpanSettings
from ..gate import EMPTY_SCORE

SCORE_CHUNK_BYTES = 1 << 28  # gathered stripe keys held at once


class Found(NamedTuple):
    """A search's result: anchors [B, Hq, Lq, topk] (int64, -1: empty slot) and their scores
    (fp32, float64 for float64 inputs; EMPTY_SCORE for an empty slot, +inf for a NaN score)."""

    anchors: torch.Tensor
    scores: torch.Tensor


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
) -> Found:
    """Anchors [B, Hq, Lq, topk] and their scores: the best ``topk`` valid stripes by Q1 . K (fp32,
    float64 for float64 inputs, unscaled; a NaN score counts as +inf); among equal scores the
    larger stripe index (the farther key) wins."""
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
    anchors, scores_kept = [], []
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
        kept = best > float("-inf")
        anchors.append(torch.where(kept, chosen_loc, torch.full_like(chosen_loc, -1)))
        scores_kept.append(torch.where(kept, best, torch.full_like(best, EMPTY_SCORE)))
    if not anchors:
        return Found(q1.new_empty(batch, hq, 0, settings.topk, dtype=torch.int64),
                     q1.new_empty(batch, hq, 0, settings.topk, dtype=cdt))
    found = Found(torch.cat(anchors, dim=2), torch.cat(scores_kept, dim=2))
    return padded(found, settings.topk)


def padded(found: Found, topk: int) -> Found:
    """``found`` with empty slots appended up to ``topk`` (a search over fewer stripes than slots)."""
    missing = topk - found.anchors.shape[-1]
    if missing <= 0:
        return found
    return Found(torch.nn.functional.pad(found.anchors, (0, missing), value=-1),
                 torch.nn.functional.pad(found.scores, (0, missing), value=EMPTY_SCORE))
