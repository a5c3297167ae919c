"""Staged decode in three launches with each span key read once per KV group, however many of the
group's heads and span slots attend it.

1. ``group_stage.group_kernel``, as the ``grouped`` variant launches it: stripe candidates,
   the window's partials and, under a mask, the mask slices' first allowed keys.
2. ``group_spans_kernel``, a grid of (programs, KV head, batch) that runs in one wave, whose
   programs walk the chunks of ``CHUNK`` key positions (program p takes chunks p, p + programs,
   ...). A program holds one row per (head h, slot j) of the group (row j * rep + h; rep x topk
   rows padded to a power of two), takes each head's top-``TOPK`` candidates (as
   ``group_attend.chosen_anchor``) and their spans (as ``span_kernel``) once, and attends the
   keys of each of its chunks that some row's span holds (a chunk that none holds costs a few
   comparisons): per block one [rows, D] x [D, BLOCK_K] and one [rows, BLOCK_K] x [BLOCK_K, D]
   dot, each row masked to its own span (``_attend_rows_block``). Heads of a group that choose
   overlapping spans (model M at 64K: 48 spans of up to 1.8K keys within the group's 63K keys
   before the window) read those keys once, not once per head and slot: with random inputs the
   span keys and values of one decode step take 49 MB instead of 87 MB at 64K, 317 MB instead of
   400 MB at 1M.

3. ``span_merge_kernel``, one program per (head, batch): the head's spans found again and their
   partials merged (``gated_merge``: the window once, each span on top of it, the gate), every head
   at once. (Merging a head in the program that completes its partials left up to ``rep`` merges
   one after another in one program, each the latency of a few dependent loads: the step's slowest
   program.)

Row (h, j)'s span leaves a partial in each chunk it meets, at place chunk - lo // CHUNK of its
cdiv(longest span + CHUNK - 1, CHUNK).

Keys come by pointer loads, only those from the chunk's first span key to its last one, and no
load waits for the mask: under one, each block's mask entries (one byte per key) are read beside
its K/V and only drop the hidden keys' scores. A key that one row does not attend (hidden, or
outside its span but in another row's) still meets that row's zero weight in the dot, so a NaN
or an infinity there would reach it (0 times either is NaN): where an accumulator holds a NaN
the chunk is attended again with the non-finite values read as 0 (16-key blocks, one stage), and
the rows that attend one are NaN (the reference: NaN, or an infinity for an infinite value).
Grids and buffers depend only on shapes, never on the position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..kernel_helpers import allowed_keys, finite_or_zero, holds_nan, in_rows, load_key_block, online_softmax_step, tc_dot, tile_range
from .group_attend import MIN_DOT, NO_ANCHOR, anchored_span, clamped_position, gated_merge
from .group_stage import _multiprocessors, run_group_kernel
from .grouped_plan import MAX_SPAN_ROWS, cdiv, pow2, span_chunk_length, span_rows

__all__ = ["group_spans_attention"]

# Programs per multiprocessor per launch (grid: at most this many times the multiprocessors, over
# all KV groups and batch rows): two 64-row programs with 3-stage 64-key K/V tiles fit an sm_90
# multiprocessor's shared memory, so the grid runs in one wave and each program walks its chunks.
PROGRAMS_PER_MULTIPROCESSOR = 2


@triton.jit
def _chosen_spans(
    cand_score_ptr, cand_anchor_ptr, back_ptr, forward_ptr, first_ptr, row_head, row_slot, group, batch, pos,
    H_Q, REP, WINDOW, L_KV, N_CANDIDATES, N_SLICES,
    TOPK: tl.constexpr, REP_PAD: tl.constexpr, CAND_POW2: tl.constexpr, SLICES_POW2: tl.constexpr,
    HAS_FORWARD: tl.constexpr, FIRST_FROM_MASK: tl.constexpr,
):
    """Per row (head ``row_head``, slot ``row_slot``): the slot's chosen score (-inf: none, so for
    every row past rep x topk, whose slot is topk or more) and its span [lo, hi] (hi < lo when none). The candidates are merged once per head of the group."""
    heads = tl.arange(0, REP_PAD)
    cands = tl.arange(0, CAND_POW2)
    live = (heads[:, None] < REP) & (cands[None, :] < N_CANDIDATES)
    index = (batch * H_Q + group * REP + heads)[:, None] * N_CANDIDATES + cands[None, :]
    scores = tl.load(cand_score_ptr + index, mask=live, other=float("-inf"))
    anchors = tl.load(cand_anchor_ptr + index, mask=live, other=NO_ANCHOR)
    of_head = row_head[:, None] == heads[None, :]  # [rows, REP_PAD]
    score = tl.full(row_head.shape, float("-inf"), tl.float32)
    anchor = tl.zeros(row_head.shape, tl.int32)
    for j in tl.static_range(TOPK):
        best = tl.max(scores, axis=1)
        pick = tl.max(tl.where(scores == best[:, None], anchors, NO_ANCHOR), axis=1)
        score = tl.where(row_slot == j, tl.max(tl.where(of_head, best[None, :], float("-inf")), axis=1), score)
        anchor = tl.where(row_slot == j, tl.max(tl.where(of_head, pick[None, :], NO_ANCHOR), axis=1), anchor)
        scores = tl.where(anchors == pick[:, None], float("-inf"), scores)

    first = 0
    if FIRST_FROM_MASK:  # the first allowed key: min over the slices (L_KV when none)
        slices = tl.arange(0, SLICES_POW2)
        first = tl.min(tl.load(first_ptr + batch * N_SLICES + slices, mask=slices < N_SLICES, other=L_KV), axis=0)
    lo, hi = anchored_span(anchor, score, back_ptr, forward_ptr, pos, first, WINDOW, L_KV, HAS_FORWARD)
    return score, lo, hi


@triton.jit
def _attend_rows_block(
    acc, m, l, bad, q, K_ptr, V_ptr, kv_base, stride_kl, mask_row_ptr, start, key_hi, row_lo, row_hi,
    offs_d, d_mask, qk_scale, BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr, CLEAN: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One online-softmax step over keys start..start+BLOCK_K-1 (up to ``key_hi``): row r attends
    key j when row_lo[r] <= j <= row_hi[r] and, with ``HAS_MASK``, the mask row allows j. The K/V
    loads do not wait for the mask entries: hidden keys are loaded as they are and only their
    scores dropped. With ``CLEAN`` non-finite values are read as 0 and ``bad`` [rows] marks the rows
    that attend one (else ``bad`` is returned as given)."""
    offs = tl.arange(0, BLOCK_K)
    offs_n = start + offs
    k, v, _ = load_key_block(K_ptr, V_ptr, kv_base, stride_kl, K_ptr, 0, offs_n, offs_n <= key_hi, offs_d, d_mask,
                             False)
    attended = in_rows(offs_n, row_lo, row_hi)
    if HAS_MASK:
        attended = attended & allowed_keys(mask_row_ptr, start, key_hi, offs)[None, :]
    if CLEAN:
        finite = tl.min(tl.where(tl.abs(v.to(tl.float32)) < float("inf"), 1, 0), axis=1) > 0  # [BLOCK_K]
        bad = bad | (tl.max(tl.where(attended & ~finite[None, :], 1, 0), axis=1) > 0)
        v = finite_or_zero(v)
    s = tl.where(attended, tc_dot(q, tl.trans(k), UPCAST), float("-inf"))
    acc, m, l = online_softmax_step(acc, m, l, s, v, qk_scale, UPCAST)
    return acc, m, l, bad


