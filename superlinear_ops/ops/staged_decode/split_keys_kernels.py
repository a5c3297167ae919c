"""Staged decode for short contexts with the keys split over programs: search, spans, window and
gate per KV group, merged by the last program (``one_launch_kernel``) or by a second launch
(``split_partials_kernel``, then ``split_merge_kernel``).

Each program of the first (or only) launch, one per (split, KV head, batch), runs ``_split_rows``:
1. the stripe search of the whole group (every stripe of the table against the ``rep`` search
   queries, ``BLOCK_S`` stripes per dot, each head's running top-``TOPK``; ties to the nearest
   anchor), repeated by every program of the group: at short contexts it is a few dozen key rows,
   cheaper than waiting for another launch;
2. the rows of the group, row ``j * REP_PAD + h``: head h's span of slot j for j < ``TOPK`` (from
   the exact span tables and, for forward spans under a mask, the row's first allowed key), and
   head h's window for j = ``TOPK``;
3. every row over its keys in the program's split of ``CHUNK`` key positions, all rows in one pass
   of [rows, D] x [D, BLOCK_K] dots (``group_spans_kernels.attend_row_ranges``): each key of the
   split that a row attends is read once for the group.

Then a partial per row and split, and the merge of each row's partials over the splits, each span
with its head's window, into the gate-weighted sum (docs/semantics.md section 3, steps 4-5):
- ``one_launch_kernel``: a counter per (batch, KV head), zeroed by the caller, counts the finished
  programs, and the last one merges all the group's rows, one split after another;
- ``split_merge_kernel``: one program per head merges its rows, every split's partial at once
  (``group_attend.gated_merge``), the splits' loads in flight together.

Partial softmax states are (weighted values, max, sum) in the log2 domain. The short prefix
(t <= W) needs no branch: no stripe is valid, every span row is empty and the uniform gate returns
the window. Grids and buffers depend only on shapes, never on the position.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ...launch import hopper_or_newer, key_value_pair, unit_stride
from ..kernel_helpers import LOG2E, tc_dot, window_bounds
from .group_attend import MIN_DOT, NO_ANCHOR, anchored_span, clamped_position, gated_merge
from .group_spans_kernels import attend_row_ranges
from .group_stage import _first_allowed, mask_operand
from .grouped_plan import MAX_SPAN_ROWS, cdiv, one_launch_rows, pow2

__all__ = ["one_launch_attention", "split_merge_attention"]


@triton.jit
def _group_top_stripes(
    Q1_ptr, K_ptr, offsets_ptr, mask_row_ptr, q1_base, kv_base, stride_q1h, stride_kl, pos, window_start, REP,
    N_STRIPES, TOPK: tl.constexpr, TOPK_POW2: tl.constexpr, BLOCK_S: tl.constexpr, REP_PAD: tl.constexpr,
    D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr, HAS_MASK: tl.constexpr, UPCAST: tl.constexpr,
):
    """Each head's top-``TOPK`` stripes: scores and anchors [REP_PAD, TOPK_POW2], best first (score
    -inf: none). A NaN score counts as +inf (it wins and makes the gate NaN)."""
    heads = tl.arange(0, REP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D_HEAD
    q1 = tl.load(Q1_ptr + q1_base + heads[:, None] * stride_q1h + offs_d[None, :],
                 mask=(heads < REP)[:, None] & d_mask[None, :], other=0.0)
    slots = tl.arange(0, TOPK_POW2)
    best = tl.full((REP_PAD, TOPK_POW2), float("-inf"), tl.float32)
    best_anchor = tl.full((REP_PAD, TOPK_POW2), NO_ANCHOR, tl.int32)
    for block in range(0, N_STRIPES, BLOCK_S):
        stripes = block + tl.arange(0, BLOCK_S)
        in_table = stripes < N_STRIPES
        loc = pos + 1 - tl.load(offsets_ptr + stripes, mask=in_table, other=0)
        valid = in_table & (loc >= 0) & (loc < window_start)
        keys = tl.load(K_ptr + kv_base + loc[:, None] * stride_kl + offs_d[None, :],
                       mask=valid[:, None] & d_mask[None, :], other=0.0)
        if HAS_MASK:  # the keys load does not wait for the mask: a hidden stripe's score is dropped
            valid = valid & (tl.load(mask_row_ptr + loc, mask=valid, other=0) != 0)
        scores = tl.where(valid[None, :], tc_dot(q1, tl.trans(keys), UPCAST), float("-inf"))
        scores = tl.where(scores != scores, float("inf"), scores)
        anchors = tl.where(valid, loc, NO_ANCHOR).to(tl.int32)  # distinct for valid stripes
        kept = tl.full((REP_PAD, TOPK_POW2), float("-inf"), tl.float32)
        kept_anchor = tl.full((REP_PAD, TOPK_POW2), NO_ANCHOR, tl.int32)
        for j in tl.static_range(TOPK):  # the top of the running best and this block's scores
            top = tl.maximum(tl.max(best, axis=1), tl.max(scores, axis=1))
            pick = tl.maximum(tl.max(tl.where(best == top[:, None], best_anchor, NO_ANCHOR), axis=1),
                              tl.max(tl.where(scores == top[:, None], anchors[None, :], NO_ANCHOR), axis=1))
            kept = tl.where(slots[None, :] == j, top[:, None], kept)
            kept_anchor = tl.where(slots[None, :] == j, pick[:, None], kept_anchor)
            best = tl.where(best_anchor == pick[:, None], float("-inf"), best)
            scores = tl.where(anchors[None, :] == pick[:, None], float("-inf"), scores)
        best, best_anchor = kept, kept_anchor
    return best, best_anchor


@triton.jit
def _row_ranges(
    best, best_anchor, back_ptr, forward_ptr, mask_row_ptr, pos, WINDOW, L_KV, REP,
    TOPK: tl.constexpr, TOPK_POW2: tl.constexpr, SLOTS: tl.constexpr, REP_PAD: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_FORWARD: tl.constexpr,
):
    """Per row (slot j, head h): the slot's score (-inf: no span) and keys [lo, hi] (hi < lo: none):
    the chosen span for j < ``TOPK``, the window for j = ``TOPK``."""
    rows = tl.arange(0, SLOTS * REP_PAD)
    row_head, row_slot = rows % REP_PAD, rows // REP_PAD
    of_head = row_head[:, None] == tl.arange(0, REP_PAD)[None, :]  # [rows, REP_PAD]
    slots = tl.arange(0, TOPK_POW2)
    score = tl.full(rows.shape, float("-inf"), tl.float32)
    anchor = tl.zeros(rows.shape, tl.int32)
    for j in tl.static_range(TOPK):
        head_score = tl.max(tl.where(slots[None, :] == j, best, float("-inf")), axis=1)
        head_anchor = tl.max(tl.where(slots[None, :] == j, best_anchor, NO_ANCHOR), axis=1)
        score = tl.where(row_slot == j, tl.max(tl.where(of_head, head_score[None, :], float("-inf")), axis=1), score)
        anchor = tl.where(row_slot == j, tl.max(tl.where(of_head, head_anchor[None, :], NO_ANCHOR), axis=1), anchor)
    window_lo, window_hi = window_bounds(pos, WINDOW)
    first = 0
    if HAS_FORWARD and HAS_MASK:  # the row's first allowed key before the window (L_KV when none)
        first = _first_allowed(mask_row_ptr, 0, window_lo, L_KV, 256)
    lo, hi = anchored_span(anchor, score, back_ptr, forward_ptr, pos, first, WINDOW, L_KV, HAS_FORWARD)
    lo = tl.where(row_slot == TOPK, window_lo, lo)
    hi = tl.where(row_slot == TOPK, window_hi, hi)
    return score, lo.to(tl.int32), tl.where(row_head < REP, hi, -1).to(tl.int32)


@triton.jit
def _split_rows(
    Q1_ptr, Q2_ptr, K_ptr, V_ptr, offsets_ptr, back_ptr, forward_ptr, cache_pos_ptr, mask_ptr,
    stride_q1b, stride_q1h, stride_q2b, stride_q2h, stride_kb, stride_kh, stride_kl, stride_mb,
    L_KV, REP, WINDOW, LAST, N_STRIPES, qk_scale,
    CHUNK: tl.constexpr, TOPK: tl.constexpr, TOPK_POW2: tl.constexpr, SLOTS: tl.constexpr,
    REP_PAD: tl.constexpr, BLOCK_S: tl.constexpr, D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr, HAS_FORWARD: tl.constexpr, UPCAST: tl.constexpr,
):
    """Steps 1-3 of a (split, KV head, batch) program: the group's search, then each row's score and
    partial softmax state over its keys in the program's split: (score, acc, m, l), row
    ``j * REP_PAD + h`` for slot j and head h (m -inf, l and acc 0: no key of the row here)."""
    split = tl.program_id(0)
    group = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    pos = clamped_position(cache_pos_ptr, LAST, L_KV)
    rows = tl.arange(0, SLOTS * REP_PAD)
    row_head = rows % REP_PAD
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D_HEAD
    heads = group * REP + row_head
    q = tl.load(Q2_ptr + batch * stride_q2b + heads[:, None] * stride_q2h + offs_d[None, :],
                mask=(row_head < REP)[:, None] & d_mask[None, :], other=0.0)
    kv_base = batch * stride_kb + group * stride_kh
    mask_row = mask_ptr + batch * stride_mb
    best, best_anchor = _group_top_stripes(
        Q1_ptr, K_ptr, offsets_ptr, mask_row, batch * stride_q1b + group * REP * stride_q1h, kv_base, stride_q1h,
        stride_kl, pos, tl.maximum(pos - WINDOW + 1, 0), REP, N_STRIPES, TOPK, TOPK_POW2, BLOCK_S, REP_PAD, D_HEAD,
        BLOCK_D, HAS_MASK, UPCAST,
    )
    score, lo, hi = _row_ranges(best, best_anchor, back_ptr, forward_ptr, mask_row, pos, WINDOW, L_KV, REP, TOPK,
                                TOPK_POW2, SLOTS, REP_PAD, HAS_MASK, HAS_FORWARD)
    row_lo = tl.maximum(lo, split * CHUNK)
    row_hi = tl.minimum(hi, split * CHUNK + CHUNK - 1)
    acc, m, l = attend_row_ranges(q, K_ptr, V_ptr, kv_base, stride_kl, mask_row, row_lo <= row_hi, row_lo, row_hi,
                                  offs_d, d_mask, qk_scale, BLOCK_K, HAS_MASK, UPCAST)
    return score, acc, m, l


@triton.jit
def one_launch_kernel(
    Q1_ptr, Q2_ptr, K_ptr, V_ptr, offsets_ptr, back_ptr, forward_ptr, cache_pos_ptr, mask_ptr, acc_ptr, m_ptr,
    l_ptr, counter_ptr, Out_ptr,
    stride_q1b, stride_q1h, stride_q2b, stride_q2h, stride_kb, stride_kh, stride_kl, stride_mb,
    H_Q, L_KV, REP, WINDOW, LAST, N_STRIPES, qk_scale,
    CHUNK: tl.constexpr, TOPK: tl.constexpr, TOPK_POW2: tl.constexpr, SLOTS: tl.constexpr,
    REP_PAD: tl.constexpr, BLOCK_S: tl.constexpr, D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr, HAS_FORWARD: tl.constexpr, UPCAST: tl.constexpr,
):
    """Per (split, KV head, batch): ``_split_rows``, and in the program that finishes last the merge
    over the splits and the gate."""
    score, acc, m, l = _split_rows(
        Q1_ptr, Q2_ptr, K_ptr, V_ptr, offsets_ptr, back_ptr, forward_ptr, cache_pos_ptr, mask_ptr,
        stride_q1b, stride_q1h, stride_q2b, stride_q2h, stride_kb, stride_kh, stride_kl, stride_mb,
        L_KV, REP, WINDOW, LAST, N_STRIPES, qk_scale, CHUNK, TOPK, TOPK_POW2, SLOTS, REP_PAD, BLOCK_S, D_HEAD,
        BLOCK_D, BLOCK_K, HAS_MASK, HAS_FORWARD, UPCAST,
    )
    split = tl.program_id(0)
    group = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    splits = tl.num_programs(0)
    rows = tl.arange(0, SLOTS * REP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D_HEAD
    group_row = batch * (H_Q // REP) + group
    part = (group_row * splits + split) * SLOTS * REP_PAD + rows
    # A row with no key in this split keeps m = -inf: its weighted values are neither stored nor merged.
    tl.store(acc_ptr + part[:, None] * D_HEAD + offs_d[None, :], acc, mask=(m != float("-inf"))[:, None] & d_mask[None, :])
    tl.store(m_ptr + part, m)
    tl.store(l_ptr + part, l)

    tl.debug_barrier()  # every thread's partials are written before the release below
    if tl.atomic_add(counter_ptr + group_row, 1, sem="acq_rel", scope="gpu") == splits - 1:
        # Two passes over the splits' partials (they bypass L1: other programs wrote them). The first
        # finds each row's largest max; the second adds the partials rescaled to it, each split's loads
        # independent of the others' (no running rescale), only where the split holds the row's keys.
        m = tl.full((SLOTS * REP_PAD,), float("-inf"), tl.float32)
        for other in tl.range(0, splits, num_stages=3):
            m = tl.maximum(m, tl.load(m_ptr + (group_row * splits + other) * SLOTS * REP_PAD + rows, cache_modifier=".cg"),
                           propagate_nan=tl.PropagateNan.ALL)  # a NaN max (from a NaN query) makes the row NaN
        m_ref = tl.where(m == float("-inf"), 0.0, m)
        acc = tl.zeros((SLOTS * REP_PAD, BLOCK_D), dtype=tl.float32)
        l = tl.zeros((SLOTS * REP_PAD,), dtype=tl.float32)
        for other in tl.range(0, splits, num_stages=3):
            part = (group_row * splits + other) * SLOTS * REP_PAD + rows
            part_m = tl.load(m_ptr + part, cache_modifier=".cg")
            held = part_m != float("-inf")
            scale = tl.where(held, tl.exp2(part_m - m_ref), 0.0)
            l += tl.load(l_ptr + part, mask=held, other=0.0, cache_modifier=".cg") * scale
            acc += scale[:, None] * tl.load(
                acc_ptr + part[:, None] * D_HEAD + offs_d[None, :], mask=held[:, None] & d_mask[None, :], other=0.0,
                cache_modifier=".cg")
        # [slot, head] views: each span with its head's window (slot TOPK), then the gate over the slots.
        slot = tl.arange(0, SLOTS)[:, None]
        acc3 = tl.reshape(acc, (SLOTS, REP_PAD, BLOCK_D))
        m2, l2 = tl.reshape(m, (SLOTS, REP_PAD)), tl.reshape(l, (SLOTS, REP_PAD))
        w_acc = tl.sum(tl.where((slot == TOPK)[:, :, None], acc3, 0.0), axis=0)
        w_m = tl.max(tl.where(slot == TOPK, m2, float("-inf")), axis=0)
        w_l = tl.sum(tl.where(slot == TOPK, l2, 0.0), axis=0)
        both = tl.maximum(m2, w_m[None, :])
        both_ref = tl.where(both == float("-inf"), 0.0, both)
        a_span, a_window = tl.exp2(m2 - both_ref), tl.exp2(w_m[None, :] - both_ref)
        total = l2 * a_span + w_l[None, :] * a_window
        weighted = acc3 * a_span[:, :, None] + w_acc[None, :, :] * a_window[:, :, None]
        has_keys = (total > 0.0) | (total != total)  # NaN from Q2 or an attended key must show
        span_out = tl.where(has_keys[:, :, None], weighted / tl.where(has_keys, total, 1.0)[:, :, None], 0.0)
        # Gate: softmax of the chosen spans' scores per head; uniform when the head chose none.
        scores = tl.reshape(score, (SLOTS, REP_PAD))
        top = tl.max(scores, axis=0)
        any_chosen = top > float("-inf")
        gate = tl.where(any_chosen[None, :], tl.exp(scores - tl.where(any_chosen, top, 0.0)[None, :]), 1.0)
        gate = tl.where(slot < TOPK, gate, 0.0)
        gate = gate / tl.sum(gate, axis=0)[None, :]
        out = tl.sum(gate[:, :, None] * span_out, axis=0)  # [REP_PAD, BLOCK_D]
        head = tl.arange(0, REP_PAD)
        tl.store(Out_ptr + (batch * H_Q + group * REP + head)[:, None] * D_HEAD + offs_d[None, :],
                 out.to(Out_ptr.dtype.element_ty), mask=(head < REP)[:, None] & d_mask[None, :])


@triton.jit
def split_partials_kernel(
    Q1_ptr, Q2_ptr, K_ptr, V_ptr, offsets_ptr, back_ptr, forward_ptr, cache_pos_ptr, mask_ptr, span_acc_ptr,
    span_m_ptr, span_l_ptr, win_acc_ptr, win_m_ptr, win_l_ptr, chosen_ptr,
    stride_q1b, stride_q1h, stride_q2b, stride_q2h, stride_kb, stride_kh, stride_kl, stride_mb,
    H_Q, L_KV, REP, WINDOW, LAST, N_STRIPES, qk_scale,
    CHUNK: tl.constexpr, TOPK: tl.constexpr, TOPK_POW2: tl.constexpr, SLOTS: tl.constexpr,
    REP_PAD: tl.constexpr, BLOCK_S: tl.constexpr, D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr, HAS_FORWARD: tl.constexpr, UPCAST: tl.constexpr,
    PDL: tl.constexpr,
):
    """Per (split, KV head, batch): ``_split_rows``, every row's partial stored where ``gated_merge``
    reads it (a head's slot j at ((head row) * TOPK + j) * splits + split, its window at
    (head row) * splits + split; empty ones too), and the chosen scores from split 0.

    With ``PDL`` the merge launch may start at once; it waits for this grid's results."""
    if PDL:
        gdc_launch_dependents()
    score, acc, m, l = _split_rows(
        Q1_ptr, Q2_ptr, K_ptr, V_ptr, offsets_ptr, back_ptr, forward_ptr, cache_pos_ptr, mask_ptr,
        stride_q1b, stride_q1h, stride_q2b, stride_q2h, stride_kb, stride_kh, stride_kl, stride_mb,
        L_KV, REP, WINDOW, LAST, N_STRIPES, qk_scale, CHUNK, TOPK, TOPK_POW2, SLOTS, REP_PAD, BLOCK_S, D_HEAD,
        BLOCK_D, BLOCK_K, HAS_MASK, HAS_FORWARD, UPCAST,
    )
    split = tl.program_id(0)
    splits = tl.num_programs(0)
    rows = tl.arange(0, SLOTS * REP_PAD)
    row_head, row_slot = rows % REP_PAD, rows // REP_PAD
    head_row = tl.program_id(2).to(tl.int64) * H_Q + tl.program_id(1) * REP + row_head
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D_HEAD
    is_span = (row_head < REP) & (row_slot < TOPK)
    is_window = (row_head < REP) & (row_slot == TOPK)
    span_part = (head_row * TOPK + row_slot) * splits + split
    win_part = head_row * splits + split
    tl.store(span_acc_ptr + span_part[:, None] * D_HEAD + offs_d[None, :], acc, mask=is_span[:, None] & d_mask[None, :])
    tl.store(span_m_ptr + span_part, m, mask=is_span)
    tl.store(span_l_ptr + span_part, l, mask=is_span)
    tl.store(win_acc_ptr + win_part[:, None] * D_HEAD + offs_d[None, :], acc, mask=is_window[:, None] & d_mask[None, :])
    tl.store(win_m_ptr + win_part, m, mask=is_window)
    tl.store(win_l_ptr + win_part, l, mask=is_window)
    tl.store(chosen_ptr + head_row * TOPK + row_slot, score, mask=is_span & (split == 0))


