"""Tensor-core span-attention backward for training: window once per query, spans in shared key tiles.

With p_j = exp2(s2 - lse2_j) and delta_j = rowsum(dO_j * O_j), every block of keys is one pass:
dS = p (dO.v - delta), dQ += dS k, dK += dS^T q (both times sm_scale), dV += p^T dO.

1. ``combine_rows_kernel`` (one pass over O, dO and Q): delta_j per (b, h, q, j) and, per (b, h, q),
   c = min of the finite lse2_j, w_j = exp2(c - lse2_j) (0 for +inf), dO* = sum_j w_j dO_j and
   delta* = sum_j w_j delta_j. Every span's lse includes all window keys, so the window keys'
   gradients summed over the K spans are one flash-backward row with P = exp2(s2 - c) <= 1. It writes
   q (finite), dO*, c and delta* at each query's place in the window kernels' order of positions
   (``window_tables``), so that their tiles are contiguous rows (TMA in the dK/dV kernel).
2. ``span_tile_backward_kernel``: one program per (tile of ``span_block_m`` triples sorted by
   (span start // ``span_sort_block``, span end), see span_tiles.py; (batch, KV head) group). It
   gathers the rows' q (by their sorted place), dO_j, lse2_j, delta_j, streams the K/V blocks of the tile's key range with tensor-core dots and per-row masks,
   adds each block's dK/dV with one atomic add per tile and key block into fp32 buffers, and its
   dQ rows once at the end (the K spans of a query live in different tiles).
3. window_backward.py: sliding-window flash backward for the window part, which adds the span
   part from the fp32 buffers and writes dQ/dK/dV in the input dtypes.

Keys nobody attends (past the tile range, masked, uninitialised cache tail) are loaded as 0 and
every per-(row, key) term goes through ``tl.where``, so they never reach a gradient. The kernels
read Q and K with NaN and infinities as 0 (docs/semantics.md, section 2) from one pass over each
(``finite_keys`` before the kernels; Q in ``combine_rows_kernel``), not from a select on every key
block in the loops (a measurable share of the span kernel's time).
No host synchronisation: grids and buffers depend on shapes only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

import torch
import triton
import triton.language as tl

from ...launch import LaunchGeometry, check_tile_config, key_value_pair
from ..kernel_helpers import LOG2E, finite_or_zero, in_rows, load_key_block, tc_dot, tile_range
from .span_tiles import span_tile_plan
from .window_backward import operand, window_backward, window_tables

SPAN_TC_BACKWARD_TUNABLES = (  # the names of a configuration (the variant declares their values)
    "window_block_m", "window_block_n", "window_warps", "window_stages", "span_block_m", "span_block_n", "span_warps",
    "span_stages", "window_head_split", "span_sort_block",
)


@triton.jit
def combine_rows_kernel(
    O_ptr, dO_ptr, Lse_ptr, Q_ptr, rank_ptr, Delta_ptr, Qs_ptr, dOs_ptr, C_ptr, Ds_ptr,
    stride_qb, stride_qh, stride_ql, N_ROWS, H_Q, L_Q,
    K_SPANS: tl.constexpr, D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N_ROWS
    offs_d = tl.arange(0, BLOCK_D)
    rd_mask = row_ok[:, None] & (offs_d < D_HEAD)[None, :]
    # (b, h, q) of each row and its place in the window kernels' sorted order
    query = rows % L_Q
    head = (rows // L_Q) % H_Q
    batch = rows // (L_Q * H_Q)
    place = rows - query + tl.load(rank_ptr + query, mask=row_ok, other=0)
    q = tl.load(Q_ptr + (batch * stride_qb + head * stride_qh + query * stride_ql)[:, None] + offs_d[None, :],
                mask=rd_mask, other=0.0)
    sorted_offsets = place[:, None] * D_HEAD + offs_d[None, :]
    tl.store(Qs_ptr + sorted_offsets, finite_or_zero(q), mask=rd_mask)
    c = tl.full((BLOCK_R,), float("inf"), tl.float32)
    for j in tl.static_range(K_SPANS):
        lse = tl.load(Lse_ptr + rows * K_SPANS + j, mask=row_ok, other=float("inf"))
        c = tl.minimum(c, tl.where(lse == lse, lse, float("inf")))  # a poisoned (NaN) span passes no gradient
    dos = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    delta_s = tl.zeros((BLOCK_R,), dtype=tl.float32)
    c_ref = tl.where(c < float("inf"), c, 0.0)  # no inf - inf below
    for j in tl.static_range(K_SPANS):
        slot = rows * K_SPANS + j
        lse = tl.load(Lse_ptr + slot, mask=row_ok, other=float("inf"))
        finite = lse < float("inf")
        w = tl.where(finite, tl.exp2(c_ref - tl.where(finite, lse, 0.0)), 0.0)
        offsets = slot[:, None] * D_HEAD + offs_d[None, :]
        o = tl.load(O_ptr + offsets, mask=rd_mask, other=0.0).to(tl.float32)
        do = tl.load(dO_ptr + offsets, mask=rd_mask, other=0.0).to(tl.float32)
        delta = tl.sum(o * do, axis=1)
        tl.store(Delta_ptr + slot, delta, mask=row_ok)
        dos += tl.where(w[:, None] > 0.0, w[:, None] * do, 0.0)
        delta_s += tl.where(w > 0.0, w * delta, 0.0)
    tl.store(dOs_ptr + sorted_offsets, dos.to(dOs_ptr.dtype.element_ty), mask=rd_mask)
    tl.store(C_ptr + place, c, mask=row_ok)
    tl.store(Ds_ptr + place, delta_s, mask=row_ok)


@triton.jit
def span_tile_backward_kernel(
    Qs_ptr, rank_ptr, K_ptr, V_ptr, order_ptr, lo_ptr, hi_ptr, mask_ptr, dO_ptr, Lse_ptr, Delta_ptr,
    dQ_ptr, dK_ptr, dV_ptr,
    stride_kb, stride_kh, stride_kl, stride_mb,
    H_KV, L_Q, L_KV, N_TRIPLES, REP, qk_scale, sm_scale,
    K_SPANS: tl.constexpr, D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    group = tl.program_id(1).to(tl.int64)
    batch = group // H_KV
    kv_head = group % H_KV
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < N_TRIPLES
    plan = group * N_TRIPLES + offs_m
    triple = tl.load(order_ptr + plan, mask=row_ok, other=0).to(tl.int64)
    lo = tl.load(lo_ptr + plan, mask=row_ok, other=0)
    hi = tl.load(hi_ptr + plan, mask=row_ok, other=-1)
    present = hi >= lo
    tile_lo, tile_hi = tile_range(present, lo, hi)

    head = kv_head * REP + triple // (L_Q * K_SPANS)
    query = (triple // K_SPANS) % L_Q
    slot = group * N_TRIPLES + triple  # flat index into [B, Hq, Lq, K]
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D_HEAD
    rd_mask = row_ok[:, None] & d_mask[None, :]
    # q from the finite rows in the window kernels' sorted order (combine_rows_kernel): query's place
    q_rows = (batch * H_KV * REP + head) * L_Q + tl.load(rank_ptr + query, mask=row_ok, other=0)
    q = tl.load(Qs_ptr + q_rows[:, None] * D_HEAD + offs_d[None, :], mask=rd_mask, other=0.0)
    do = tl.load(dO_ptr + slot[:, None] * D_HEAD + offs_d[None, :], mask=rd_mask, other=0.0)
    lse = tl.load(Lse_ptr + slot, mask=row_ok, other=float("inf"))
    live = lse == lse  # a poisoned (NaN) row passes no gradient
    delta = tl.load(Delta_ptr + slot, mask=row_ok, other=0.0)

    kv_base = batch * stride_kb + kv_head * stride_kh
    dkv_base = group * L_KV * D_HEAD
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for start in range(tile_lo, tile_hi + 1, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        in_range = offs_n <= tile_hi
        k, v, key_ok = load_key_block(K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, batch * stride_mb, offs_n,
                                in_range, offs_d, d_mask, HAS_MASK)
        attend = in_rows(offs_n, lo, hi) & (key_ok[None, :] & live[:, None])
        s2 = tc_dot(q, tl.trans(k), UPCAST) * qk_scale
        p = tl.where(attend, tl.exp2(s2 - lse[:, None]), 0.0)
        dp = tc_dot(do, tl.trans(v), UPCAST)
        ds = tl.where(attend, p * (dp - delta[:, None]), 0.0)
        dq += tc_dot(operand(ds, k, UPCAST), k, UPCAST)
        dk = tc_dot(tl.trans(operand(ds, q, UPCAST)), q, UPCAST) * sm_scale
        dv = tc_dot(tl.trans(operand(p, do, UPCAST)), do, UPCAST)
        offsets = dkv_base + offs_n[:, None].to(tl.int64) * D_HEAD + offs_d[None, :]
        nd_mask = in_range[:, None] & d_mask[None, :]
        tl.atomic_add(dK_ptr + offsets, dk, mask=nd_mask, sem="relaxed")
        tl.atomic_add(dV_ptr + offsets, dv, mask=nd_mask, sem="relaxed")
    rows = slot // K_SPANS  # (b, h, q)
    dq_mask = (row_ok & present)[:, None] & d_mask[None, :]
    tl.atomic_add(dQ_ptr + rows[:, None] * D_HEAD + offs_d[None, :], dq * sm_scale, mask=dq_mask, sem="relaxed")


def finite_keys(geo: LaunchGeometry) -> LaunchGeometry:
    """``geo`` with K copied, NaN and infinities read as 0 (V copied too when K's copy no longer has
    its strides, e.g. K expanded over the batch: one set of strides serves K and V). Q's rows are made
    finite by ``combine_rows_kernel``, which writes them in the window kernels' sorted order."""
    k, v = key_value_pair(torch.nan_to_num(geo.k, nan=0.0, posinf=0.0, neginf=0.0), geo.v)
    return replace(geo, k=k, v=v)


