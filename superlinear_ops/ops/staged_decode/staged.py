"""Staged decode (semantics section 3): stripe search, top-k anchors, spans, span attention, gate.

CUDA-graph safe: every shape comes from Lkv and the arguments (never from the decode position),
there is no host synchronisation and no data-dependent Python branch. The short-prefix rule needs
no second attention: when t <= W no stripe can precede the window, so every span slot is empty,
every O_j is the attention over keys [0, pos] and the uniform gate returns exactly that.
"""

from __future__ import annotations

import torch

from ... import geometry
from ...launch import LaunchGeometry
from ...settings import SpanSettings
from .gate_step import SpanForward, gate_and_combine


def staged_decode(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    settings: SpanSettings,
    span_forward: SpanForward,
) -> torch.Tensor:
    """Decode output [B, Hq, 1, D] for validated inputs; ``span_forward`` runs step 4."""
    settings = settings.for_keys(k.shape[2])
    sw_index, topk, params = settings.sw_index, settings.topk, settings.params
    backward_factor, forward_factor, span_power = settings.backward_factor, settings.forward_factor, settings.span_power
    batch, hq, _, dim = q1.shape
    hkv, lkv = k.shape[1], k.shape[2]
    rep = hq // hkv
    device = q1.device
    window = settings.window_for(lkv)
    cdt = torch.float64 if q1.dtype == torch.float64 else torch.float32

    decode_position = cache_position[-1:].to(torch.int64)
    pos = decode_position.clamp(max=lkv - 1)  # [1]
    t = pos + 1

    # 1. Stripes and their validity (per batch row: each row's own mask).
    offsets = geometry.stripe_offsets_tensor(lkv, sw_index, params, device)  # [S']
    loc = t - offsets
    window_start = (pos - window + 1).clamp(min=0)
    valid = ((loc >= 0) & (loc < window_start)).expand(batch, -1)  # [B, S']
    safe_loc = loc.clamp(0, lkv - 1)
    if attention_mask is not None:
        valid = valid & (attention_mask[:, safe_loc] != 0)

    # 2. Search scores (fp32, unscaled) and top-k.
    stripe_keys = k.index_select(2, safe_loc).to(cdt)  # [B, Hkv, S', D]
    scores = torch.einsum("bgrd,bgsd->bgrs", q1.to(cdt).view(batch, hkv, rep, dim), stripe_keys)
    scores = scores.reshape(batch, hq, offsets.numel()).masked_fill(~valid[:, None, :], float("-inf"))
    scores = scores.nan_to_num(nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))  # NaN wins, gate NaN
    found = min(topk, scores.shape[-1])
    # a stable sort, not torch.topk: among equal scores the nearest stripe (the lowest index) wins
    top_scores, top_index = (t[..., :found] for t in torch.sort(scores, dim=-1, descending=True, stable=True))
    if found < topk:
        pad = (0, topk - found)
        top_scores = torch.nn.functional.pad(top_scores, pad, value=float("-inf"))
        top_index = torch.nn.functional.pad(top_index, pad, value=0)
    chosen = top_scores > float("-inf")
    anchor = torch.where(chosen, safe_loc[top_index], torch.full_like(top_index, -1))  # [B, Hq, topk]

    # 3. Spans.
    back_len = geometry.span_length_table(backward_factor, span_power, lkv, device)[t]  # [1]
    qstart = torch.where(chosen, (anchor - back_len).clamp(min=0), torch.full_like(anchor, -1))
    qend = geometry.span_ends(
        anchor[:, :, None, :], decode_position, lkv, window, attention_mask, forward_factor, span_power
    )

    # 4. Span outputs, window included in each.
    geo = LaunchGeometry.prepare(q2, k, v, qstart[:, :, None, :], qend, pos, attention_mask, window)
    span_out, _ = span_forward(geo)  # [B, Hq, 1, topk, D]

    # 5. Gate: softmax over the chosen spans' scores; uniform when no span was chosen.
    return gate_and_combine(top_scores, span_out, q2.dtype)
