"""What an ideal decode step must read and compute on given inputs: the lower bound's cost model.

The spans a step attends depend on its search, so the model runs the search (the PyTorch chain of
``staged.staged_decode``, its span attention replaced by a stand-in that keeps the spans) and counts,
per batch row and KV head, every key its query heads attend once, however many heads and spans
hold it. A model that counted each head's spans apart would exceed what a kernel sharing key rows
across the group moves, and a measured step could beat its own lower bound.
"""

from __future__ import annotations

import torch

from ... import geometry
from ...launch import LaunchGeometry
from ...settings import SpanSettings
from ..inputs import Inputs
from ..span_attention.reference import attended_counts, span_segments
from .staged import staged_decode


def chosen_spans(x: Inputs, settings: SpanSettings) -> LaunchGeometry:
    """The geometry step 4 of the decode step receives on ``x``: qstart/qend [B, Hq, 1, topk] of
    the chosen spans (qstart -1 in a slot with no span), the clamped position and the window."""
    handed: list[LaunchGeometry] = []

    def keep_spans(geo: LaunchGeometry) -> tuple[torch.Tensor, torch.Tensor]:
        handed.append(geo)
        batch, heads, _, slots = geo.qstart.shape
        return geo.q.new_zeros(batch, heads, 1, slots, geo.q.shape[-1]), geo.q.new_zeros(batch, heads, 1, slots)

    staged_decode(x.q1, x.q, x.k, x.v, x.cache_position, x.mask, settings, keep_spans)
    return handed[0]


def step_traffic(x: Inputs, settings: SpanSettings) -> tuple[float, float]:
    """(bytes, FLOPs) of one decode step on ``x`` done ideally: Q1 and Q2 read and the output written;
    per (batch row, KV head) the K and V rows of every attended key that the mask keeps and the K row
    of every kept key the search scores, each once; one mask byte per key attended or scored in a batch row;
    4 D FLOPs per (query head, chosen span, attended key), a head without a chosen span attending
    its window once."""
    geo = chosen_spans(x, settings)
    batch, heads, _, _ = geo.qstart.shape
    kv_heads, keys, dim = geo.k.shape[1], geo.k.shape[2], geo.k.shape[3]
    device, mask = geo.k.device, geo.attention_mask
    kept = (mask[:, :keys] != 0) if mask is not None else torch.ones(batch, keys, dtype=torch.bool, device=device)
    seg = span_segments(geo.qstart, geo.qend, geo.cache_position, keys, geo.window)
    pos, window_lo = int(seg.pos), int(seg.window_lo)

    chosen = geo.qstart[:, :, 0] >= 0  # [B, Hq, topk]
    per_slot = attended_counts(geo.qstart, geo.qend, geo.cache_position, mask, keys, geo.window)[:, :, 0]
    window_only = (kept[:, window_lo:pos + 1]).sum(-1, keepdim=True)  # [B, 1]: a head with no span attends its window
    per_head = torch.where(chosen.any(-1), torch.where(chosen, per_slot, 0).sum(-1), window_only)
    flops = 4.0 * dim * float(per_head.sum())

    # Keys each (batch row, KV head) attends: +1 where a segment starts, -1 past its end, summed along the keys.
    span_lo, span_hi = seg.lo[:, :, 0], seg.hi[:, :, 0]
    edges = torch.zeros(batch * kv_heads, keys + 1, dtype=torch.int32, device=device)
    group = (torch.arange(batch, device=device)[:, None, None] * kv_heads
             + torch.arange(heads, device=device)[None, :, None] // (heads // kv_heads)).expand_as(span_lo)
    in_span = chosen & (span_hi >= span_lo)
    for at, step in ((span_lo, 1), (span_hi + 1, -1)):
        edges.view(-1).index_add_(0, (group * (keys + 1) + at)[in_span], torch.full_like(at[in_span], step, dtype=torch.int32))
    if window_lo <= pos:
        edges[:, window_lo] += 1
        edges[:, pos + 1] -= 1
    attended = (edges.cumsum(-1)[:, :keys] > 0).view(batch, kv_heads, keys)

    loc = pos + 1 - geometry.stripe_offsets_tensor(keys, settings.sw_index, settings.params, device)
    scored = torch.zeros(keys, dtype=torch.bool, device=device)  # the keys the search scores (section 3, step 1)
    scored[loc[(loc >= 0) & (loc < window_lo)]] = True
    k_rows = ((attended | scored) & kept[:, None]).sum()
    v_rows = (attended & kept[:, None]).sum()
    mask_bytes = int((attended.any(1) | scored).sum()) if mask is not None else 0
    queries = 3 * batch * heads * dim  # Q1 and Q2 read, the output written
    return float((int(k_rows + v_rows) * dim + queries) * geo.k.element_size() + mask_bytes), flops