def span_backward_tc(
    geo: LaunchGeometry,
    config: Mapping[str, int],
    out: torch.Tensor,
    lse2: torch.Tensor,
    grad_out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dQ, dK, dV) in the input dtypes for the forward that produced ``out``/``lse2``.

    ``out``/``grad_out`` [B, Hq, Lq, K, D], ``lse2`` [B, Hq, Lq, K] fp32 (log2 domain, +inf where a
    span attends no key). ``config`` holds SPAN_TC_BACKWARD_TUNABLES.
    """
    check_tile_config(config, SPAN_TC_BACKWARD_TUNABLES)
    q, k, v = geo.q, geo.k, geo.v
    batch, hq, lq, dim = q.shape
    hkv, lkv = k.shape[1], k.shape[2]
    n_spans = geo.qstart.shape[-1]
    dk32, dv32 = torch.zeros(2, batch, hkv, lkv, dim, device=q.device, dtype=torch.float32)  # one memset for both
    if q.numel() == 0 or lkv == 0 or n_spans == 0:
        return torch.zeros_like(q), dk32.to(k.dtype), dv32.to(v.dtype)
    grad_out, out, lse2 = grad_out.contiguous(), out.contiguous(), lse2.contiguous()
    geo = finite_keys(geo)
    k, v = geo.k, geo.v
    upcast = q.device.type == "cpu" and q.dtype != torch.float32  # see tc_dot
    block_d = max(16, triton.next_power_of_2(dim))
    tables = window_tables(geo.cache_position, lkv, geo.window, config["window_block_m"], config["window_block_n"])

    n_rows = batch * hq * lq
    delta = torch.empty(batch, hq, lq, n_spans, device=q.device, dtype=torch.float32)
    # the rows in the window kernels' sorted order; dO* is a dot operand in dO's dtype (fp32 under the
    # interpreter, see ``operand``)
    q_sorted = torch.empty(batch, hq, lq, dim, device=q.device, dtype=q.dtype)
    dos = torch.empty(batch, hq, lq, dim, device=q.device, dtype=torch.float32 if upcast else grad_out.dtype)
    c = torch.empty(batch, hq, lq, device=q.device, dtype=torch.float32)
    delta_s = torch.empty_like(c)
    block_r = 16
    combine_rows_kernel[(triton.cdiv(n_rows, block_r),)](
        out, grad_out, lse2, q, tables.rank, delta, q_sorted, dos, c, delta_s, *q.stride()[:3], n_rows, hq, lq,
        K_SPANS=n_spans, D_HEAD=dim, BLOCK_D=block_d, BLOCK_R=block_r, num_warps=4,
    )

    dq32 = torch.zeros(batch, hq, lq, dim, device=q.device, dtype=torch.float32)
    plan = span_tile_plan(geo, config["span_sort_block"])
    block_m = config["span_block_m"]
    span_tile_backward_kernel[(triton.cdiv(plan.triples, block_m), plan.groups)](
        q_sorted, tables.rank, k, v, plan.order, plan.lo, plan.hi, geo.mask, grad_out, lse2, delta, dq32, dk32, dv32,
        k.stride(0), k.stride(1), k.stride(2), geo.mask_stride,
        hkv, lq, lkv, plan.triples, geo.rep, LOG2E / math.sqrt(dim), 1.0 / math.sqrt(dim),
        K_SPANS=n_spans, D_HEAD=dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=config["span_block_n"],
        HAS_MASK=geo.has_mask, UPCAST=upcast, num_warps=config["span_warps"], num_stages=config["span_stages"],
    )

    dq = torch.empty(batch, hq, lq, dim, device=q.device, dtype=q.dtype)
    dk = torch.empty(batch, hkv, lkv, dim, device=q.device, dtype=k.dtype)
    dv = torch.empty(batch, hkv, lkv, dim, device=q.device, dtype=v.dtype)
    window_backward(geo, config, tables, q_sorted, dos, c, delta_s, dq32, dk32, dv32, dq, dk, dv, upcast)
    return dq, dk, dv
