"""Triton helpers shared by the span kernels: segment bounds and one scored key block.

Validity is folded into loop bounds (an absent segment has hi < lo, so its loop runs zero times);
masks combine block conditions only, which every Triton interpreter version accepts.
Scores are kept in the log2 domain: s2 = (q . k) * sm_scale * log2(e).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


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
def scored_block(
    q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base,
    start, hi, offs_d, d_mask, qk_scale,
    BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr,
):
    """Load keys/values start..start+BLOCK_K-1 (up to hi) and score them against q.

    Returns (s2, k, v, offs_k, kv_mask): s2 is -inf where a key is past hi or masked out.
    """
    offs_k = start + tl.arange(0, BLOCK_K)
    valid = offs_k <= hi
    if HAS_MASK:
        allowed = tl.load(mask_ptr + mask_base + offs_k, mask=valid, other=0)
        valid = valid & (allowed != 0)
    offsets = kv_base + offs_k[:, None].to(tl.int64) * stride_kl + offs_d[None, :]
    kv_mask = valid[:, None] & d_mask[None, :]
    k = tl.load(K_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
    v = tl.load(V_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
    s2 = tl.sum(k * q[None, :], axis=1) * qk_scale
    s2 = tl.where(valid, s2, float("-inf"))
    return s2, k, v, offs_k, kv_mask


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