@triton.jit
def attend_row_ranges(
    q, K_ptr, V_ptr, kv_base, stride_kl, mask_row_ptr, present, row_lo, row_hi, offs_d, d_mask, qk_scale,
    BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr, UPCAST: tl.constexpr,
):
    """Online softmax (acc, m, l; log2 domain) of each ``present`` row of ``q`` [rows, D] over its keys
    row_lo..row_hi (as the mask row allows with ``HAS_MASK``), all rows in one pass over the keys from
    the first any row attends to the last, ``BLOCK_K`` at a time (``_attend_rows_block``).

    A key that one row does not attend still meets that row's zero weight in the dot, so a NaN or
    an infinity there would reach it: where the result holds a NaN the keys are attended again with
    the non-finite values read as 0 (16-key blocks, one stage), and the rows that attend one are NaN."""
    key_lo, key_hi = tile_range(present, row_lo, row_hi)
    acc = tl.zeros((q.shape[0], q.shape[1]), dtype=tl.float32)
    m = tl.full((q.shape[0],), float("-inf"), tl.float32)
    l = tl.zeros((q.shape[0],), dtype=tl.float32)
    bad = row_lo < row_lo
    for start in range(key_lo, key_hi + 1, BLOCK_K):
        acc, m, l, bad = _attend_rows_block(acc, m, l, bad, q, K_ptr, V_ptr, kv_base, stride_kl, mask_row_ptr,
                                            start, key_hi, row_lo, row_hi, offs_d, d_mask, qk_scale, BLOCK_K,
                                            HAS_MASK, False, UPCAST)
    if holds_nan(acc):  # a zero weight times a NaN or an infinity, or an attended one: tell them apart
        acc = tl.zeros((q.shape[0], q.shape[1]), dtype=tl.float32)
        m = tl.full((q.shape[0],), float("-inf"), tl.float32)
        l = tl.zeros((q.shape[0],), dtype=tl.float32)
        # In MIN_DOT-key blocks and one stage: this rare pass then needs fewer registers than
        # the first (sm_90, 64 rows, 64-key blocks on 4 warps: 180 bytes of spill stores, not 1920).
        for start in tl.range(key_lo, key_hi + 1, MIN_DOT, num_stages=1):
            acc, m, l, bad = _attend_rows_block(acc, m, l, bad, q, K_ptr, V_ptr, kv_base, stride_kl, mask_row_ptr,
                                                start, key_hi, row_lo, row_hi, offs_d, d_mask, qk_scale,
                                                MIN_DOT, HAS_MASK, True, UPCAST)
        acc = tl.where(bad[:, None], float("nan"), acc)
    return acc, m, l