@triton.jit
def split_merge_kernel(
    chosen_ptr, span_acc_ptr, span_m_ptr, span_l_ptr, win_acc_ptr, win_m_ptr, win_l_ptr, Out_ptr, H_Q, SPLITS,
    TOPK: tl.constexpr, TOPK_POW2: tl.constexpr, SPLITS_POW2: tl.constexpr, D_HEAD: tl.constexpr,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """Per (head, batch): the head's window and chosen spans merged over the splits, gated
    (``gated_merge``; a slot with no span reads no partial)."""
    row = tl.program_id(1).to(tl.int64) * H_Q + tl.program_id(0)
    if PDL:
        gdc_wait()
    slots = tl.arange(0, TOPK_POW2)
    scores = tl.load(chosen_ptr + row * TOPK + slots, mask=slots < TOPK, other=float("-inf"))
    counts = tl.where(scores > float("-inf"), SPLITS, 0)
    gated_merge(span_acc_ptr, span_m_ptr, span_l_ptr, win_acc_ptr, win_m_ptr, win_l_ptr, Out_ptr, row, scores,
                (row * TOPK + slots) * SPLITS, counts, SPLITS, TOPK, TOPK_POW2, SPLITS_POW2, SPLITS_POW2, D_HEAD,
                BLOCK_D)


class _SplitLaunch(NamedTuple):
    """What both launchers derive from their inputs: the operands, the splits and the kernels'
    shared arguments (after the operands) and constexprs."""

    q1: torch.Tensor
    q2: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor
    splits: int
    rows: int
    strides: tuple[int, ...]
    scalars: tuple
    constexprs: dict


def _split_launch(q1, q2, k, v, decode_position, attention_mask, offsets, window, topk, block_k, chunk) -> _SplitLaunch:
    """Validate ``chunk`` and the rows per program, make the operands kernel-ready and gather the
    arguments both kernels of this module take."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk: expected a positive int (key positions per program), got {chunk!r}")
    _, hq, _, dim = q1.shape
    rep = hq // k.shape[1]
    rows = one_launch_rows(rep, topk)
    if rows > MAX_SPAN_ROWS:
        raise ValueError(f"q1: {rep} query heads per KV head x (topk {topk} + the window) need {rows} rows per "
                         f"program (at most {MAX_SPAN_ROWS})")
    q1, q2 = unit_stride(q1), unit_stride(q2)
    k, v = key_value_pair(k, v)
    mask = k if attention_mask is None else mask_operand(attention_mask)  # k: never read
    strides = (q1.stride(0), q1.stride(1), q2.stride(0), q2.stride(1), k.stride(0), k.stride(1), k.stride(2),
               0 if attention_mask is None else mask.stride(0))
    scalars = (hq, k.shape[2], rep, window, decode_position.numel() - 1, offsets.numel(), LOG2E / math.sqrt(dim))
    constexprs = dict(
        CHUNK=chunk, TOPK=topk, TOPK_POW2=pow2(topk), SLOTS=pow2(topk + 1), REP_PAD=max(pow2(rep), MIN_DOT),
        D_HEAD=dim, BLOCK_D=max(pow2(dim), MIN_DOT), BLOCK_K=max(block_k, MIN_DOT.value),
        HAS_MASK=attention_mask is not None, UPCAST=q1.device.type == "cpu" and q1.dtype == torch.bfloat16,
    )
    return _SplitLaunch(q1, q2, k, v, mask, cdiv(k.shape[2], chunk), rows, strides, scalars, constexprs)


def one_launch_attention(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decode_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    offsets: torch.Tensor,
    back_table: torch.Tensor,
    forward_table: torch.Tensor | None,
    window: int,
    topk: int,
    longest_span: int,
    block_k: int = 64,
    num_warps: int = 8,
    num_stages: int = 3,
    chunk: int = 512,
    block_s: int = 64,
) -> torch.Tensor:
    """Staged decode output [B, Hq, 1, D] (semantics section 3) for validated inputs, arguments as
    ``grouped_kernels.grouped_decode_attention`` (``longest_span`` unused: spans are cut at the
    splits); ``chunk`` is the key positions per program."""
    x = _split_launch(q1, q2, k, v, decode_position, attention_mask, offsets, window, topk, block_k, chunk)
    batch, hq, _, dim = x.q1.shape
    hkv = x.k.shape[1]
    parts = batch * hkv * x.splits * x.rows
    work = torch.empty(parts * (dim + 2), dtype=torch.float32, device=x.q1.device)
    acc, m, l = work.split_with_sizes((parts * dim, parts, parts))
    counter = torch.zeros(batch * hkv, dtype=torch.int32, device=x.q1.device)
    out = torch.empty(batch, hq, 1, dim, dtype=x.q2.dtype, device=x.q1.device)
    one_launch_kernel[(x.splits, hkv, batch)](
        x.q1, x.q2, x.k, x.v, offsets, back_table, back_table if forward_table is None else forward_table,
        decode_position, x.mask, acc, m, l, counter, out, *x.strides, *x.scalars,
        **x.constexprs, BLOCK_S=block_s, HAS_FORWARD=forward_table is not None, num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def split_merge_attention(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decode_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    offsets: torch.Tensor,
    back_table: torch.Tensor,
    forward_table: torch.Tensor | None,
    window: int,
    topk: int,
    longest_span: int,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    chunk: int = 256,
    block_s: int = 64,
    pdl: bool | None = None,
) -> torch.Tensor:
    """``one_launch_attention`` with the merge in a second launch, one program per head (``pdl``:
    programmatic dependent launch, default ``hopper_or_newer``)."""
    x = _split_launch(q1, q2, k, v, decode_position, attention_mask, offsets, window, topk, block_k, chunk)
    batch, hq, _, dim = x.q1.shape
    hkv = x.k.shape[1]
    pdl = hopper_or_newer(x.q1.device) if pdl is None else pdl
    span_parts, window_parts = batch * hq * topk * x.splits, batch * hq * x.splits
    work = torch.empty((span_parts + window_parts) * (dim + 2) + batch * hq * topk, dtype=torch.float32,
                       device=x.q1.device)
    span_acc, span_m, span_l, win_acc, win_m, win_l, chosen = work.split_with_sizes(
        (span_parts * dim, span_parts, span_parts, window_parts * dim, window_parts, window_parts, batch * hq * topk))
    out = torch.empty(batch, hq, 1, dim, dtype=x.q2.dtype, device=x.q1.device)
    split_partials_kernel[(x.splits, hkv, batch)](
        x.q1, x.q2, x.k, x.v, offsets, back_table, back_table if forward_table is None else forward_table,
        decode_position, x.mask, span_acc, span_m, span_l, win_acc, win_m, win_l, chosen, *x.strides, *x.scalars,
        **x.constexprs, BLOCK_S=block_s, HAS_FORWARD=forward_table is not None, PDL=pdl, num_warps=num_warps,
        num_stages=num_stages,
    )
    split_merge_kernel[(hq, batch)](
        chosen, span_acc, span_m, span_l, win_acc, win_m, win_l, out, hq, x.splits,
        TOPK=topk, TOPK_POW2=pow2(topk), SPLITS_POW2=pow2(x.splits), D_HEAD=dim, BLOCK_D=x.constexprs["BLOCK_D"],
        PDL=pdl, num_warps=4, launch_pdl=pdl,
    )
    return out
