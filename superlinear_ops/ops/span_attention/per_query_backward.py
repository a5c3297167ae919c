"""Span-attention backward: per-span or fused-span programs, shared or split dK/dV.

One kernel serves the four variants through two compile-time switches:
- SPANS_PER_PROGRAM = 1 (per-span: a program per (b, h, q, span)) or K (fused-span: a program
  per (b, h, q) that walks every span and reads each window key once for all of them);
- SPLIT_DKV: dK/dV go by atomics into per-query-head fp32 buffers [B, Hq, Lkv, D], summed over
  each group afterwards, instead of straight into the shared [B, Hkv, Lkv, D] buffers.
With the forward's log-sum-exp and delta = rowsum(dO * O), every block is a single pass:
p = exp2(s2 - lse2), dS = p * (dO.v - delta), dQ += dS k, dK += dS q, dV += p dO.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...launch import KernelConfig, LaunchGeometry
from ..kernel_helpers import LOG2E, finite_or_zero, load_key_block, span_bounds, window_bounds


@triton.jit
def _backward_segment(
    dq, q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base, lo, hi,
    dO_ptr, Lse_ptr, Delta_ptr, first_slot, dK_ptr, dV_ptr, dkv_base,
    offs_d, d_mask, qk_scale, sm_scale,
    N_SLOTS: tl.constexpr, D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr,
):
    """Gradients of keys lo..hi for the N_SLOTS span outputs starting at first_slot (q: [1, BLOCK_D])."""
    for start in range(lo, hi + 1, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        k, v, valid = load_key_block(K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base, offs_k, offs_k <= hi,
                                     offs_d, d_mask, HAS_MASK)
        k, v = finite_or_zero(k.to(tl.float32)), finite_or_zero(v.to(tl.float32))
        s2 = tl.where(valid, tl.sum(k * q, axis=1) * qk_scale, float("-inf"))
        kv_mask = valid[:, None] & d_mask[None, :]
        ds = tl.zeros((BLOCK_K,), dtype=tl.float32)
        dv = tl.zeros((BLOCK_K, BLOCK_D), dtype=tl.float32)
        for j in tl.static_range(N_SLOTS):
            slot = first_slot + j
            lse = tl.load(Lse_ptr + slot)
            live = lse == lse  # a poisoned (NaN) span passes no gradient
            delta = tl.load(Delta_ptr + slot)
            do = tl.load(dO_ptr + slot * D_HEAD + offs_d, mask=d_mask, other=0.0).to(tl.float32)
            p = tl.where(live, tl.exp2(s2 - lse), 0.0)
            dp = tl.sum(v * do[None, :], axis=1)
            ds += tl.where(live, p * (dp - delta), 0.0)
            dv += tl.where(live, p[:, None] * do[None, :], 0.0)
        dq += tl.sum(ds[:, None] * k, axis=0)
        dkv_offsets = dkv_base + offs_k[:, None].to(tl.int64) * D_HEAD + offs_d[None, :]
        tl.atomic_add(dK_ptr + dkv_offsets, ds[:, None] * q * sm_scale, mask=kv_mask, sem="relaxed")
        tl.atomic_add(dV_ptr + dkv_offsets, dv, mask=kv_mask, sem="relaxed")
    return dq


@triton.jit
def span_backward_kernel(
    Q_ptr, K_ptr, V_ptr, qstart_ptr, qend_ptr, cache_pos_ptr, mask_ptr,
    dO_ptr, Lse_ptr, Delta_ptr, dQ_ptr, dK_ptr, dV_ptr,
    stride_qb, stride_qh, stride_ql,
    stride_kb, stride_kh, stride_kl,
    stride_mb,
    H_Q, L_Q, L_KV, REP, WINDOW, qk_scale, sm_scale,
    K_SPANS: tl.constexpr, SPANS_PER_PROGRAM: tl.constexpr, SPLIT_DKV: tl.constexpr,
    D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    programs_per_query: tl.constexpr = K_SPANS // SPANS_PER_PROGRAM
    query = pid // programs_per_query
    row = (batch * H_Q + head) * L_Q + query
    first_slot = row * K_SPANS + (pid % programs_per_query) * SPANS_PER_PROGRAM

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D_HEAD
    q_ptrs = Q_ptr + batch * stride_qb + head * stride_qh + query * stride_ql + offs_d
    # q as one [1, BLOCK_D] row, broadcast once: re-broadcasting a 1-D q in each segment's loop
    # makes Triton 3.6's layout pass fail ("operand does not dominate") at 1 or 2 warps, fused spans.
    q = finite_or_zero(tl.load(q_ptrs, mask=d_mask, other=0.0).to(tl.float32))[None, :]
    kv_head = head // REP
    kv_base = batch * stride_kb + kv_head * stride_kh
    if SPLIT_DKV:
        dkv_base = (batch * H_Q + head) * L_KV * D_HEAD
    else:
        dkv_base = (batch * (H_Q // REP) + kv_head) * L_KV * D_HEAD
    mask_base = batch * stride_mb
    pos = tl.minimum(tl.load(cache_pos_ptr + query).to(tl.int32), L_KV - 1)

    dq = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(SPANS_PER_PROGRAM):
        lo, hi = span_bounds(qstart_ptr, qend_ptr, first_slot + j, L_KV, pos, WINDOW)
        dq = _backward_segment(
            dq, q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base, lo, hi,
            dO_ptr, Lse_ptr, Delta_ptr, first_slot + j, dK_ptr, dV_ptr, dkv_base,
            offs_d, d_mask, qk_scale, sm_scale, 1, D_HEAD, BLOCK_D, BLOCK_K, HAS_MASK,
        )
    lo, hi = window_bounds(pos, WINDOW)
    dq = _backward_segment(
        dq, q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base, lo, hi,
        dO_ptr, Lse_ptr, Delta_ptr, first_slot, dK_ptr, dV_ptr, dkv_base,
        offs_d, d_mask, qk_scale, sm_scale, SPANS_PER_PROGRAM, D_HEAD, BLOCK_D, BLOCK_K, HAS_MASK,
    )
    dq_ptrs = dQ_ptr + row * D_HEAD + offs_d
    if SPANS_PER_PROGRAM == K_SPANS:
        tl.store(dq_ptrs, dq * sm_scale, mask=d_mask)
    else:
        tl.atomic_add(dq_ptrs, dq * sm_scale, mask=d_mask, sem="relaxed")


def span_backward(
    geo: LaunchGeometry,
    config: KernelConfig,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    *,
    fused_spans: bool,
    split_dkv: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dQ, dK, dV) in the input dtypes for the forward that produced ``out``/``lse``."""
    q, k = geo.q, geo.k
    batch, hq, lq, dim = q.shape
    hkv, lkv = k.shape[1], k.shape[2]
    n_spans = geo.qstart.shape[-1]
    split = split_dkv and geo.rep > 1
    grad_out = grad_out.contiguous()
    delta = (grad_out.float() * out.float()).sum(dim=-1).contiguous()
    dq = torch.zeros(batch, hq, lq, dim, device=q.device, dtype=torch.float32)
    dkv_heads = hq if split else hkv
    dk = torch.zeros(batch, dkv_heads, lkv, dim, device=q.device, dtype=torch.float32)
    dv = torch.zeros_like(dk)
    if q.numel() and n_spans:
        spans_per_program = n_spans if fused_spans else 1
        grid = (lq * (n_spans // spans_per_program), hq, batch)
        span_backward_kernel[grid](
            q, k, geo.v, geo.qstart, geo.qend, geo.cache_position, geo.mask,
            grad_out, lse, delta, dq, dk, dv,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            geo.mask_stride,
            hq, lq, lkv, geo.rep, geo.window, LOG2E / math.sqrt(dim), 1.0 / math.sqrt(dim),
            K_SPANS=n_spans, SPANS_PER_PROGRAM=spans_per_program, SPLIT_DKV=split,
            D_HEAD=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_K=config.block_k,
            HAS_MASK=geo.has_mask, num_warps=config.num_warps, num_stages=config.num_stages,
        )
    if split:
        dk = dk.view(batch, hkv, geo.rep, lkv, dim).sum(dim=2)
        dv = dv.view(batch, hkv, geo.rep, lkv, dim).sum(dim=2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(geo.v.dtype)