@triton.jit
def group_spans_kernel(
    Q2_ptr, K_ptr, V_ptr, cand_score_ptr, cand_anchor_ptr, back_ptr, forward_ptr, first_ptr, cache_pos_ptr,
    mask_ptr, acc_ptr, m_ptr, l_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_mb,
    H_Q, L_KV, REP, WINDOW, LAST, N_CANDIDATES, N_PLACES, N_SLICES, N_KEY_CHUNKS, qk_scale,
    CHUNK: tl.constexpr, TOPK: tl.constexpr, ROWS: tl.constexpr,
    REP_PAD: tl.constexpr, CAND_POW2: tl.constexpr, SLICES_POW2: tl.constexpr,
    D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_FORWARD: tl.constexpr, FIRST_FROM_MASK: tl.constexpr, UPCAST: tl.constexpr,
    PDL: tl.constexpr,
):
    """Per (program, KV head, batch): the group's spans once, then every (head, slot) span over the
    keys of chunks program, program + programs, ... of the ``N_KEY_CHUNKS`` (a partial per span
    met; chunks that no span meets cost a few comparisons).

    With ``PDL`` it starts while ``group_kernel`` runs and waits for that grid's results before its
    first read of them; the merge launch may start at once and waits for this grid's."""
    if PDL:
        gdc_launch_dependents()
    group = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    pos = clamped_position(cache_pos_ptr, LAST, L_KV)
    rows = tl.arange(0, ROWS)
    row_head, row_slot = rows % REP, rows // REP
    live = rows < REP * TOPK
    heads = group * REP + row_head
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D_HEAD
    # The query is read before the wait: group_kernel does not write it.
    q = tl.load(Q2_ptr + batch * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=live[:, None] & d_mask[None, :], other=0.0)
    if PDL:
        gdc_wait()
    score, lo, hi = _chosen_spans(
        cand_score_ptr, cand_anchor_ptr, back_ptr, forward_ptr, first_ptr, row_head, row_slot, group, batch, pos,
        H_Q, REP, WINDOW, L_KV, N_CANDIDATES, N_SLICES, TOPK, REP_PAD, CAND_POW2, SLICES_POW2, HAS_FORWARD,
        FIRST_FROM_MASK,
    )
    kv_base = batch * stride_kb + group * stride_kh
    mask_row = mask_ptr + batch * stride_mb
    for chunk in range(tl.program_id(0), N_KEY_CHUNKS, tl.num_programs(0)):
        # This chunk's keys of each row's span, and the keys from the first of them to the last.
        row_lo = tl.maximum(lo, chunk * CHUNK)
        row_hi = tl.minimum(hi, chunk * CHUNK + CHUNK - 1)
        present = live & (row_lo <= row_hi)
        if tl.max(present.to(tl.int32), axis=0) > 0:
            acc, m, l = attend_row_ranges(q, K_ptr, V_ptr, kv_base, stride_kl, mask_row, present, row_lo, row_hi,
                                          offs_d, d_mask, qk_scale, BLOCK_K, HAS_MASK, UPCAST)
            part = ((batch * H_Q + heads) * TOPK + row_slot) * N_PLACES + chunk - lo // CHUNK
            tl.store(acc_ptr + part[:, None] * D_HEAD + offs_d[None, :], acc,
                     mask=present[:, None] & d_mask[None, :])
            tl.store(m_ptr + part, m, mask=present)
            tl.store(l_ptr + part, l, mask=present)


