"""The tensor-core decode kernels' shared device code: the clamped decode position, a head's chosen anchor,
attention over a range of keys by pointer loads or through TMA descriptors, and the gated merge of
the partial softmax states (weighted values, max, sum; log2 domain) into the output."""

from __future__ import annotations

import triton
import triton.language as tl

from ..kernel_helpers import allowed_keys, attend_block, attend_described_block, holds_nan
from . import grouped_plan

NO_ANCHOR = tl.constexpr(-1)  # candidate anchor that loses every tie (ties go to the nearest anchor: the lowest stripe)


MIN_DOT = tl.constexpr(grouped_plan.MIN_DOT)  # smallest tl.dot extent


@triton.jit
def clamped_position(cache_pos_ptr, LAST, L_KV):
    """pos = the last cache position clamped to [0, L_KV - 1], as int64."""
    pos = tl.load(cache_pos_ptr + LAST).to(tl.int64)
    return tl.maximum(tl.minimum(pos, L_KV - 1), 0)


@triton.jit
def chosen_anchor(cand_score_ptr, cand_anchor_ptr, row, slot, N_CANDIDATES,
                   TOPK: tl.constexpr, CAND_POW2: tl.constexpr):
    """(score, anchor) of the head's ``slot``-th best candidate (score -inf: no anchor)."""
    offs = tl.arange(0, CAND_POW2)
    live = offs < N_CANDIDATES
    scores = tl.load(cand_score_ptr + row * N_CANDIDATES + offs, mask=live, other=float("-inf"))
    anchors = tl.load(cand_anchor_ptr + row * N_CANDIDATES + offs, mask=live, other=NO_ANCHOR)
    score = tl.full((), float("-inf"), tl.float32)
    anchor = tl.full((), 0, tl.int32)
    for j in tl.static_range(TOPK):
        best = tl.max(scores, axis=0)
        pick = tl.max(tl.where(scores == best, anchors, NO_ANCHOR), axis=0)
        score = tl.where(slot == j, best, score)
        anchor = tl.where(slot == j, pick, anchor)
        scores = tl.where(anchors == pick, float("-inf"), scores)
    return score, anchor


@triton.jit
def anchored_span(anchor, score, back_ptr, forward_ptr, pos, first, WINDOW, L_KV, HAS_FORWARD: tl.constexpr):
    """[lo, hi] of the span of each ``anchor`` (semantics section 3, step 3; hi = -1 where ``score``
    is -inf: no span), its lengths from the exact tables: the forward one counted from the row's
    first allowed key ``first`` (from key 0 when it is 0 or ``L_KV``, none found) and cut before the
    window."""
    t = pos + 1
    lo = tl.maximum(anchor - tl.load(back_ptr + t), 0)
    hi = anchor.to(tl.int64)
    if HAS_FORWARD:
        from_key = tl.where((first > 0) & (first < L_KV), first, 0)  # first < window start < t
        hi = tl.minimum(anchor + tl.load(forward_ptr + t - from_key), pos - WINDOW)  # the key before the window
    hi = tl.where(score > float("-inf"), hi, -1)
    return lo.to(tl.int32), hi.to(tl.int32)


@triton.jit
def _attend(
    q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base, lo, hi, offs_d, d_mask, qk_scale,
    BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr, UPCAST: tl.constexpr,
):
    """Online softmax of the query rows q [R, BLOCK_D] over keys lo..hi (none when hi < lo).

    Both products are dots (R >= 16), so Triton stages the K/V tiles through shared memory over
    ``num_stages`` and keeps few registers per key. Returns (acc [R, BLOCK_D], m [R], l [R]), log2 domain.
    """
    acc = tl.zeros((q.shape[0], q.shape[1]), dtype=tl.float32)
    m = tl.full((q.shape[0],), float("-inf"), tl.float32)
    l = tl.zeros((q.shape[0],), dtype=tl.float32)
    for start in range(lo, hi + 1, BLOCK_K):
        acc, m, l = attend_block(acc, m, l, q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base, start, hi, lo, hi,
                                 offs_d, d_mask, qk_scale, BLOCK_K, False, HAS_MASK, UPCAST)
    return acc, m, l


