"""Triton helpers shared by the span kernels: segment bounds and one scored key block.

Validity is folded into loop bounds (an absent segment has hi < lo, so its loop runs zero times);
masks combine block conditions only, which every Triton interpreter version accepts.
Running maxima and log-sum-exps are kept in the log2 domain: s2 = (q . k) * sm_scale * log2(e);
the tensor-core blocks hand raw q . k scores to ``online_softmax_step``, which scales them.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
NO_KEY = tl.constexpr(2**31 - 1)  # tile-range sentinel of a row that attends nothing


@triton.jit
def in_rows(offs_n, row_lo, row_hi):
    """[rows, keys]: row r attends key offs_n[j], row_lo[r] <= offs_n[j] <= row_hi[r]."""
    return (offs_n[None, :] >= row_lo[:, None]) & (offs_n[None, :] <= row_hi[:, None])


@triton.jit
def tile_range(present, row_lo, row_hi):
    """[tile_lo, tile_hi]: the keys that some ``present`` row of a tile attends (tile_hi -1 and
    tile_lo 0 when no row is present: an empty tile never starts at NO_KEY, so no loop step, which
    a pipeliner evaluates ahead, computes NO_KEY + BLOCK_N, which wraps to a negative key)."""
    tile_hi = tl.max(tl.where(present, row_hi, -1), axis=0)
    tile_lo = tl.minimum(tl.min(tl.where(present, row_lo, NO_KEY), axis=0), tile_hi + 1)
    return tile_lo, tile_hi


@triton.jit
def inner_blocks(present, row_lo, row_hi, tile_lo, tile_hi, n_blocks, BLOCK_N: tl.constexpr):
    """(first, end): the blocks first..end-1 of the ``n_blocks`` of a tile's range (block i starts
    at key tile_lo + i * BLOCK_N) whose keys every ``present`` row attends (first == end: none)."""
    inner_lo = tl.max(tl.where(present, row_lo, -1), axis=0)
    inner_hi = tl.minimum(tl.min(tl.where(present, row_hi, NO_KEY), axis=0), tile_hi)
    first = tl.minimum(tl.cdiv(tl.maximum(inner_lo - tile_lo, 0), BLOCK_N), n_blocks)
    end = tl.maximum(tl.minimum((inner_hi - tile_lo + 1) // BLOCK_N, n_blocks), first)
    return first, end


@triton.jit
def span_bounds(qstart_ptr, qend_ptr, slot, L_KV, pos, WINDOW):
    """[lo, hi] of the span in ``slot`` clipped to the keys and, when WINDOW > 0, to end before the
    window of the query at ``pos`` (as ``span_tiles.clamped_span_bounds``); hi < lo when absent."""
    lo = tl.maximum(tl.load(qstart_ptr + slot).to(tl.int32), 0)
    hi = tl.minimum(tl.load(qend_ptr + slot).to(tl.int32), L_KV - 1)
    hi = tl.where(WINDOW > 0, tl.minimum(hi, pos - WINDOW), hi)
    return lo, hi


@triton.jit
def window_bounds(pos, WINDOW):
    """[lo, hi] of the sliding window ending at ``pos``; hi < lo when WINDOW is 0."""
    lo = tl.maximum(pos - WINDOW + 1, 0)
    hi = tl.where(WINDOW > 0, pos, lo - 1)
    return lo, hi


@triton.jit
def load_key_block(K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base, offs_n, key_ok, offs_d, d_mask,
                   HAS_MASK: tl.constexpr):
    """K/V rows ``offs_n`` in their own dtype (zeros where not ``key_ok`` or masked out) and the
    per-key validity (``key_ok`` and the attention mask)."""
    if HAS_MASK:
        allowed = tl.load(mask_ptr + mask_base + offs_n, mask=key_ok, other=0)
        key_ok = key_ok & (allowed != 0)
    offsets = kv_base + offs_n[:, None].to(tl.int64) * stride_kl + offs_d[None, :]
    kv_mask = key_ok[:, None] & d_mask[None, :]
    k = tl.load(K_ptr + offsets, mask=kv_mask, other=0.0)
    v = tl.load(V_ptr + offsets, mask=kv_mask, other=0.0)
    return k, v, key_ok


@triton.jit
def finite_or_zero(x):
    """``x`` with NaN and infinite entries read as 0: how the backward kernels read Q, K and V, so
    that a non-finite value never meets a zero weight in a sum or a dot (0 * NaN is NaN) and a
    poisoned row passes no gradient (docs/semantics.md, section 2)."""
    return tl.where(tl.abs(x) < float("inf"), x, 0.0)


@triton.jit
def scored_block(
    q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base,
    start, hi, offs_d, d_mask, qk_scale,
    BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr,
):
    """Load keys/values start..start+BLOCK_K-1 (up to hi) and score them against q.

    Returns (s2, k, v, offs_k, kv_mask): s2 is -inf where a key is past hi or masked out.
    """
    offs_k = start + tl.arange(0, BLOCK_K)
    k, v, valid = load_key_block(K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base, offs_k, offs_k <= hi,
                                 offs_d, d_mask, HAS_MASK)
    k, v = k.to(tl.float32), v.to(tl.float32)
    s2 = tl.sum(k * q[None, :], axis=1) * qk_scale
    s2 = tl.where(valid, s2, float("-inf"))
    return s2, k, v, offs_k, valid[:, None] & d_mask[None, :]


@triton.jit
def tc_dot(a, b, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation: tensor cores for 16-bit inputs, exact FMAs for fp32 ones.

    ``UPCAST`` computes in fp32 instead: Triton 3.6's interpreter multiplies bf16 bit patterns.
    """
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision="ieee")
    return out


