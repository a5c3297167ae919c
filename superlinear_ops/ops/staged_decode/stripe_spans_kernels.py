"""Staged decode in two launches with no span work waiting for the search: for short contexts.

A stripe's span depends on the stripe alone (its anchor position, t and the span tables; SPEC
section 3, step 3), not on the head that chooses it. So the first launch, ``group_stage.group_kernel``
with its ``stripe_spans`` programs, attends the span of *every* stripe of the table for all ``rep``
heads of a KV group at once (one [rep, D] query tile per chunk of the span, as the window
programs do), beside the stripe search and the window; the second, ``stripe_merge_kernel``, takes
each head's top-``TOPK`` candidates (highest score first; among ties the nearest anchor), finds
the chosen stripes' partials and merges them with the window's under the gate (steps 4-5).

The spans of all stripes are about ``stripes / topk`` times the keys of the chosen ones, read once
per group instead of once per head: cheaper than waiting for the search when both are small (model
M at 4K: 32 stripes of 391 keys), dearer at long contexts, where the registry's ``grouped`` variant
attends only the chosen spans. Grids and buffers depend only on shapes, never on the position.
``grouped_kernels.grouped_decode_attention(..., stripe_spans=True)`` runs both launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from .group_attend import chosen_anchor, clamped_position, gated_merge
from .group_stage import GroupStage
from .grouped_plan import pow2

__all__ = ["merge_chosen_stripes"]


@triton.jit
def stripe_merge_kernel(
    cand_score_ptr, cand_anchor_ptr, offsets_ptr, cache_pos_ptr, span_acc_ptr, span_m_ptr, span_l_ptr,
    win_acc_ptr, win_m_ptr, win_l_ptr, Out_ptr,
    H_Q, L_KV, LAST, N_CANDIDATES, N_STRIPES, N_SCHUNKS, N_WCHUNKS,
    TOPK: tl.constexpr, TOPK_POW2: tl.constexpr, CAND_POW2: tl.constexpr, STRIPES_POW2: tl.constexpr,
    SCHUNKS_POW2: tl.constexpr, WCHUNKS_POW2: tl.constexpr, D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """Per (head, batch): the head's chosen stripes, their span partials merged with the window's, gated."""
    row = tl.program_id(1).to(tl.int64) * H_Q + tl.program_id(0)
    t = clamped_position(cache_pos_ptr, LAST, L_KV) + 1
    stripes = tl.arange(0, STRIPES_POW2)
    offsets = tl.load(offsets_ptr + stripes, mask=stripes < N_STRIPES, other=L_KV + 1)  # before the wait
    if PDL:
        gdc_wait()
    slots = tl.arange(0, TOPK_POW2)
    scores = tl.full((TOPK_POW2,), float("-inf"), tl.float32)
    firsts = tl.zeros((TOPK_POW2,), tl.int64)
    for j in tl.static_range(TOPK):
        score, anchor = chosen_anchor(cand_score_ptr, cand_anchor_ptr, row, j, N_CANDIDATES, TOPK, CAND_POW2)
        stripe = tl.sum((offsets < t - anchor).to(tl.int32), axis=0)  # the table's index of the anchor's offset
        scores = tl.where(slots == j, score, scores)
        firsts = tl.where(slots == j, (row * N_STRIPES + stripe) * N_SCHUNKS, firsts)
    counts = tl.where(scores > float("-inf"), N_SCHUNKS, 0)
    gated_merge(span_acc_ptr, span_m_ptr, span_l_ptr, win_acc_ptr, win_m_ptr, win_l_ptr, Out_ptr, row, scores, firsts,
                counts, N_WCHUNKS, TOPK, TOPK_POW2, SCHUNKS_POW2, WCHUNKS_POW2, D_HEAD, BLOCK_D)


def merge_chosen_stripes(g: GroupStage, offsets: torch.Tensor, decode_position: torch.Tensor, topk: int) -> torch.Tensor:
    """The second launch after ``run_group_kernel(..., stripe_spans=True)``: each head's chosen
    stripes' span partials merged with the window's under the gate, into ``g.out`` (returned)."""
    plan, (batch, hq, _, dim) = g.plan, g.q2.shape
    stripe_merge_kernel[(hq, batch)](
        *g.candidates, offsets, decode_position, *g.span_parts, *g.window_parts, g.out,
        hq, g.k.shape[2], g.last, plan.n_candidates, offsets.numel(), plan.n_chunks, plan.n_wchunks,
        TOPK=topk, TOPK_POW2=pow2(topk), CAND_POW2=pow2(plan.n_candidates), STRIPES_POW2=pow2(offsets.numel()),
        SCHUNKS_POW2=pow2(plan.n_chunks), WCHUNKS_POW2=pow2(plan.n_wchunks), D_HEAD=dim, BLOCK_D=plan.block_d,
        PDL=g.pdl, num_warps=4, launch_pdl=g.pdl,
    )
    return g.out