@triton.jit
def _attend_described(q, k_desc, v_desc, desc_row, lo, hi, mask_row_ptr, qk_scale, BLOCK_K: tl.constexpr,
                      HAS_MASK: tl.constexpr, ZERO_V: tl.constexpr, UPCAST: tl.constexpr):
    """``_attend`` with each block of keys loaded whole by the tensor memory accelerator from row
    ``desc_row`` + its first key of the [keys, D] descriptors; keys past ``hi`` and, with
    ``HAS_MASK``, keys the mask row at ``mask_row_ptr`` hides get zero weights (``attend_described_block``).
    Without a mask the values past ``hi`` in the last block are zeroed; under one the values of
    the keys past ``hi`` or hidden are zeroed only with ``ZERO_V``, whose loop (a rare second pass)
    runs in one stage. Under a mask each block's mask entries are read one block ahead, beside the
    loads they decide; entries wider than 32 bits (an int64 mask) are read with their own block
    instead: in flight a block ahead they held twice the registers (sm_90, 4K stripe_spans
    group_kernel: 193 registers against 166 for a bool mask, two resident programs per
    multiprocessor instead of three)."""
    acc = tl.zeros((q.shape[0], q.shape[1]), dtype=tl.float32)
    m = tl.full((q.shape[0],), float("-inf"), tl.float32)
    l = tl.zeros((q.shape[0],), dtype=tl.float32)
    offs = tl.arange(0, BLOCK_K)
    if HAS_MASK and mask_row_ptr.dtype.element_ty.primitive_bitwidth > 32:
        for start in tl.range(lo, hi + 1, BLOCK_K, num_stages=1 if ZERO_V else None):
            acc, m, l = attend_described_block(acc, m, l, q, k_desc, v_desc, desc_row + start, start, lo, hi,
                                               allowed_keys(mask_row_ptr, start, hi, offs), qk_scale, BLOCK_K, False,
                                               True, ZERO_V, UPCAST)
    elif HAS_MASK:
        keep = allowed_keys(mask_row_ptr, lo, hi, offs)
        for start in tl.range(lo, hi + 1, BLOCK_K, num_stages=1 if ZERO_V else None):
            keep_ahead = allowed_keys(mask_row_ptr, start + BLOCK_K, hi, offs)
            acc, m, l = attend_described_block(acc, m, l, q, k_desc, v_desc, desc_row + start, start, lo, hi, keep,
                                               qk_scale, BLOCK_K, False, True, ZERO_V, UPCAST)
            keep = keep_ahead
    else:
        whole_end = lo + tl.maximum(hi - lo + 1, 0) // BLOCK_K * BLOCK_K  # blocks lo.. whole_end - 1 lie in the span
        for start in range(lo, whole_end, BLOCK_K):
            acc, m, l = attend_described_block(acc, m, l, q, k_desc, v_desc, desc_row + start, start, lo, hi, None,
                                               qk_scale, BLOCK_K, False, False, False, UPCAST)
        if whole_end <= hi:
            acc, m, l = attend_described_block(acc, m, l, q, k_desc, v_desc, desc_row + whole_end, whole_end, lo, hi,
                                               whole_end + offs <= hi, qk_scale, BLOCK_K, False, True, True, UPCAST)
    return acc, m, l


@triton.jit
def _attend_keys(
    q, K_ptr, V_ptr, k_desc, v_desc, mask_ptr, batch, kv_head, lo, hi, stride_kb, stride_kh, stride_kl, stride_mb,
    H_KV, L_KV, offs_d, d_mask, qk_scale,
    BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr, KV_TMA: tl.constexpr, UPCAST: tl.constexpr,
):
    """Online softmax of the query rows q over keys lo..hi of KV head ``kv_head`` of batch row
    ``batch`` (as the mask row allows with ``HAS_MASK``): through TMA where ``KV_TMA``, else by
    pointer loads (K/V rows that no descriptor describes, e.g. batch rows expanded from one).

    Under a mask TMA loads the hidden keys (and those past ``hi`` in the last block) too, and their
    zero weights first meet their values as loaded: that adds nothing unless one of them holds a
    NaN or an infinity, which must not reach the output and makes it NaN (0 times either). So
    where the result holds a NaN (that, or an attended value that is not finite) the keys are
    attended again with the hidden values zeroed; the common case never takes the values through
    registers for that select."""
    kv_base = batch * stride_kb + kv_head * stride_kh
    mask_base = batch * stride_mb
    if KV_TMA:
        desc_row = ((batch * H_KV + kv_head) * L_KV).to(tl.int32)
        acc, m, l = _attend_described(q, k_desc, v_desc, desc_row, lo, hi, mask_ptr + mask_base, qk_scale,
                                      BLOCK_K, HAS_MASK, False, UPCAST)
        if HAS_MASK:
            if holds_nan(acc):  # a zero weight times a NaN or an infinity
                acc, m, l = _attend_described(q, k_desc, v_desc, desc_row, lo, hi, mask_ptr + mask_base, qk_scale,
                                              BLOCK_K, True, True, UPCAST)
    else:
        acc, m, l = _attend(q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base, lo, hi, offs_d, d_mask,
                            qk_scale, BLOCK_K, HAS_MASK, UPCAST)
    return acc, m, l


