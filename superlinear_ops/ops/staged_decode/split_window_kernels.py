"""Decode span attention split into chunks (flash-decoding) with the gate fused into the merge.

For one decode step every (batch, head) attends its window once and each of its span slots once:
1. ``segment_partials_kernel``: one program per (chunk, segment, head, batch), where a segment is
   a span slot or the window and a chunk is ``CHUNK`` consecutive keys of it; each writes its
   partial softmax state (max, sum, weighted values) in the log2 domain.
2. ``merge_kernel``: one program per (head, batch) merges the window's chunks once, then each span
   slot's chunks on top of them (O_j = softmax over span_j and the window), and returns the
   gate-weighted sum of the O_j (semantics section 3, steps 4-5) in Q's dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...launch import key_value_pair, mask_bytes, unit_stride
from ..kernel_helpers import LOG2E, online_softmax_segment, span_bounds, window_bounds


@triton.jit
def segment_partials_kernel(
    Q_ptr, K_ptr, V_ptr, qstart_ptr, qend_ptr, cache_pos_ptr, mask_ptr, Acc_ptr, M_ptr, L_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_mb,
    H_Q, L_KV, REP, WINDOW, N_CHUNKS, qk_scale,
    K_SPANS: tl.constexpr, CHUNK: tl.constexpr, D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr,
):
    chunk = tl.program_id(0)
    segment_head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    segment = segment_head % (K_SPANS + 1)  # K_SPANS is the window
    head = segment_head // (K_SPANS + 1)
    row = batch * H_Q + head
    pos = tl.minimum(tl.load(cache_pos_ptr), L_KV - 1).to(tl.int32)
    span_lo, span_hi = span_bounds(
        qstart_ptr, qend_ptr, row * K_SPANS + tl.minimum(segment, K_SPANS - 1), L_KV, pos, WINDOW
    )
    window_lo, window_hi = window_bounds(pos, WINDOW)
    is_window = segment == K_SPANS
    lo = tl.where(is_window, window_lo, span_lo) + chunk * CHUNK
    hi = tl.minimum(tl.where(is_window, window_hi, span_hi), lo + CHUNK - 1)

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D_HEAD
    q = tl.load(Q_ptr + batch * stride_qb + head * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    kv_base = batch * stride_kb + (head // REP) * stride_kh
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    m = tl.full((), float("-inf"), tl.float32)
    l = tl.zeros((), dtype=tl.float32)
    acc, m, l = online_softmax_segment(
        acc, m, l, q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, batch * stride_mb,
        lo, hi, offs_d, d_mask, qk_scale, BLOCK_K, HAS_MASK,
    )
    slot = (row * (K_SPANS + 1) + segment) * N_CHUNKS + chunk
    tl.store(Acc_ptr + slot * D_HEAD + offs_d, acc, mask=d_mask)
    tl.store(M_ptr + slot, m)
    tl.store(L_ptr + slot, l)


@triton.jit
def _merge(acc, m, l, acc2, m2, l2):
    m_new = tl.maximum(m, m2)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    a1 = tl.exp2(m - m_ref)
    a2 = tl.exp2(m2 - m_ref)
    return acc * a1 + acc2 * a2, m_new, l * a1 + l2 * a2


@triton.jit
def _merge_segment(acc, m, l, Acc_ptr, M_ptr, L_ptr, first_slot, N_CHUNKS, offs_d, d_mask, D_HEAD: tl.constexpr):
    for chunk in range(0, N_CHUNKS):
        slot = first_slot + chunk
        acc2 = tl.load(Acc_ptr + slot * D_HEAD + offs_d, mask=d_mask, other=0.0)
        acc, m, l = _merge(acc, m, l, acc2, tl.load(M_ptr + slot), tl.load(L_ptr + slot))
    return acc, m, l


@triton.jit
def merge_kernel(
    Acc_ptr, M_ptr, L_ptr, score_ptr, Out_ptr, H_Q, N_CHUNKS,
    K_SPANS: tl.constexpr, D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    head = tl.program_id(0).to(tl.int64)
    batch = tl.program_id(1).to(tl.int64)
    row = batch * H_Q + head
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D_HEAD

    # Gate weights: softmax of the chosen spans' scores; uniform when no span was chosen.
    top = tl.full((), float("-inf"), tl.float32)
    for j in tl.static_range(K_SPANS):
        top = tl.maximum(top, tl.load(score_ptr + row * K_SPANS + j))
    any_chosen = top > float("-inf")
    top = tl.where(any_chosen, top, 0.0)  # keeps exp(score - top) free of -inf - -inf
    total = tl.zeros((), dtype=tl.float32)
    for j in tl.static_range(K_SPANS):
        total += tl.where(any_chosen, tl.exp(tl.load(score_ptr + row * K_SPANS + j) - top), 1.0)

    base = row * (K_SPANS + 1) * N_CHUNKS
    window_acc, window_m, window_l = _merge_segment(
        tl.zeros((BLOCK_D,), dtype=tl.float32), tl.full((), float("-inf"), tl.float32), tl.zeros((), dtype=tl.float32),
        Acc_ptr, M_ptr, L_ptr, base + K_SPANS * N_CHUNKS, N_CHUNKS, offs_d, d_mask, D_HEAD,
    )
    out = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(K_SPANS):
        acc, m, l = _merge_segment(window_acc, window_m, window_l, Acc_ptr, M_ptr, L_ptr, base + j * N_CHUNKS,
                                   N_CHUNKS, offs_d, d_mask, D_HEAD)
        has_keys = (l > 0.0) | (l != l)  # NaN from Q2 or an attended key must show
        span_out = tl.where(has_keys, acc / tl.where(has_keys, l, 1.0), 0.0)
        weight = tl.where(any_chosen, tl.exp(tl.load(score_ptr + row * K_SPANS + j) - top), 1.0) / total
        out += weight * span_out
    tl.store(Out_ptr + row * D_HEAD + offs_d, out.to(Out_ptr.dtype.element_ty), mask=d_mask)


def split_decode_attention(
    q2: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qstart: torch.Tensor,
    qend: torch.Tensor,
    decode_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    window: int,
    scores: torch.Tensor,
    longest_span: int,
    block_k: int = 64,
    chunk: int = 256,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Gate-weighted span attention [B, Hq, 1, D] for spans qstart/qend [B, Hq, 1, K] (K >= 1)
    of at most ``longest_span`` keys, the window, and the chosen scores [B, Hq, K]."""
    batch, hq, _, dim = q2.shape
    n_spans = qstart.shape[-1]
    chunk = max(chunk, block_k)
    n_chunks = max(triton.cdiv(max(window, longest_span, 1), chunk), 1)
    q2, mask = unit_stride(q2), mask_bytes(attention_mask, q2.device)
    k, v = key_value_pair(k, v)
    partial = batch * hq * (n_spans + 1) * n_chunks
    acc = torch.empty(partial * dim, dtype=torch.float32, device=q2.device)
    m = torch.empty(partial, dtype=torch.float32, device=q2.device)
    l = torch.empty(partial, dtype=torch.float32, device=q2.device)
    block_d = triton.next_power_of_2(dim)
    segment_partials_kernel[(n_chunks, hq * (n_spans + 1), batch)](
        q2, k, v, qstart.contiguous(), qend.contiguous(), decode_position, mask, acc, m, l,
        q2.stride(0), q2.stride(1), k.stride(0), k.stride(1), k.stride(2),
        mask.stride(0) if attention_mask is not None else 0,
        hq, k.shape[2], hq // k.shape[1], window, n_chunks, LOG2E / math.sqrt(dim),
        K_SPANS=n_spans, CHUNK=chunk, D_HEAD=dim, BLOCK_D=block_d, BLOCK_K=block_k,
        HAS_MASK=attention_mask is not None, num_warps=num_warps, num_stages=num_stages,
    )
    out = torch.empty(batch, hq, 1, dim, dtype=q2.dtype, device=q2.device)
    merge_kernel[(hq, batch)](acc, m, l, scores.contiguous(), out, hq, n_chunks, K_SPANS=n_spans, D_HEAD=dim,
                              BLOCK_D=block_d, num_warps=4)
    return out
