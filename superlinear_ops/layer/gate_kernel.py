"""The layer's gate in Triton (SPEC section 7, step 4): O = sum_j softmax(v)_j O_j and its backward,
one pass over the per-span outputs each way, instead of a chain of PyTorch elementwise ops and
reductions over [B, Hq, Lq, topk, D] fp32 temporaries.

Rows are (b, h, q); ``BLOCK_R`` rows per program. Forward: out = sum_j g_j O_j with g = softmax(v)
in fp32. Backward, for dOut: dO_j = g_j dOut and dv_j = g_j (s_j - sum_k g_k s_k) with
s_j = dOut . O_j.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..buckets import next_power_of_two

BLOCK_R = 16


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


def _launch(kernel, scores: torch.Tensor, span_out: torch.Tensor, *tensors: torch.Tensor) -> None:
    rows, topk = scores.numel() // scores.shape[-1], scores.shape[-1]
    dim = span_out.shape[-1]
    kernel[(triton.cdiv(rows, BLOCK_R),)](
        scores, span_out, *tensors, rows, D_HEAD=dim, TOPK=topk, TOPK_PAD=next_power_of_two(topk),
        BLOCK_D=next_power_of_two(dim), BLOCK_R=BLOCK_R,
    )


def gate_forward(scores: torch.Tensor, span_out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """out [B, Hq, Lq, D] in ``dtype`` from contiguous scores [B, Hq, Lq, topk] fp32 and span outputs
    [B, Hq, Lq, topk, D]."""
    out = torch.empty(span_out.shape[:-2] + span_out.shape[-1:], dtype=dtype, device=span_out.device)
    if out.numel():
        _launch(gate_forward_kernel, scores, span_out, out)
    return out


def gate_backward(scores: torch.Tensor, span_out: torch.Tensor, grad_out: torch.Tensor):
    """(d scores fp32, d span outputs in their dtype) for contiguous inputs and grad_out [B, Hq, Lq, D]."""
    d_span_out = torch.empty_like(span_out)
    d_scores = torch.empty_like(scores)
    if d_scores.numel():
        _launch(gate_backward_kernel, scores, span_out, grad_out, d_span_out, d_scores)
    return d_scores, d_span_out