@triton.jit
def _merged_partials(acc_ptr, m_ptr, l_ptr, first, count, offs_d, d_mask,
                     COUNT_POW2: tl.constexpr, D_HEAD: tl.constexpr):
    """Softmax state (acc, m, l) of ``count`` consecutive partials merged at once.

    The loads bypass L1: other programs wrote these partials during this launch.
    """
    offs = tl.arange(0, COUNT_POW2)
    live = offs < count
    m = tl.load(m_ptr + first + offs, mask=live, other=float("-inf"), cache_modifier=".cg")
    m_max = tl.max(m, axis=0)
    scale = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    l = tl.sum(tl.load(l_ptr + first + offs, mask=live, other=0.0, cache_modifier=".cg") * scale, axis=0)
    acc = tl.load(acc_ptr + (first + offs)[:, None] * D_HEAD + offs_d[None, :],
                  mask=live[:, None] & d_mask[None, :], other=0.0, cache_modifier=".cg")
    return tl.sum(acc * scale[:, None], axis=0), m_max, l


@triton.jit
def gated_merge(
    span_acc_ptr, span_m_ptr, span_l_ptr, win_acc_ptr, win_m_ptr, win_l_ptr, Out_ptr, row, scores, firsts, counts,
    N_WCHUNKS,
    TOPK: tl.constexpr, TOPK_POW2: tl.constexpr, CHUNKS_POW2: tl.constexpr, WCHUNKS_POW2: tl.constexpr,
    D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Row ``row``'s output: the window merged once, each span's chunks on top of it, gate-weighted.

    Per slot (vectors [TOPK_POW2]): the chosen score (-inf: no span), the index of its first
    partial and how many consecutive partials it has."""
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D_HEAD

    # Gate: softmax of the chosen spans' scores; uniform when no span was chosen.
    slots = tl.arange(0, TOPK_POW2)
    top = tl.max(scores, axis=0)
    any_chosen = top > float("-inf")
    weights = tl.where(any_chosen, tl.exp(scores - tl.where(any_chosen, top, 0.0)), 1.0)
    weights = tl.where(slots < TOPK, weights, 0.0)
    weights = weights / tl.sum(weights, axis=0)

    w_acc, w_m, w_l = _merged_partials(win_acc_ptr, win_m_ptr, win_l_ptr, row * N_WCHUNKS, N_WCHUNKS,
                                       offs_d, d_mask, WCHUNKS_POW2, D_HEAD)
    out = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        first = tl.sum(tl.where(slots == j, firsts, 0), axis=0)
        count = tl.sum(tl.where(slots == j, counts, 0), axis=0)
        s_acc, s_m, s_l = _merged_partials(span_acc_ptr, span_m_ptr, span_l_ptr, first, count, offs_d, d_mask,
                                           CHUNKS_POW2, D_HEAD)
        m = tl.maximum(w_m, s_m)
        m_ref = tl.where(m == float("-inf"), 0.0, m)
        a_w, a_s = tl.exp2(w_m - m_ref), tl.exp2(s_m - m_ref)
        l = w_l * a_w + s_l * a_s
        acc = w_acc * a_w + s_acc * a_s
        has_keys = (l > 0.0) | (l != l)  # NaN from Q2 or an attended key must show
        span_out = tl.where(has_keys, acc / tl.where(has_keys, l, 1.0), 0.0)
        out += tl.sum(tl.where(slots == j, weights, 0.0), axis=0) * span_out
    tl.store(Out_ptr + row * D_HEAD + offs_d, out.to(Out_ptr.dtype.element_ty), mask=d_mask)
