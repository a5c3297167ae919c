"""The grouped decodes' first launch, ``group_kernel``: one program per (block, KV head, batch) that
scores stripe keys against every query head of the group (each head keeps its local top-k
candidates), attends window chunks, finds the first allowed key of mask slices or (for
``stripe_spans``) attends every stripe's span; and ``run_group_kernel``, its launch."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from ...launch import hopper_or_newer, key_value_pair, unit_stride
from ..kernel_helpers import LOG2E, tc_dot, window_bounds
from ..span_attention.window_forward import row_descriptors
from . import grouped_plan
from .group_attend import MIN_DOT, NO_ANCHOR, _attend_keys, clamped_position
from .grouped_plan import WINDOW_CHUNK, launch_plan

MASK_SLICE = 4096  # mask entries per first-allowed-key program


MASK_HEAD = 256  # mask entries every stripe-span program reads beside its tables, and every first-allowed-key program first


@triton.jit
def _stripe_candidates(
    Q1_ptr, K_ptr, offsets_ptr, mask_ptr, cand_score_ptr, cand_anchor_ptr, block, group, batch, pos,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_mb, H_Q, REP, WINDOW, N_STRIPES, N_CANDIDATES,
    TOPK: tl.constexpr, BLOCK_S: tl.constexpr, REP_PAD: tl.constexpr, D_HEAD: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_MASK: tl.constexpr, UPCAST: tl.constexpr,
):
    window_start = tl.maximum(pos - WINDOW + 1, 0)
    stripes = block * BLOCK_S + tl.arange(0, BLOCK_S)
    in_table = stripes < N_STRIPES
    loc = pos + 1 - tl.load(offsets_ptr + stripes, mask=in_table, other=0)
    valid = in_table & (loc >= 0) & (loc < window_start)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D_HEAD
    # The keys load does not wait for the mask: a masked stripe's score (NaN too) is dropped below.
    keys = tl.load(
        K_ptr + batch * stride_kb + group * stride_kh + loc[:, None] * stride_kl + offs_d[None, :],
        mask=valid[:, None] & d_mask[None, :], other=0.0,
    )
    if HAS_MASK:
        valid = valid & (tl.load(mask_ptr + batch * stride_mb + loc, mask=valid, other=0) != 0)
    rows = tl.arange(0, REP_PAD)
    heads = group * REP + rows
    queries = tl.load(
        Q1_ptr + batch * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=(rows[:, None] < REP) & d_mask[None, :], other=0.0,
    )
    scores = tc_dot(queries, tl.trans(keys), UPCAST)  # [REP_PAD, BLOCK_S]
    scores = tl.where(valid[None, :], scores, float("-inf"))
    scores = tl.where(scores != scores, float("inf"), scores)  # a NaN score wins and makes the gate NaN

    first = (batch * H_Q + heads) * N_CANDIDATES + block * TOPK
    anchors = loc.to(tl.int32)  # distinct for the stripes in the table (the offsets increase)
    for j in tl.static_range(TOPK):
        best = tl.max(scores, axis=1)
        pick = tl.max(tl.where(scores == best[:, None], anchors[None, :], NO_ANCHOR), axis=1)
        tl.store(cand_score_ptr + first + j, best, mask=rows < REP)
        tl.store(cand_anchor_ptr + first + j, pick, mask=rows < REP)
        scores = tl.where(anchors[None, :] == pick[:, None], float("-inf"), scores)


@triton.jit
def _group_partial(
    Q2_ptr, K_ptr, V_ptr, k_desc, v_desc, mask_ptr, acc_ptr, m_ptr, l_ptr, group, batch, lo, hi, place, N_PLACES,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_mb, H_Q, L_KV, REP, qk_scale,
    REP_PAD: tl.constexpr, D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_MASK: tl.constexpr, KV_TMA: tl.constexpr, UPCAST: tl.constexpr,
):
    """Every head of the group attends keys lo..hi (the group's attention queries as one [REP_PAD, D]
    tile; through TMA where ``KV_TMA``); head h's partial softmax state goes to place ``place`` of
    its ``N_PLACES``."""
    rows = tl.arange(0, REP_PAD)
    heads = group * REP + rows
    row_ok = rows < REP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D_HEAD
    q = tl.load(Q2_ptr + batch * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_mask[None, :], other=0.0)
    acc, m, l = _attend_keys(q, K_ptr, V_ptr, k_desc, v_desc, mask_ptr, batch, group, lo, hi, stride_kb, stride_kh,
                             stride_kl, stride_mb, H_Q // REP, L_KV, offs_d, d_mask, qk_scale, BLOCK_K, HAS_MASK, KV_TMA,
                             UPCAST)
    part = (batch * H_Q + heads) * N_PLACES + place
    tl.store(acc_ptr + part[:, None] * D_HEAD + offs_d[None, :], acc, mask=row_ok[:, None] & d_mask[None, :])
    tl.store(m_ptr + part, m, mask=row_ok)
    tl.store(l_ptr + part, l, mask=row_ok)


@triton.jit
def _window_chunk(
    Q2_ptr, K_ptr, V_ptr, k_desc, v_desc, mask_ptr, acc_ptr, m_ptr, l_ptr, wchunk, group, batch, pos,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_mb,
    H_Q, L_KV, REP, WINDOW, N_WCHUNKS, WCHUNK, qk_scale,
    REP_PAD: tl.constexpr, D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    WINDOW_BLOCK: tl.constexpr, HAS_MASK: tl.constexpr, KV_TMA: tl.constexpr, UPCAST: tl.constexpr,
):
    """Chunk ``wchunk`` (``WCHUNK`` keys) of the window for every head of the group: through TMA in
    the descriptors' ``BLOCK_K``-key blocks where ``KV_TMA`` (no key load waits for the mask), else by
    pointer loads in ``WINDOW_BLOCK``-key blocks."""
    window_lo, window_hi = window_bounds(pos.to(tl.int32), WINDOW)
    lo = window_lo + wchunk * WCHUNK
    hi = tl.minimum(window_hi, lo + WCHUNK - 1)
    block: tl.constexpr = BLOCK_K if KV_TMA else WINDOW_BLOCK
    keys_per_head = L_KV if KV_TMA else 0  # the descriptors' rows per head (pointer loads use none)
    _group_partial(Q2_ptr, K_ptr, V_ptr, k_desc, v_desc, mask_ptr, acc_ptr, m_ptr, l_ptr, group, batch, lo, hi,
                   wchunk, N_WCHUNKS, stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_mb, H_Q,
                   keys_per_head, REP, qk_scale, REP_PAD, D_HEAD, BLOCK_D, block, HAS_MASK, KV_TMA, UPCAST)


@triton.jit
def _first_allowed(mask_ptr, start, window_start, L_KV, SLICE: tl.constexpr):
    """The first key in [start, window_start) that the mask row allows (L_KV when none), read
    ``SLICE`` entries at a time until one is found."""
    first = window_start * 0 + L_KV
    start = window_start * 0 + start  # the loop carries it as a tensor of window_start's type
    while (first == L_KV) & (start < window_start):
        keys = start + tl.arange(0, SLICE)
        read = keys < window_start
        allowed = read & (tl.load(mask_ptr + keys, mask=read, other=0) != 0)
        first = tl.min(tl.where(allowed, keys, L_KV), axis=0)
        start += SLICE
    return first


@triton.jit
def _stripe_span_chunk(
    Q2_ptr, K_ptr, V_ptr, k_desc, v_desc, offsets_ptr, back_ptr, forward_ptr, mask_ptr, acc_ptr, m_ptr, l_ptr,
    program, group, batch, pos, stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_mb,
    H_Q, L_KV, REP, WINDOW, N_STRIPES, N_SCHUNKS, SCHUNK, qk_scale,
    REP_PAD: tl.constexpr, D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    SLICE: tl.constexpr, MASK_HEAD: tl.constexpr, HAS_MASK: tl.constexpr, HAS_FORWARD: tl.constexpr,
    KV_TMA: tl.constexpr, UPCAST: tl.constexpr,
):
    """Chunk ``program % N_SCHUNKS`` (``SCHUNK`` keys) of the span of stripe ``program // N_SCHUNKS``
    for every head of the group, whether or not the search keeps that stripe: the span depends on
    the stripe alone (semantics section 3, step 3). A chunk past the span's end stores an empty partial; a
    stripe that is not valid (outside [0, window start)) stores nothing: no head can choose it.

    Under a mask the forward length counts from the row's first allowed key, which can only shorten
    the span; a chunk that ends by the anchor does not need it. The first ``MASK_HEAD`` mask entries
    and the forward lengths they would give are read beside the tables, so the chunks that need it
    wait for no further read unless the mask hides all of those keys (then it scans on). The keys
    come as ``_attend_keys`` takes them (through TMA, each block's mask entries read one block
    ahead), with no read of the chunk's mask before its first loads."""
    stripe = program // N_SCHUNKS
    chunk = program % N_SCHUNKS
    places = N_STRIPES * N_SCHUNKS  # partials per row
    t = pos + 1
    window_start = tl.maximum(pos - WINDOW + 1, 0)
    loc = t - tl.load(offsets_ptr + stripe)
    if HAS_MASK and HAS_FORWARD:
        mask_row = mask_ptr + batch * stride_mb
        head = tl.arange(0, MASK_HEAD)
        in_head = head < window_start  # only keys before the window count; then t - head > 0
        head_allowed = in_head & (tl.load(mask_row + head, mask=in_head, other=0) != 0)
        head_forward = tl.load(forward_ptr + t - head, mask=in_head, other=0)
    if (loc >= 0) & (loc < window_start):
        lo = (tl.maximum(loc - tl.load(back_ptr + t), 0) + chunk * SCHUNK).to(tl.int32)
        hi = loc
        if HAS_FORWARD:  # the forward length of a row whose first allowed key is key 0: the longest
            hi = tl.minimum(loc + tl.load(forward_ptr + t), pos - WINDOW)
        hi = tl.minimum(hi, lo + SCHUNK - 1).to(tl.int32)
        if HAS_MASK and HAS_FORWARD:
            if hi > loc:
                first = tl.min(tl.where(head_allowed, head, L_KV), axis=0).to(tl.int64)
                reach = tl.sum(tl.where(head == first, head_forward, 0), axis=0)
                if first == L_KV:  # none among the first MASK_HEAD keys
                    first = _first_allowed(mask_row, MASK_HEAD, window_start, L_KV, SLICE)
                    reach = tl.load(forward_ptr + t - first, mask=first < L_KV, other=0)
                if (first > 0) & (first < L_KV):
                    hi = tl.minimum(hi, loc + reach).to(tl.int32)
        _group_partial(Q2_ptr, K_ptr, V_ptr, k_desc, v_desc, mask_ptr, acc_ptr, m_ptr, l_ptr, group, batch, lo, hi,
                       program, places, stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_mb, H_Q, L_KV,
                       REP, qk_scale, REP_PAD, D_HEAD, BLOCK_D, BLOCK_K, HAS_MASK, KV_TMA, UPCAST)