@triton.jit
def online_softmax_step(acc, m, l, s, v, qk_scale, UPCAST: tl.constexpr):
    """The running (unnormalised output ``acc``, log2 max ``m``, sum ``l``) of each row after one key
    block: raw scores ``s`` [rows, keys] (q . k, -inf where not attended) and values ``v``.

    The log2-domain score is s * qk_scale (qk_scale > 0, so the row maximum is taken before the
    scaling): each probability costs one fused multiply-add and one exp2."""
    m_new = tl.maximum(m, tl.max(s, axis=1) * qk_scale)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_ref)
    p = tl.exp2(s * qk_scale - m_ref[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    # On the GPU p is rounded to V's dtype for the tensor cores (unbiased, 2**-9 relative for bf16);
    # the interpreter's casts truncate (a 2**-9 bias), so there p stays fp32.
    acc = acc * alpha[:, None] + tc_dot(p if UPCAST else p.to(v.dtype), v, UPCAST)
    return acc, m_new, l


@triton.jit
def attend_block(
    acc, m, l, q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base,
    start, tile_hi, row_lo, row_hi, offs_d, d_mask, qk_scale,
    BLOCK_N: tl.constexpr, ROW_MASK: tl.constexpr, HAS_MASK: tl.constexpr, UPCAST: tl.constexpr,
):
    """One online-softmax step of a row tile over keys start..start+BLOCK_N-1 (up to ``tile_hi``).

    Row r attends key j when row_lo[r] <= j <= row_hi[r] and the mask allows j; without
    ``ROW_MASK`` every row attends the same keys (up to ``tile_hi``, as the mask allows). ``acc``/``m``/
    ``l`` are the running (unnormalised output, log2 max, sum) of each row.
    """
    offs_n = start + tl.arange(0, BLOCK_N)
    k, v, key_ok = load_key_block(K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base, offs_n, offs_n <= tile_hi,
                                  offs_d, d_mask, HAS_MASK)
    s = tc_dot(q, tl.trans(k), UPCAST)
    if ROW_MASK:
        s = tl.where(in_rows(offs_n, row_lo, row_hi) & key_ok[None, :], s, float("-inf"))
    else:
        s = tl.where(key_ok[None, :], s, float("-inf"))
    return online_softmax_step(acc, m, l, s, v, qk_scale, UPCAST)


@triton.jit
def allowed_keys(mask_row_ptr, start, hi, offs):
    """Which of keys start + offs lie at or before ``hi`` and are allowed by the mask row."""
    keys = start + offs
    return (keys <= hi) & (tl.load(mask_row_ptr + keys, mask=keys <= hi, other=0) != 0)


@triton.jit
def attend_described_block(
    acc, m, l, q, k_desc, v_desc, row, start, row_lo, row_hi, keep, qk_scale,
    BLOCK_N: tl.constexpr, ROW_MASK: tl.constexpr, KEEP: tl.constexpr, ZERO_V: tl.constexpr, UPCAST: tl.constexpr,
):
    """``attend_block`` for keys start..start+BLOCK_N-1 loaded whole by the tensor memory
    accelerator from ``row`` of the [keys, D] descriptors. Without ``ROW_MASK`` or ``KEEP`` every
    row attends every key of the block (no masks at all); with ``ROW_MASK`` row r attends
    [row_lo[r], row_hi[r]], and with ``KEEP`` only the keys where ``keep`` [BLOCK_N] is True (the
    attention mask). The block's other keys, loaded as they are, only meet zero weights, so the
    caller makes sure that they hold finite values or, with ``ZERO_V``, the values of the keys not
    kept are zeroed (``holds_nan``: a second pass where a first one met a NaN)."""
    k = k_desc.load([row, 0])
    v = v_desc.load([row, 0])
    if ZERO_V:
        v = tl.where(keep[:, None], v, 0.0)
    s = tc_dot(q, tl.trans(k), UPCAST)
    if ROW_MASK:
        offs_n = start + tl.arange(0, BLOCK_N)
        s = tl.where(in_rows(offs_n, row_lo, row_hi), s, float("-inf"))
    if KEEP:
        s = tl.where(keep[None, :], s, float("-inf"))
    return online_softmax_step(acc, m, l, s, v, qk_scale, UPCAST)


@triton.jit
def holds_nan(acc):
    """Whether a softmax accumulator holds a NaN: where keys came through TMA under an attention
    mask, a hidden key's zero weight met its value as loaded, and 0 times a NaN or an infinity is
    NaN (that, or an attended value that is not finite: a second pass with the hidden values zeroed
    tells them apart)."""
    return tl.max((acc != acc).to(tl.int32)) > 0  # noqa: PLR0124 - NaN test


@triton.jit
def online_softmax_segment(
    acc, m, l, q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base,
    lo, hi, offs_d, d_mask, qk_scale,
    BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr,
):
    """Online softmax (log2 domain) of one query over keys lo..hi in ``BLOCK_K`` blocks, folded into
    the running (acc, m, l)."""
    for start in range(lo, hi + 1, BLOCK_K):
        s2, k, v, offs_k, kv_mask = scored_block(
            q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base,
            start, hi, offs_d, d_mask, qk_scale, BLOCK_K, HAS_MASK,
        )
        m_new = tl.maximum(m, tl.max(s2, axis=0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_ref)
        p = tl.exp2(s2 - m_ref)
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    return acc, m, l
