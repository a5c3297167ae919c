"""Tensor-core span-attention forward for prefill and training: window once, spans in shared key tiles.

1. ``window_attention`` (window_forward.py) computes each (b, h, q)'s window part once:
   fp32 normalised output and log2-domain LSE.
2. ``span_tile_plan`` (span_tiles.py) sorts each (batch, KV head) group's (head, query, slot)
   triples by (clamped span start // 16, span end), on the device (two Triton launches and a sort);
   on a GPU they run on a high-priority side stream (``side_stream``) while step 1's kernel runs.
3. ``span_tile_kernel``, one program per (tile of ``BLOCK_M`` sorted triples, group): gathers the
   rows' Q, streams the K/V blocks of the tile's key range [min lo, max hi] with tensor-core dots
   (through TMA as in window_forward.py: the blocks every row attends, and with W >= the block
   width the edge blocks too), per-row [lo, hi] and
   mask masking and an online softmax, merges each row with its window part by
   log-sum-exp and writes out[b, h, q, j] and lse2[b, h, q, j] (every row exactly once; zeros and
   +inf where no key is attended). Under a mask steps 1 and 3 each run twice, over the tiles in
   their row's allowed suffix without the mask and over the others with it
   (``window_forward.tile_launches``).

No host synchronisation: grids and buffers depend on shapes only. Besides the outputs it allocates
the window part (fp32, [B, Hq, Lq, D] + [B, Hq, Lq]) and the plan (an int64 order, the sort keys
and their sorted copy, int32 or past about 185K keys int64, and two int32 bounds, each
[B * Hkv, Hq / Hkv * Lq * K]). Spans are clamped to end before
their query's window (``hi <= pos - W``), so the two parts never share a key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from ...launch import LaunchGeometry, check_tile_config, forward_outputs
from ..kernel_helpers import LOG2E
from ..side_stream import SideStream
from .span_tiles import span_tile_plan
from .window_forward import (
    SUFFIX_TILES,
    allowed_suffix_start,
    attend_rows,
    block_d,
    row_descriptors,
    takes_tile,
    tile_launches,
    upcast_dots,
    window_attention,
)

SPAN_START_BLOCK = 16  # span tiles: triples sorted by (start // 16, end), see span_tile_plan
TC_FORWARD_TUNABLES = (  # the names of a configuration (the variant declares their values)
    "window_block_m", "window_block_n", "window_warps", "window_stages", "span_block_m", "span_block_n", "span_warps", "span_stages",
)


@triton.jit
def span_tile_kernel(
    Q_ptr, K_ptr, V_ptr, k_desc, v_desc, order_ptr, lo_ptr, hi_ptr, mask_ptr, suffix_ptr, Ow_ptr, Lw_ptr, Out_ptr,
    Lse_ptr, stride_qb, stride_qh, stride_ql, stride_kb, stride_kh, stride_kl, stride_mb,
    H_KV, L_Q, L_KV, N_TRIPLES, REP, qk_scale,
    K_SPANS: tl.constexpr, D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, TILES: tl.constexpr, KV_TMA: tl.constexpr,
    EDGE_TMA: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    group = tl.program_id(1).to(tl.int64)
    batch = group // H_KV
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < N_TRIPLES
    plan = group * N_TRIPLES + offs_m
    triple = tl.load(order_ptr + plan, mask=row_ok, other=0)
    row_lo = tl.load(lo_ptr + plan, mask=row_ok, other=0)
    row_hi = tl.load(hi_ptr + plan, mask=row_ok, other=-1)

    if takes_tile(suffix_ptr, batch, row_lo, row_hi, TILES):
        head = (group % H_KV) * REP + triple // (L_Q * K_SPANS)
        query = (triple // K_SPANS) % L_Q
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < D_HEAD
        io_mask = row_ok[:, None] & d_mask[None, :]
        q_rows = batch * stride_qb + head.to(tl.int64) * stride_qh + query.to(tl.int64) * stride_ql
        q = tl.load(Q_ptr + q_rows[:, None] + offs_d[None, :], mask=io_mask, other=0.0)

        acc, m, l = attend_rows(
            q, K_ptr, V_ptr, batch * stride_kb + (group % H_KV) * stride_kh, stride_kl, mask_ptr, batch * stride_mb,
            row_lo, row_hi, offs_d, d_mask, qk_scale, k_desc, v_desc, (group * L_KV).to(tl.int32),
            BLOCK_M, BLOCK_D, BLOCK_N, HAS_MASK and TILES != SUFFIX_TILES, KV_TMA, EDGE_TMA, UPCAST,
        )

        out_rows = group * N_TRIPLES + triple  # flat (b, h, q, j) slot of the contiguous outputs
        if HAS_WINDOW:  # merge with the window part (normalised output ow, log2 LSE lw) by log-sum-exp
            w_rows = out_rows // K_SPANS
            lw = tl.load(Lw_ptr + w_rows, mask=row_ok, other=float("-inf"))
            ow = tl.load(Ow_ptr + w_rows[:, None] * D_HEAD + offs_d[None, :], mask=io_mask, other=0.0)
            m_new = tl.maximum(m, lw)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_ref)
            beta = tl.exp2(lw - m_ref)
            l = l * alpha + beta
            acc = acc * alpha[:, None] + ow * beta[:, None]
            m = m_new
        has_keys = (l > 0.0) | (l != l)  # noqa: PLR0124 - NaN must reach the output, not read as "no key"
        l_safe = tl.where(has_keys, l, 1.0)
        out = tl.where(has_keys[:, None], acc / l_safe[:, None], 0.0)
        tl.store(Out_ptr + out_rows[:, None] * D_HEAD + offs_d[None, :], out.to(Out_ptr.dtype.element_ty), mask=io_mask)
        tl.store(Lse_ptr + out_rows, tl.where(has_keys, m + tl.log2(l_safe), float("inf")), mask=row_ok)


def span_forward_tc(
    geo: LaunchGeometry,
    config: Mapping[str, int],
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensor-core span forward: (out [B, Hq, Lq, K, D] in Q's dtype, lse2 [B, Hq, Lq, K] fp32).

    Same numbers as ``span_forward`` (semantics section 2, spans clamped to end before the window);
    ``config`` maps the names in ``TC_FORWARD_TUNABLES`` to ints (the variant's default for sm_90).
    ``out`` may give both buffers (contiguous, those shapes and dtypes) to write into.
    """
    check_tile_config(config, TC_FORWARD_TUNABLES)
    q, k = geo.q, geo.k
    batch, hq, lq, dim = q.shape
    n_spans = geo.qstart.shape[-1]
    out, lse = forward_outputs(geo, out)
    if out.numel() == 0:
        return out, lse
    suffix_start = allowed_suffix_start(geo) if geo.has_mask else None
    side = SideStream(q.device)  # forks here: the plan below runs while the window kernel does
    if geo.window > 0:
        window_out, window_lse = window_attention(geo, config, suffix_start)
    else:  # no window part: the kernel never reads these
        window_out = window_lse = lse
    with side:
        plan = span_tile_plan(geo, SPAN_START_BLOCK)
    side.join(plan.order, plan.lo, plan.hi)
    block_m, block_n = config["span_block_m"], config["span_block_n"]
    descriptors = row_descriptors(k, geo.v, block_n)
    # A tile's edge blocks through TMA too: they end at most block_n - 1 keys past the tile's last
    # span key, which is W keys before its query, so with W >= block_n every key they load is one
    # of the group's keys before that query (never past its cache position or into the next group).
    edge_tma = descriptors is not None and geo.window >= block_n
    grid = (triton.cdiv(plan.triples, block_m), plan.groups)
    for tiles, starts in tile_launches(geo, suffix_start):
        span_tile_kernel[grid](
            q, k, geo.v, *(descriptors or (k, geo.v)), plan.order, plan.lo, plan.hi, geo.mask, starts, window_out,
            window_lse, out, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            geo.mask_stride, k.shape[1], lq, k.shape[2], plan.triples, geo.rep, LOG2E / math.sqrt(dim),
            K_SPANS=n_spans, D_HEAD=dim, BLOCK_D=block_d(dim), BLOCK_M=block_m, BLOCK_N=block_n,
            HAS_WINDOW=geo.window > 0, HAS_MASK=geo.has_mask, TILES=tiles, KV_TMA=descriptors is not None,
            EDGE_TMA=edge_tma, UPCAST=upcast_dots(geo),
            num_warps=config["span_warps"], num_stages=config["span_stages"],
        )
    return out, lse