@triton.jit
def group_kernel(
    Q1_ptr, Q2_ptr, K_ptr, V_ptr, offsets_ptr, cache_pos_ptr, mask_ptr, cand_score_ptr, cand_anchor_ptr,
    win_acc_ptr, win_m_ptr, win_l_ptr, counter_ptr, first_ptr, back_ptr, forward_ptr, span_acc_ptr, span_m_ptr,
    span_l_ptr, k_desc, v_desc,
    stride_q1b, stride_q1h, stride_q2b, stride_q2h, stride_kb, stride_kh, stride_kl, stride_mb,
    H_Q, L_KV, REP, WINDOW, LAST, N_STRIPES, N_BLOCKS, N_CANDIDATES, N_WCHUNKS, WCHUNK, N_SLICES,
    N_SCHUNKS, SCHUNK, qk_scale,
    TOPK: tl.constexpr, BLOCK_S: tl.constexpr, REP_PAD: tl.constexpr, D_HEAD: tl.constexpr,
    BLOCK_D: tl.constexpr, WINDOW_BLOCK: tl.constexpr, SLICE: tl.constexpr, MASK_HEAD: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr, HAS_FORWARD: tl.constexpr, STRIPE_SPANS: tl.constexpr,
    KV_TMA: tl.constexpr, WINDOW_TMA: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
):
    """Per (program, KV head, batch): a block of stripe candidates, a chunk of the window (through
    TMA where ``WINDOW_TMA``, else by pointer loads), and then with ``STRIPE_SPANS`` a chunk of one
    stripe's span (``SCHUNK`` keys in ``BLOCK_K``-key blocks, through TMA where ``KV_TMA``, else by
    pointer loads), else (forward spans under a mask) the first allowed key of ``SLICE`` mask
    entries. Program 0 of each group also zeroes its heads' finished-program counters for
    ``span_kernel``."""
    if PDL:
        gdc_launch_dependents()  # span_kernel may start launching; it waits for this grid's results
    pid = tl.program_id(0)
    group = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    pos = clamped_position(cache_pos_ptr, LAST, L_KV)
    rows = tl.arange(0, REP_PAD)
    tl.store(counter_ptr + batch * H_Q + group * REP + rows, 0, mask=(rows < REP) & (rows * 0 + pid == 0))
    if pid < N_BLOCKS:
        _stripe_candidates(
            Q1_ptr, K_ptr, offsets_ptr, mask_ptr, cand_score_ptr, cand_anchor_ptr, pid, group, batch, pos,
            stride_q1b, stride_q1h, stride_kb, stride_kh, stride_kl, stride_mb, H_Q, REP, WINDOW, N_STRIPES,
            N_CANDIDATES, TOPK, BLOCK_S, REP_PAD, D_HEAD, BLOCK_D, HAS_MASK, UPCAST,
        )
    elif pid < N_BLOCKS + N_WCHUNKS:
        _window_chunk(
            Q2_ptr, K_ptr, V_ptr, k_desc, v_desc, mask_ptr, win_acc_ptr, win_m_ptr, win_l_ptr, pid - N_BLOCKS, group,
            batch, pos, stride_q2b, stride_q2h, stride_kb, stride_kh, stride_kl, stride_mb,
            H_Q, L_KV, REP, WINDOW, N_WCHUNKS, WCHUNK, qk_scale,
            REP_PAD, D_HEAD, BLOCK_D, BLOCK_K, WINDOW_BLOCK, HAS_MASK, WINDOW_TMA, UPCAST,
        )
    elif STRIPE_SPANS:
        _stripe_span_chunk(
            Q2_ptr, K_ptr, V_ptr, k_desc, v_desc, offsets_ptr, back_ptr, forward_ptr, mask_ptr, span_acc_ptr,
            span_m_ptr, span_l_ptr, pid - N_BLOCKS - N_WCHUNKS, group, batch, pos,
            stride_q2b, stride_q2h, stride_kb, stride_kh, stride_kl, stride_mb,
            H_Q, L_KV, REP, WINDOW, N_STRIPES, N_SCHUNKS, SCHUNK, qk_scale,
            REP_PAD, D_HEAD, BLOCK_D, BLOCK_K, SLICE, MASK_HEAD, HAS_MASK, HAS_FORWARD, KV_TMA, UPCAST,
        )
    else:  # mask slices dealt round-robin over the groups
        # Only keys before the window count: a first allowed key at or past the window start leaves
        # no stripe valid, so no span reads it (L_KV: none found, as for an empty row). The load
        # stops at that start rounded up to 16 keys (16-key runs keep the loads vectorised). Every
        # program reads the row's first MASK_HEAD entries (the same ones: from L2) and its own slice
        # only when none of those is allowed: the usual row (ones, holes, short left padding) has
        # its first allowed key there, and the rest of the mask is not read at all.
        piece = (pid - N_BLOCKS - N_WCHUNKS) * tl.num_programs(1) + group
        window_start = pos + 1 - WINDOW
        limit = tl.minimum((window_start + 15) // 16 * 16, L_KV)
        mask_row = mask_ptr + batch * stride_mb
        head = tl.arange(0, MASK_HEAD)
        head_allowed = (head < limit) & (tl.load(mask_row + head, mask=head < limit, other=0) != 0) & (head < window_start)
        head_first = tl.min(tl.where(head_allowed, head, L_KV), axis=0)
        keys = piece * SLICE + tl.arange(0, SLICE)
        read = (keys < limit) & (head_first == L_KV)
        allowed = read & (tl.load(mask_row + keys, mask=read, other=0) != 0) & (keys < window_start)
        first = tl.minimum(head_first, tl.min(tl.where(allowed, keys, L_KV), axis=0))
        tl.store(first_ptr + batch * N_SLICES + piece, first, mask=piece < N_SLICES)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def mask_operand(attention_mask: torch.Tensor) -> torch.Tensor:
    """The keep-mask as the kernels read it, never copied unless its columns are strided: a bool
    mask as its uint8 view (one byte per key), an integer mask in its own dtype (converting it would
    be one more pass over the whole mask every step)."""
    mask = unit_stride(attention_mask)
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


class GroupStage(NamedTuple):
    """What ``group_kernel`` leaves for the launch after it, and the operands and buffers both share."""

    q2: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor  # the keep-mask as the kernels read it (K, never read, without one)
    kv_strides: tuple[int, int, int, int]  # K/V batch, head and key strides, the mask's row stride
    plan: grouped_plan.LaunchPlan
    span_parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # span partials: acc, m, l
    window_parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # window partials: acc, m, l
    chosen: torch.Tensor  # each (row, slot)'s chosen score (span_kernel)
    candidates: tuple[torch.Tensor, torch.Tensor]  # candidate scores and anchors
    counter: torch.Tensor  # finished-program counters, zeroed by group_kernel
    first: torch.Tensor  # first allowed key per mask slice
    out: torch.Tensor
    last: int  # index of the decode position in its tensor
    qk_scale: float
    first_from_mask: bool
    upcast: bool
    pdl: bool


def run_group_kernel(
    q1: torch.Tensor, q2: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decode_position: torch.Tensor,
    attention_mask: torch.Tensor | None, offsets: torch.Tensor, back_table: torch.Tensor,
    forward_table: torch.Tensor | None, window: int, topk: int, longest_span: int, block_k: int, chunk: int | None,
    block_s: int, pdl: bool | None, stripe_spans: bool, num_warps: int = 4, num_stages: int = 3,
) -> GroupStage:
    """Launch ``group_kernel`` (``num_warps``, ``num_stages``) over buffers sized for the launch that
    follows (arguments as ``grouped_decode_attention``): stripe candidates and window partials, and
    with ``stripe_spans`` every stripe's span partials too."""
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk: expected a positive int (keys per span program), got {chunk!r}")
    batch, hq, _, dim = q1.shape
    hkv, lkv = k.shape[1], k.shape[2]
    device = q1.device
    block_k = max(block_k, MIN_DOT.value)  # a forced smaller block_k still compiles
    q1, q2 = unit_stride(q1), unit_stride(q2)
    k, v = key_value_pair(k, v)
    mask = k if attention_mask is None else mask_operand(attention_mask)  # k: never read
    mask_stride = 0 if attention_mask is None else mask.stride(0)
    has_forward = forward_table is not None
    first_from_mask = has_forward and attention_mask is not None

    plan = launch_plan(batch, hq, hkv, lkv, dim, topk, window, offsets.numel(), longest_span, block_k, chunk,
                       block_s, first_from_mask, MASK_SLICE, _multiprocessors(device), stripe_spans)
    work = torch.empty(sum(plan.work_sizes), dtype=torch.float32, device=device)
    span_acc, span_m, span_l, win_acc, win_m, win_l, chosen, cand_score = work.split_with_sizes(plan.work_sizes)
    counts = torch.empty(sum(plan.count_sizes), dtype=torch.int32, device=device)
    cand_anchor, counter, first = counts.split_with_sizes(plan.count_sizes)
    out = torch.empty(batch, hq, 1, dim, dtype=q2.dtype, device=device)

    last = decode_position.numel() - 1
    kv_strides = (k.stride(0), k.stride(1), k.stride(2), mask_stride)
    qk_scale = LOG2E / math.sqrt(dim)
    upcast = device.type == "cpu" and q1.dtype == torch.bfloat16  # see _dot
    pdl = hopper_or_newer(device) if pdl is None else pdl
    programs = plan.n_blocks + plan.n_wchunks + plan.slice_programs + plan.stripe_programs
    # Stripe-span blocks through TMA where descriptors can describe K/V; the constexprs only
    # stripe-span programs read stay fixed without them, so grouped's block_k adds no compilation.
    # Under a mask the window's blocks come through them too, so no K/V load waits for its mask
    # entries (pointer loads there wait behind the stripe-span programs' mask head). Without a mask,
    # and for grouped's window at long contexts, pointer loads are the faster.
    descriptors = row_descriptors(k, v, block_k) if stripe_spans else None
    span_block = block_k if stripe_spans else MIN_DOT.value
    group_kernel[(programs, hkv, batch)](
        q1, q2, k, v, offsets, decode_position, mask, cand_score, cand_anchor, win_acc, win_m, win_l, counter, first,
        back_table, back_table if forward_table is None else forward_table, span_acc, span_m, span_l,
        *(descriptors or (k, v)),
        q1.stride(0), q1.stride(1), q2.stride(0), q2.stride(1), *kv_strides,
        hq, lkv, plan.rep, window, last, offsets.numel(), plan.n_blocks, plan.n_candidates, plan.n_wchunks,
        WINDOW_CHUNK, plan.n_slices, plan.n_chunks, plan.chunk, qk_scale,
        TOPK=topk, BLOCK_S=block_s, REP_PAD=plan.rep_pad, D_HEAD=dim, BLOCK_D=plan.block_d, WINDOW_BLOCK=WINDOW_CHUNK,
        SLICE=MASK_SLICE, MASK_HEAD=MASK_HEAD, BLOCK_K=span_block, HAS_MASK=attention_mask is not None,
        HAS_FORWARD=has_forward, STRIPE_SPANS=stripe_spans, KV_TMA=descriptors is not None,
        WINDOW_TMA=descriptors is not None and attention_mask is not None, UPCAST=upcast, PDL=pdl,
        num_warps=num_warps, num_stages=num_stages,
    )
    return GroupStage(q2, k, v, mask, kv_strides, plan, (span_acc, span_m, span_l), (win_acc, win_m, win_l), chosen,
                      (cand_score, cand_anchor), counter, first, out, last, qk_scale, first_from_mask, upcast, pdl)
