"""The layer's gate in Triton (semantics section 4, step 4), forward and backward, in place of chains of
PyTorch gathers, elementwise ops and reductions over [B, Hq, Lq, topk, D] fp32 temporaries.

Rows are (b, h, q); ``BLOCK_R`` rows per program, on ``num_warps`` warps: both come from the
variant's configuration (``variants``: the ``row_blocks`` variants of the gate ops).
- Gate scores: v_j = Q1 . K[anchor_j] in fp32 (EMPTY_SCORE for an empty slot); backward
  dQ1 = sum_j dv_j K[anchor_j], and dK[anchor_j] += dv_j Q1 by relaxed fp32 atomics (a sum needs no
  ordering, and acquire-release atomics are several times slower).
- Gate: out = sum_j g_j O_j with g = softmax(v) in fp32; backward, for dOut: dO_j = g_j dOut and
  dv_j = g_j (s_j - sum_k g_k s_k) with s_j = dOut . O_j.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...buckets import next_power_of_two
from ...launch import KernelConfig, unit_stride
from . import EMPTY_SCORE as EMPTY_SLOT_SCORE

EMPTY_SCORE = tl.constexpr(EMPTY_SLOT_SCORE)


@triton.jit
def _score_rows(Q1_ptr, stride_qb, stride_qh, stride_ql, stride_kb, stride_kh, N_ROWS, H_Q, L_Q, REP,
                D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """This program's rows (b, h, q): (rows, row_ok, offs_d, d_mask, Q1 rows [BLOCK_R, BLOCK_D] fp32,
    batch, KV head, and the offset of that batch and KV head in K)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N_ROWS
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D_HEAD
    query = rows % L_Q
    head = (rows // L_Q) % H_Q
    batch = rows // L_Q // H_Q
    q1 = tl.load(Q1_ptr + (batch * stride_qb + head * stride_qh + query * stride_ql)[:, None] + offs_d[None, :],
                 mask=row_ok[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    kv_head = head // REP
    return rows, row_ok, offs_d, d_mask, q1, batch, kv_head, batch * stride_kb + kv_head * stride_kh


@triton.jit
def gate_scores_kernel(Q1_ptr, K_ptr, A_ptr, S_ptr, stride_qb, stride_qh, stride_ql, stride_kb, stride_kh, stride_kl,
                       N_ROWS, H_Q, L_Q, REP, D_HEAD: tl.constexpr, TOPK: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_R: tl.constexpr):
    rows, row_ok, offs_d, d_mask, q1, batch, kv_head, kv_base = _score_rows(
        Q1_ptr, stride_qb, stride_qh, stride_ql, stride_kb, stride_kh, N_ROWS, H_Q, L_Q, REP, D_HEAD, BLOCK_D, BLOCK_R)
    for j in tl.static_range(TOPK):
        anchor = tl.load(A_ptr + rows * TOPK + j, mask=row_ok, other=-1)
        used = anchor >= 0
        keys = tl.load(K_ptr + (kv_base + anchor * stride_kl)[:, None] + offs_d[None, :],
                       mask=used[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        score = tl.where(used, tl.sum(q1 * keys, axis=1), EMPTY_SCORE)
        tl.store(S_ptr + rows * TOPK + j, score, mask=row_ok)


@triton.jit
def gate_scores_backward_kernel(Q1_ptr, K_ptr, A_ptr, dS_ptr, dQ1_ptr, dK_ptr, stride_qb, stride_qh, stride_ql,
                                stride_kb, stride_kh, stride_kl, N_ROWS, H_Q, L_Q, REP, H_KV, L_KV,
                                D_HEAD: tl.constexpr, TOPK: tl.constexpr, BLOCK_D: tl.constexpr,
                                BLOCK_R: tl.constexpr):
    rows, row_ok, offs_d, d_mask, q1, batch, kv_head, kv_base = _score_rows(
        Q1_ptr, stride_qb, stride_qh, stride_ql, stride_kb, stride_kh, N_ROWS, H_Q, L_Q, REP, D_HEAD, BLOCK_D, BLOCK_R)
    d_q1 = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        anchor = tl.load(A_ptr + rows * TOPK + j, mask=row_ok, other=-1)
        used = anchor >= 0
        rd_used = used[:, None] & d_mask[None, :]
        d_score = tl.load(dS_ptr + rows * TOPK + j, mask=used, other=0.0)
        keys = tl.load(K_ptr + (kv_base + anchor * stride_kl)[:, None] + offs_d[None, :], mask=rd_used, other=0.0)
        d_q1 += d_score[:, None] * keys.to(tl.float32)
        key_rows = (batch * H_KV + kv_head) * L_KV + anchor  # dK is a contiguous fp32 [B, Hkv, Lkv, D]
        tl.atomic_add(dK_ptr + key_rows[:, None] * D_HEAD + offs_d[None, :], d_score[:, None] * q1, mask=rd_used,
                      sem="relaxed")
    tl.store(dQ1_ptr + rows[:, None] * D_HEAD + offs_d[None, :], d_q1.to(dQ1_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_mask[None, :])


@triton.jit
def _gate_weights(V_ptr, rows, row_ok, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr):
    """softmax(v) over each row's slots: [BLOCK_R, TOPK_PAD] fp32 (0 in padding slots)."""
    slots = tl.arange(0, TOPK_PAD)[None, :]
    v = tl.load(V_ptr + rows[:, None] * TOPK + slots, mask=row_ok[:, None] & (slots < TOPK), other=0.0)
    v = tl.where(slots < TOPK, v, float("-inf"))  # rows past the end stay finite
    e = tl.exp(v - tl.max(v, axis=1)[:, None])
    return e / tl.sum(e, axis=1)[:, None]


@triton.jit
def _slot(x, j: tl.constexpr, TOPK_PAD: tl.constexpr):
    """Column j of x [BLOCK_R, TOPK_PAD]."""
    return tl.sum(tl.where(tl.arange(0, TOPK_PAD)[None, :] == j, x, 0.0), axis=1)


@triton.jit
def gate_forward_kernel(V_ptr, O_ptr, Out_ptr, N_ROWS, D_HEAD: tl.constexpr, TOPK: tl.constexpr,
                        TOPK_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N_ROWS
    offs_d = tl.arange(0, BLOCK_D)
    rd_mask = row_ok[:, None] & (offs_d < D_HEAD)[None, :]
    g = _gate_weights(V_ptr, rows, row_ok, TOPK, TOPK_PAD)
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        o = tl.load(O_ptr + (rows[:, None] * TOPK + j) * D_HEAD + offs_d[None, :], mask=rd_mask, other=0.0)
        acc += _slot(g, j, TOPK_PAD)[:, None] * o.to(tl.float32)
    tl.store(Out_ptr + rows[:, None] * D_HEAD + offs_d[None, :], acc.to(Out_ptr.dtype.element_ty), mask=rd_mask)


@triton.jit
def gate_backward_kernel(V_ptr, O_ptr, dOut_ptr, dO_ptr, dV_ptr, N_ROWS, D_HEAD: tl.constexpr, TOPK: tl.constexpr,
                         TOPK_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N_ROWS
    offs_d = tl.arange(0, BLOCK_D)
    rd_mask = row_ok[:, None] & (offs_d < D_HEAD)[None, :]
    slots = tl.arange(0, TOPK_PAD)[None, :]
    g = _gate_weights(V_ptr, rows, row_ok, TOPK, TOPK_PAD)
    d_out = tl.load(dOut_ptr + rows[:, None] * D_HEAD + offs_d[None, :], mask=rd_mask, other=0.0).to(tl.float32)
    s = tl.zeros((BLOCK_R, TOPK_PAD), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        offsets = (rows[:, None] * TOPK + j) * D_HEAD + offs_d[None, :]
        o = tl.load(O_ptr + offsets, mask=rd_mask, other=0.0).to(tl.float32)
        s = tl.where(slots == j, tl.sum(d_out * o, axis=1)[:, None], s)
        tl.store(dO_ptr + offsets, (_slot(g, j, TOPK_PAD)[:, None] * d_out).to(dO_ptr.dtype.element_ty), mask=rd_mask)
    d_v = g * (s - tl.sum(g * s, axis=1)[:, None])
    tl.store(dV_ptr + rows[:, None] * TOPK + slots, d_v, mask=row_ok[:, None] & (slots < TOPK))


def _rows_launch(kernel, rows: int, config: KernelConfig):
    """``kernel`` over ``rows`` rows: ``config.block_r`` rows per program, on ``config.num_warps`` warps."""
    grid = (triton.cdiv(rows, config.block_r),)
    return functools.partial(kernel[grid], BLOCK_R=config.block_r, num_warps=config.num_warps)


def _gate_launch(kernel, config: KernelConfig, scores: torch.Tensor, span_out: torch.Tensor, *tensors: torch.Tensor) -> None:
    rows, topk = scores.numel() // scores.shape[-1], scores.shape[-1]
    dim = span_out.shape[-1]
    _rows_launch(kernel, rows, config)(
        scores, span_out, *tensors, rows, D_HEAD=dim, TOPK=topk, TOPK_PAD=next_power_of_two(topk),
        BLOCK_D=next_power_of_two(dim),
    )


def gate_forward(scores: torch.Tensor, span_out: torch.Tensor, dtype: torch.dtype, config: KernelConfig) -> torch.Tensor:
    """out [B, Hq, Lq, D] in ``dtype`` from scores [B, Hq, Lq, topk] (read as fp32) and span outputs
    [B, Hq, Lq, topk, D]."""
    out = torch.empty(span_out.shape[:-2] + span_out.shape[-1:], dtype=dtype, device=span_out.device)
    if out.numel():
        _gate_launch(gate_forward_kernel, config, scores.float().contiguous(), span_out.contiguous(), out)
    return out


def gate_backward(scores: torch.Tensor, span_out: torch.Tensor, grad_out: torch.Tensor, config: KernelConfig):
    """(d scores in the scores' dtype, d span outputs in their dtype) for grad_out [B, Hq, Lq, D]."""
    span_out = span_out.contiguous()
    d_span_out = torch.empty_like(span_out)
    d_scores = torch.empty(scores.shape, dtype=torch.float32, device=scores.device)
    if d_scores.numel():
        _gate_launch(gate_backward_kernel, config, scores.float().contiguous(), span_out, grad_out.contiguous(),
                     d_span_out, d_scores)
    return d_scores.to(scores.dtype), d_span_out


def gate_scores_forward(q1: torch.Tensor, k: torch.Tensor, anchors: torch.Tensor, config: KernelConfig) -> torch.Tensor:
    """v [B, Hq, Lq, topk] fp32 for Q1 [B, Hq, Lq, D], K [B, Hkv, Lkv, D] and int64 anchors."""
    q1, k, anchors = unit_stride(q1), unit_stride(k), anchors.contiguous()
    scores = torch.empty(anchors.shape, dtype=torch.float32, device=anchors.device)
    if scores.numel():
        batch, hq, lq, topk = anchors.shape
        _rows_launch(gate_scores_kernel, scores.numel() // topk, config)(
            q1, k, anchors, scores, *q1.stride()[:3], *k.stride()[:3], scores.numel() // topk, hq, lq, hq // k.shape[1],
            D_HEAD=q1.shape[-1], TOPK=topk, BLOCK_D=next_power_of_two(q1.shape[-1]),
        )
    return scores


def gate_scores_backward(q1: torch.Tensor, k: torch.Tensor, anchors: torch.Tensor, grad: torch.Tensor,
                         config: KernelConfig):
    """(dQ1 in Q1's dtype, dK in K's dtype) of ``gate_scores_forward`` for ``grad`` (read as fp32)."""
    q1, k, anchors, grad = unit_stride(q1), unit_stride(k), anchors.contiguous(), grad.to(torch.float32).contiguous()
    d_q1 = torch.empty(q1.shape, dtype=q1.dtype, device=q1.device)
    d_k = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    if anchors.numel():
        batch, hq, lq, topk = anchors.shape
        _rows_launch(gate_scores_backward_kernel, anchors.numel() // topk, config)(
            q1, k, anchors, grad, d_q1, d_k, *q1.stride()[:3], *k.stride()[:3], anchors.numel() // topk, hq, lq,
            hq // k.shape[1], k.shape[1], k.shape[2],
            D_HEAD=q1.shape[-1], TOPK=topk, BLOCK_D=next_power_of_two(q1.shape[-1]),
        )
    else:
        d_q1.zero_()
    return d_q1, d_k.to(k.dtype)
