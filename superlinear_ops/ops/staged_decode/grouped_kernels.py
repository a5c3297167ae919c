"""Staged decode in two launches, with every key that a KV group shares read once for the group.

1. ``group_kernel`` (``group_stage``), one program per (block, KV head, batch), two kinds of blocks (and, below,
   the mask-slice or stripe-span programs): stripe blocks gather their stripe keys once and score them against the search queries of all
   ``rep`` query heads of the group in one dot (fp32 accumulation, unscaled; invalid stripes -inf),
   then keep each head's local top-``TOPK`` (score, anchor position) candidates (the keys load
   does not wait for the mask: a masked stripe's score is dropped after the dot);
   window blocks score ``WINDOW_CHUNK`` window keys against all ``rep`` attention queries of the
   group in one dot and write each head's partial softmax state (for ``stripe_spans`` under a mask
   through TMA, as its span blocks, else by pointer loads). For forward spans under a mask
   the grid also holds programs that each find the first allowed key of ``MASK_SLICE`` mask
   entries, unless one of the row's first ``MASK_HEAD`` is allowed (``span_kernel`` takes the
   minimum); for the ``stripe_spans`` decode (``stripe_spans_kernels``) it holds instead a program
   per chunk of every stripe's span, which attends it the same way (``grouped_decode_attention``
   neither launches nor compiles them).
2. ``span_kernel``, one program per (chunk, span slot, head; batch): merges the candidates into the
   head's global top-``TOPK`` (highest score first; among ties the nearest anchor, i.e. the lowest
   stripe), turns its slot's anchor into the span [qstart, qend] with the exact span-length tables
   (docs/semantics.md section 3, steps 1-3; the tables and the query are read before the wait for
   ``group_kernel``) and runs the online softmax over ``CHUNK`` keys of it (one query row padded to
   a 16-row tile: both products are tensor-core dots; where descriptors can describe K/V each block
   of keys comes whole through the tensor memory accelerator, and under a mask the block's mask
   entries, read one block ahead, drop the keys the mask hides: one mask entry read per key, the
   hidden values zeroed only in a second pass where the first one's result holds a NaN; else
   pointer loads). The head's last program
   to finish (an atomic counter) merges the window's partials once, each span's partials on top of
   them (O_j = softmax over span_j and the window, zeros when empty) and writes the gate-weighted
   sum of the O_j (steps 4-5) in Q's dtype.

Partial softmax states are (weighted values, max, sum) in the log2 domain. The short prefix
(t <= W) needs no branch: no stripe precedes the window, every span is empty and the uniform gate
returns the window attention over [0, pos]. The decode position is clamped to [0, Lkv - 1] in the
kernels. Grids and buffers depend only on shapes, never on the position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from ..span_attention.window_forward import row_descriptors
from .group_attend import MIN_DOT, _attend_keys, chosen_anchor, clamped_position, gated_merge
from .group_stage import run_group_kernel
from .grouped_plan import pow2

__all__ = ["grouped_decode_attention"]


@triton.jit
def span_kernel(
    Q2_ptr, K_ptr, V_ptr, k_desc, v_desc, cand_score_ptr, cand_anchor_ptr, back_ptr, forward_ptr, first_ptr,
    cache_pos_ptr, mask_ptr, acc_ptr, m_ptr, l_ptr, chosen_ptr, win_acc_ptr, win_m_ptr, win_l_ptr, counter_ptr,
    Out_ptr, stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_mb,
    H_Q, L_KV, REP, WINDOW, LAST, N_CANDIDATES, N_CHUNKS, N_WCHUNKS, N_SLICES, qk_scale,
    CHUNK: tl.constexpr, TOPK: tl.constexpr, TOPK_POW2: tl.constexpr,
    CAND_POW2: tl.constexpr, CHUNKS_POW2: tl.constexpr, SLICES_POW2: tl.constexpr,
    WCHUNKS_POW2: tl.constexpr, D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_FORWARD: tl.constexpr, FIRST_FROM_MASK: tl.constexpr, KV_TMA: tl.constexpr,
    UPCAST: tl.constexpr, PDL: tl.constexpr,
):
    """Per (chunk, span slot, head; batch): the online softmax over one chunk of one span; the
    head's last program to finish also merges the head's output.

    With ``PDL`` (programmatic dependent launch) it starts while ``group_kernel`` runs and waits
    for that grid's results before its first read of them."""
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    # Chunk-major order: every (head, slot) at one chunk index runs together, so the heads of a
    # group whose spans share keys (the same anchor) read them at about the same time, from L2.
    head_slot = pid % (H_Q * TOPK)
    chunk = pid // (H_Q * TOPK)
    slot = head_slot % TOPK
    head = (head_slot // TOPK).to(tl.int64)
    row = batch * H_Q + head
    pos = clamped_position(cache_pos_ptr, LAST, L_KV)
    # Reads of what group_kernel does not write go before the wait: the query and the span tables.
    # The head's query is row 0 of a MIN_DOT-row tile (the other rows are zeros, never stored).
    rows = tl.arange(0, MIN_DOT)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D_HEAD
    q = tl.load(Q2_ptr + batch * stride_qb + head * stride_qh + rows[:, None] * 0 + offs_d[None, :],
                mask=(rows[:, None] == 0) & d_mask[None, :], other=0.0)
    t = pos + 1
    back = tl.load(back_ptr + t)
    forward = tl.zeros_like(back)  # no forward reach without a forward factor
    if HAS_FORWARD:
        forward = tl.load(forward_ptr + t)  # counted from key 0: right unless the mask hides key 0
    if PDL:
        gdc_wait()
    score, anchor = chosen_anchor(cand_score_ptr, cand_anchor_ptr, row, slot, N_CANDIDATES, TOPK, CAND_POW2)
    tl.store(chosen_ptr + row * TOPK + slot, score, mask=chunk == 0)

    # The span of the chosen anchor (empty, hi < lo, when no stripe was chosen).
    lo = tl.maximum(anchor - back, 0)
    hi = anchor
    if HAS_FORWARD:
        if FIRST_FROM_MASK:  # the first allowed key: min over the slices (0 when none, as argmax)
            # Only a chunk that reaches past the anchor needs the forward length, and only a first
            # allowed key past key 0 changes it.
            if lo + chunk * CHUNK + CHUNK - 1 > anchor:
                slices = tl.arange(0, SLICES_POW2)
                first = tl.min(tl.load(first_ptr + batch * N_SLICES + slices, mask=slices < N_SLICES, other=L_KV), axis=0)
                if (first > 0) & (first < L_KV):
                    forward = tl.load(forward_ptr + t - first)  # first < window start < t
        hi = tl.minimum(anchor + forward, pos - WINDOW)  # the key before the window
    hi = tl.where(score > float("-inf"), hi, -1)
    lo = (lo + chunk * CHUNK).to(tl.int32)
    hi = tl.minimum(hi, lo + CHUNK - 1).to(tl.int32)
    acc, m, l = _attend_keys(q, K_ptr, V_ptr, k_desc, v_desc, mask_ptr, batch, head // REP, lo, hi, stride_kb,
                             stride_kh, stride_kl, stride_mb, H_Q // REP, L_KV, offs_d, d_mask, qk_scale, BLOCK_K,
                             HAS_MASK, KV_TMA, UPCAST)
    part = (batch * H_Q * TOPK + head_slot) * N_CHUNKS + chunk + rows * 0
    first_row = rows == 0
    tl.store(acc_ptr + part[:, None] * D_HEAD + offs_d[None, :], acc, mask=first_row[:, None] & d_mask[None, :])
    tl.store(m_ptr + part, m, mask=first_row)
    tl.store(l_ptr + part, l, mask=first_row)

    # The row's last program to finish (the counter was zeroed by the group kernel) merges it.
    tl.debug_barrier()  # every thread's partial is written before the release below
    finished = tl.atomic_add(counter_ptr + row, 1, sem="acq_rel", scope="gpu")
    if finished == TOPK * N_CHUNKS - 1:
        slots = tl.arange(0, TOPK_POW2)
        scores = tl.load(chosen_ptr + row * TOPK + slots, mask=slots < TOPK, other=float("-inf"), cache_modifier=".cg")
        gated_merge(acc_ptr, m_ptr, l_ptr, win_acc_ptr, win_m_ptr, win_l_ptr, Out_ptr, row, scores,
                    (row * TOPK + slots) * N_CHUNKS, tl.zeros_like(slots) + N_CHUNKS, N_WCHUNKS,
                    TOPK, TOPK_POW2, CHUNKS_POW2, WCHUNKS_POW2, D_HEAD, BLOCK_D)


def grouped_decode_attention(
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
    stripe_spans: bool = False,
) -> torch.Tensor:
    """Staged decode output [B, Hq, 1, D] (semantics section 3) for validated inputs.

    ``decode_position`` holds the decode position in its last entry (any integer dtype);
    ``offsets`` are the stripe offsets, ``back_table``/``forward_table`` the span-length tables
    (forward None when the forward factor is 0); spans hold at most ``longest_span`` keys.
    ``chunk`` (keys per span program, any positive int) and ``pdl`` (programmatic dependent launch)
    default to ``span_chunk_length`` and ``hopper_or_newer`` (sm_90+). ``num_warps``/``num_stages``
    are those of the launch that attends the spans: ``span_kernel``, or with ``stripe_spans``
    (``stripe_spans_kernels``: every stripe's span attended beside the search) ``group_kernel``.
    """
    group_tiles = dict(num_warps=num_warps, num_stages=num_stages) if stripe_spans else {}
    g = run_group_kernel(q1, q2, k, v, decode_position, attention_mask, offsets, back_table, forward_table, window,
                         topk, longest_span, block_k, chunk, block_s, pdl, stripe_spans, **group_tiles)
    if stripe_spans:
        from .stripe_spans_kernels import merge_chosen_stripes  # that module imports this one

        return merge_chosen_stripes(g, offsets, decode_position, topk)
    plan, (batch, hq, _, dim) = g.plan, q1.shape
    block_k = max(block_k, MIN_DOT.value)
    # Span blocks through TMA where descriptors can describe K/V (keys past a span or hidden by the
    # mask are dropped in the kernel), else pointer loads (hidden keys read as zeros).
    descriptors = row_descriptors(g.k, g.v, block_k)
    span_kernel[(hq * topk * plan.n_chunks, batch)](
        g.q2, g.k, g.v, *(descriptors or (g.k, g.v)), *g.candidates, back_table,
        back_table if forward_table is None else forward_table, g.first,
        decode_position, g.mask, *g.span_parts, g.chosen, *g.window_parts, g.counter, g.out,
        g.q2.stride(0), g.q2.stride(1), *g.kv_strides,
        hq, g.k.shape[2], plan.rep, window, g.last, plan.n_candidates, plan.n_chunks, plan.n_wchunks,
        plan.n_slices, g.qk_scale,
        CHUNK=plan.chunk, TOPK=topk, TOPK_POW2=pow2(topk),
        CAND_POW2=pow2(plan.n_candidates),
        SLICES_POW2=pow2(plan.n_slices), CHUNKS_POW2=pow2(plan.n_chunks), WCHUNKS_POW2=pow2(plan.n_wchunks),
        D_HEAD=dim, BLOCK_D=plan.block_d, BLOCK_K=block_k, HAS_MASK=attention_mask is not None,
        HAS_FORWARD=forward_table is not None, FIRST_FROM_MASK=g.first_from_mask, KV_TMA=descriptors is not None,
        UPCAST=g.upcast, PDL=g.pdl, num_warps=num_warps, num_stages=num_stages,
        launch_pdl=g.pdl,
    )
    return g.out
