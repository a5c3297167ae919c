"""Span-attention forward: one Triton program per (batch, query head, query, span).

Each program runs an online softmax over its span segment and then the sliding-window segment,
loops bounded by the real segment lengths (no key is ever dropped), fp32 accumulation. It writes
the output in Q's dtype and, for the backward, the log2-domain log-sum-exp (+inf for a span with
no attended key).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...launch import KernelConfig, LaunchGeometry, forward_outputs
from ..kernel_helpers import LOG2E, online_softmax_segment, span_bounds, window_bounds


@triton.jit
def span_forward_kernel(
    Q_ptr, K_ptr, V_ptr, qstart_ptr, qend_ptr, cache_pos_ptr, mask_ptr, Out_ptr, Lse_ptr,
    stride_qb, stride_qh, stride_ql,
    stride_kb, stride_kh, stride_kl,
    stride_mb,
    H_Q, L_Q, L_KV, REP, WINDOW, qk_scale,
    K_SPANS: tl.constexpr, D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    span = pid % K_SPANS
    query = pid // K_SPANS
    row = (batch * H_Q + head) * L_Q + query  # (b, h, q) row index, int64
    slot = row * K_SPANS + span

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D_HEAD
    q_ptrs = Q_ptr + batch * stride_qb + head * stride_qh + query * stride_ql + offs_d
    q = tl.load(q_ptrs, mask=d_mask, other=0.0).to(tl.float32)
    kv_base = batch * stride_kb + (head // REP) * stride_kh
    mask_base = batch * stride_mb
    pos = tl.minimum(tl.load(cache_pos_ptr + query).to(tl.int32), L_KV - 1)

    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    m = tl.full((), float("-inf"), tl.float32)
    l = tl.zeros((), dtype=tl.float32)
    lo, hi = span_bounds(qstart_ptr, qend_ptr, slot, L_KV, pos, WINDOW)
    acc, m, l = online_softmax_segment(
        acc, m, l, q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base,
        lo, hi, offs_d, d_mask, qk_scale, BLOCK_K, HAS_MASK,
    )
    lo, hi = window_bounds(pos, WINDOW)
    acc, m, l = online_softmax_segment(
        acc, m, l, q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base,
        lo, hi, offs_d, d_mask, qk_scale, BLOCK_K, HAS_MASK,
    )
    has_keys = (l > 0.0) | (l != l)  # a NaN (from Q or an attended key) must show, as in dense attention
    out = tl.where(has_keys, acc / tl.where(has_keys, l, 1.0), 0.0)
    tl.store(Out_ptr + slot * D_HEAD + offs_d, out.to(Out_ptr.dtype.element_ty), mask=d_mask)
    lse = tl.where(has_keys, m + tl.log2(tl.where(has_keys, l, 1.0)), float("inf"))
    tl.store(Lse_ptr + slot, lse)


def span_forward(
    geo: LaunchGeometry,
    config: KernelConfig,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the forward kernel; returns (out [B, Hq, Lq, K, D] in Q's dtype, lse2 [B, Hq, Lq, K] fp32).

    ``out`` may give both buffers (contiguous, those shapes and dtypes) to write into.
    """
    q, k = geo.q, geo.k
    batch, hq, lq, dim = q.shape
    n_spans = geo.qstart.shape[-1]
    out, lse = forward_outputs(geo, out)
    if out.numel() == 0:
        return out, lse
    grid = (lq * n_spans, hq, batch)
    span_forward_kernel[grid](
        q, k, geo.v, geo.qstart, geo.qend, geo.cache_position, geo.mask, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        geo.mask_stride,
        hq, lq, k.shape[2], geo.rep, geo.window, LOG2E / math.sqrt(dim),
        K_SPANS=n_spans, D_HEAD=dim, BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_K=config.block_k, HAS_MASK=geo.has_mask,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out, lse
