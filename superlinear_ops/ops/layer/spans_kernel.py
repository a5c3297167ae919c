"""The layer's spans from its anchors (semantics section 4, step 2) in one Triton launch.

The same integers as ``attention.spans_of_anchors`` (its tensor ops are the reference, and what
runs off the GPU), from the same exact span-length tables (``geometry.span_length_table``): per
(b, h, q, slot) with anchor a, pos = cache_position[q] clamped to the keys, s = the first key the
mask allows in row b (0 without a mask) and d = clamp(pos + 1 - s, 0, Lkv),

    qstart = max(a - back[d], s),   qend = min(a + forward[d], pos - W),

and -1 for both where a = -1; without a forward factor qend = a. One launch instead of about 25
small ones, whose host time dominated a layer call's. No host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import geometry, validation
from ...settings import SpanSettings

BLOCK = 1024  # (b, h, q, slot) entries per program


@triton.jit
def layer_spans_kernel(
    anchor_ptr, pos_ptr, first_ptr, back_ptr, forward_ptr, qstart_ptr, qend_ptr,
    N, L_Q, ROW, L_KV, WINDOW,
    SLOTS: tl.constexpr, HAS_FIRST: tl.constexpr, HAS_FORWARD: tl.constexpr, BLOCK: tl.constexpr,
):
    """qstart/qend of ``BLOCK`` consecutive (b, h, q, slot) entries; ``ROW`` = Hq * Lq * SLOTS."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < N
    anchor = tl.load(anchor_ptr + offs, mask=live, other=-1).to(tl.int64)
    pos = tl.load(pos_ptr + (offs // SLOTS) % L_Q, mask=live, other=0).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), L_KV - 1)
    if HAS_FIRST:
        first = tl.load(first_ptr + offs // ROW, mask=live, other=0)
    else:
        first = tl.zeros_like(pos)
    distance = tl.minimum(tl.maximum(pos + 1 - first, 0), L_KV)
    empty = anchor < 0
    qstart = tl.maximum(anchor - tl.load(back_ptr + distance, mask=live, other=0), first)
    tl.store(qstart_ptr + offs, tl.where(empty, -1, qstart).to(tl.int32), mask=live)
    if HAS_FORWARD:
        limit = tl.where(WINDOW == 0, pos, pos - WINDOW)
        qend = tl.minimum(anchor + tl.load(forward_ptr + distance, mask=live, other=0), limit)
        tl.store(qend_ptr + offs, tl.where(empty, -1, qend).to(tl.int32), mask=live)
    else:
        tl.store(qend_ptr + offs, anchor.to(tl.int32), mask=live)


def spans_by_kernel(
    anchors: torch.Tensor,
    cache_position: torch.Tensor,
    key_length: int,
    attention_mask: torch.Tensor | None,
    settings: SpanSettings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(qstart, qend) [B, Hq, Lq, topk] of the anchors [B, Hq, Lq, topk]: ``spans_of_anchors``'s
    result in one launch (the first allowed key of a masked row comes from one argmax first), as
    int32, the span kernels' index type: every bound lies in [-1, Lkv - 1], so they take it unclamped.
    ValueError when cache_position is not [Lq] or the mask not [B, >= key_length]
    (``validation.check_anchor_inputs``: the kernel indexes them per query and per row, where the
    tensor ops would broadcast)."""
    validation.check_anchor_inputs(anchors, cache_position, attention_mask, key_length)
    _, hq, lq, slots = anchors.shape
    qstart = torch.empty(anchors.shape, dtype=torch.int32, device=anchors.device)
    qend = torch.empty_like(qstart)
    if anchors.numel() == 0:
        return qstart, qend
    back = geometry.span_length_table(settings.backward_factor, settings.span_power, key_length, anchors.device)
    has_forward = settings.forward_factor != 0.0
    forward = (geometry.span_length_table(settings.forward_factor, settings.span_power, key_length, anchors.device)
               if has_forward else back)
    first = (None if attention_mask is None
             else (attention_mask[:, :key_length] != 0).to(torch.int8).argmax(dim=1))
    layer_spans_kernel[(triton.cdiv(anchors.numel(), BLOCK),)](
        anchors.contiguous(), cache_position.contiguous(), back if first is None else first, back, forward, qstart, qend,
        anchors.numel(), lq, hq * lq * slots, key_length, settings.window_for(key_length),
        SLOTS=slots, HAS_FIRST=first is not None, HAS_FORWARD=has_forward, BLOCK=BLOCK, num_warps=4,
    )
    return qstart, qend