@triton.jit
def span_merge_kernel(
    cand_score_ptr, cand_anchor_ptr, back_ptr, forward_ptr, first_ptr, cache_pos_ptr, acc_ptr, m_ptr, l_ptr,
    win_acc_ptr, win_m_ptr, win_l_ptr, Out_ptr,
    H_Q, L_KV, REP, WINDOW, LAST, N_CANDIDATES, N_PLACES, N_WCHUNKS, N_SLICES,
    CHUNK: tl.constexpr, TOPK: tl.constexpr, TOPK_POW2: tl.constexpr, REP_PAD: tl.constexpr,
    CAND_POW2: tl.constexpr, PLACES_POW2: tl.constexpr, SLICES_POW2: tl.constexpr, WCHUNKS_POW2: tl.constexpr,
    D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr, HAS_FORWARD: tl.constexpr, FIRST_FROM_MASK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Per (head, batch): the head's chosen spans again (``_chosen_spans``), each span's partials
    (one per chunk it meets) merged with the window's under the gate (``gated_merge``)."""
    head = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    row = batch * H_Q + head
    pos = clamped_position(cache_pos_ptr, LAST, L_KV)
    if PDL:
        gdc_wait()
    slots = tl.arange(0, TOPK_POW2)
    score, lo, hi = _chosen_spans(
        cand_score_ptr, cand_anchor_ptr, back_ptr, forward_ptr, first_ptr, slots * 0 + head % REP, slots, head // REP,
        batch, pos, H_Q, REP, WINDOW, L_KV, N_CANDIDATES, N_SLICES, TOPK, REP_PAD, CAND_POW2, SLICES_POW2, HAS_FORWARD,
        FIRST_FROM_MASK,
    )
    places = tl.where(lo <= hi, hi // CHUNK - lo // CHUNK + 1, 0)  # the chunks each span meets
    gated_merge(acc_ptr, m_ptr, l_ptr, win_acc_ptr, win_m_ptr, win_l_ptr, Out_ptr, row, score,
                (row * TOPK + slots) * N_PLACES, places, N_WCHUNKS, TOPK, TOPK_POW2, PLACES_POW2, WCHUNKS_POW2,
                D_HEAD, BLOCK_D)


def group_spans_attention(
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
    chunk: int | None = None,
    block_s: int = 64,
    pdl: bool | None = None,
) -> torch.Tensor:
    """Staged decode output [B, Hq, 1, D] (semantics section 3) for validated inputs, arguments as
    ``grouped_kernels.grouped_decode_attention``; ``chunk`` is the keys per span program (a chunk
    of key positions), by default ``span_chunk_length`` of one span of all the keys per KV group."""
    batch, hq, _, dim = q1.shape
    hkv, lkv = k.shape[1], k.shape[2]
    if chunk is None:
        chunk = span_chunk_length(lkv, batch * hkv, _multiprocessors(q1.device), block_k)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk: expected a positive int (keys per span program), got {chunk!r}")
    rows = span_rows(hq // hkv, topk)
    if rows > MAX_SPAN_ROWS:
        raise ValueError(f"q1: {hq // hkv} query heads per KV head x topk {topk} need {rows} rows per program "
                         f"(at most {MAX_SPAN_ROWS})")
    # A span of at most longest_span keys meets at most cdiv(longest_span + chunk - 1, chunk) chunks:
    # group_kernel sizes the span partials for spans that long.
    g = run_group_kernel(q1, q2, k, v, decode_position, attention_mask, offsets, back_table, forward_table, window,
                         topk, longest_span + chunk - 1, block_k, chunk, block_s, pdl, stripe_spans=False)
    plan = g.plan
    key_chunks = cdiv(lkv, chunk)
    programs = min(key_chunks, cdiv(PROGRAMS_PER_MULTIPROCESSOR * _multiprocessors(q1.device), batch * hkv))
    forward = back_table if forward_table is None else forward_table  # (never read without forward spans)
    group_spans_kernel[(programs, hkv, batch)](
        g.q2, g.k, g.v, *g.candidates, back_table, forward, g.first, decode_position, g.mask, *g.span_parts,
        g.q2.stride(0), g.q2.stride(1), *g.kv_strides,
        hq, lkv, plan.rep, window, g.last, plan.n_candidates, plan.n_chunks, plan.n_slices, key_chunks, g.qk_scale,
        CHUNK=chunk, TOPK=topk, ROWS=rows, REP_PAD=plan.rep_pad, CAND_POW2=pow2(plan.n_candidates),
        SLICES_POW2=pow2(plan.n_slices), D_HEAD=dim, BLOCK_D=plan.block_d, BLOCK_K=max(block_k, MIN_DOT.value),
        HAS_MASK=attention_mask is not None, HAS_FORWARD=forward_table is not None,
        FIRST_FROM_MASK=g.first_from_mask, UPCAST=g.upcast, PDL=g.pdl, num_warps=num_warps, num_stages=num_stages,
        launch_pdl=g.pdl,
    )
    span_merge_kernel[(hq, batch)](
        *g.candidates, back_table, forward, g.first, decode_position, *g.span_parts, *g.window_parts, g.out,
        hq, lkv, plan.rep, window, g.last, plan.n_candidates, plan.n_chunks, plan.n_wchunks, plan.n_slices,
        CHUNK=chunk, TOPK=topk, TOPK_POW2=pow2(topk), REP_PAD=plan.rep_pad, CAND_POW2=pow2(plan.n_candidates),
        PLACES_POW2=pow2(plan.n_chunks), SLICES_POW2=pow2(plan.n_slices), WCHUNKS_POW2=pow2(plan.n_wchunks),
        D_HEAD=dim, BLOCK_D=plan.block_d, HAS_FORWARD=forward_table is not None, FIRST_FROM_MASK=g.first_from_mask,
        PDL=g.pdl, num_warps=4, launch_pdl=g.pdl,
    )
    return g.out
