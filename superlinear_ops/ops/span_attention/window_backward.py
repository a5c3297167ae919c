"""Sliding-window flash backward on tensor cores: the window part of the span backward, once per query.

Every span of a query attends the same window, so (see tile_backward.py) the window keys'
gradients summed over the K spans are one flash-backward row per (b, h, q) with a log2 reference
``c`` (P = exp2(s2 - c) <= 1), a combined output gradient dO* and a combined delta*.

Queries are visited in the order of their (clamped) positions, so each tile of ``BLOCK`` sorted
queries covers the key range [max(first pos - W + 1, 0), last pos] and the tiles that touch a key
block are one contiguous run, found by a binary search (``window_tables_kernel``, one launch for
both kernels' tables): any ``cache_position`` works, and consecutive positions give the usual
banded sliding window.

- ``window_dkdv_kernel``: one program per (key block of ``window_block_n``, KV head and part of its
  group's heads, batch) walks the query tiles (``window_block_m`` rows) of its heads that touch its
  keys and keeps dK/dV in registers. The query rows (q, dO*, c, delta*) lie in sorted order
  (``combine_rows_kernel`` writes them there), so each tile's q and dO* come whole through TMA
  descriptors where ``row_descriptors`` allows them (far faster than pointer loads). With the
  group in one part (``window_head_split`` 1) it adds the span part already in the fp32 buffers
  and writes dK/dV in the output dtype (no atomics);
  split into parts (more programs: short sequences have too few key blocks to fill the GPU), each
  part adds its sum to the fp32 buffers with one atomic add per element.
- ``window_dq_kernel``: one program per (query tile of ``window_block_n`` rows, query head, batch),
  the transposed tiling, streams its key range in blocks of ``window_block_m``, adds the span part
  and writes dQ in Q's dtype. The whole blocks of that range come through the tensor memory
  accelerator where ``window_forward.key_value_descriptors`` allows it (no mask, sm_90+).

Tiles that lie inside every row's window skip the per-row masks: in the dK/dV kernel the query
tiles of a key block whose every row attends all of its keys (``_full_tiles``, one run of the
sorted tiles), in the dQ kernel the key blocks inside every row's window. At model M's training
(W 2032) that is most of the tiles. Elsewhere keys outside a row's window, past the
last position or masked out are loaded as 0 and every per-(row, key) term is selected with
``tl.where``, so uninitialised cache entries never reach a gradient. Q and K come with NaN and
infinities already read as 0 (one pass before the kernels, ``tile_backward.finite_keys`` and
``combine_rows_kernel``, instead of a select on every tile of Q in the dK/dV kernel's loop).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..kernel_helpers import LOG2E, finite_or_zero, in_rows, inner_blocks, load_key_block, tc_dot
from .window_forward import key_value_descriptors, row_descriptors

SCAN_TILES = tl.constexpr(64)  # query tiles whose positions _full_tiles reads at once


@triton.jit
def operand(x, like, UPCAST: tl.constexpr):
    """fp32 ``x`` as a dot operand in ``like``'s dtype; kept fp32 under UPCAST (the interpreter's bf16
    casts truncate instead of rounding to nearest)."""
    if UPCAST:
        out = x
    else:
        out = x.to(like.dtype)
    return out


@triton.jit
def _sorted_operands(Qs_ptr, dOs_ptr, sorted_idx, L_Q, row_base, offs_d, d_mask, D_HEAD: tl.constexpr):
    """q (finite) and dO* of sorted query rows ``sorted_idx`` of the (batch, head) whose rows start at
    ``row_base`` in the sorted-order buffers (pointer loads; padding rows read as 0)."""
    rd_mask = (sorted_idx < L_Q)[:, None] & d_mask[None, :]
    offsets = (row_base + sorted_idx)[:, None] * D_HEAD + offs_d[None, :]
    return tl.load(Qs_ptr + offsets, mask=rd_mask, other=0.0), tl.load(dOs_ptr + offsets, mask=rd_mask, other=0.0)


@triton.jit
def _sorted_stats(c_ptr, ds_ptr, spos_ptr, sorted_idx, L_Q, row_base, WINDOW):
    """c, delta* and the window [lo, hi] of the same rows (padding rows: c +inf, hi -1; hi < lo: no key)."""
    row_ok = sorted_idx < L_Q
    pos = tl.load(spos_ptr + sorted_idx, mask=row_ok, other=-1)
    c = tl.load(c_ptr + row_base + sorted_idx, mask=row_ok, other=float("inf"))
    delta = tl.load(ds_ptr + row_base + sorted_idx, mask=row_ok, other=0.0)
    return c, delta, tl.maximum(pos - WINDOW + 1, 0), pos  # lo > hi when WINDOW is 0


@triton.jit
def _full_tiles(spos_ptr, t_first, t_last, key_lo, key_hi, L_Q, WINDOW, BLOCK_M: tl.constexpr):
    """[full_lo, full_hi]: the query tiles of t_first..t_last whose every row attends every key of
    [key_lo, key_hi] (complete tiles whose first position is >= key_hi and whose last window starts
    at or before key_lo). Positions are sorted, so they are one run; empty when full_hi < full_lo."""
    full_lo = t_first
    full_hi = t_first - 1
    for start in range(t_first, t_last + 1, SCAN_TILES):
        tiles = start + tl.arange(0, SCAN_TILES)
        live = tiles <= t_last
        complete = live & (tiles * BLOCK_M + BLOCK_M <= L_Q)
        first_pos = tl.load(spos_ptr + tiles * BLOCK_M, mask=live, other=0)
        last_pos = tl.load(spos_ptr + tiles * BLOCK_M + BLOCK_M - 1, mask=complete, other=0)
        full_lo += tl.sum((live & (first_pos < key_hi)).to(tl.int32), axis=0)
        full_hi += tl.sum((complete & (last_pos - WINDOW + 1 <= key_lo)).to(tl.int32), axis=0)
    return full_lo, full_hi


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v, key_ok, offs_n, t_begin, t_end, Qs_ptr, dOs_ptr, q_desc, do_desc, c_ptr, ds_ptr, spos_ptr, L_Q,
    row_base, offs_d, d_mask, WINDOW, qk_scale,
    BLOCK_M: tl.constexpr, D_HEAD: tl.constexpr, ROW_MASK: tl.constexpr, HAS_MASK: tl.constexpr,
    ROWS_TMA: tl.constexpr, UPCAST: tl.constexpr,
):
    """``dk``/``dv`` plus query tiles t_begin..t_end-1 of one head against the key block ``offs_n``;
    without ``ROW_MASK`` every row of those tiles attends every key of the block (``_full_tiles``)
    and only the attention mask, if any, selects keys. With ``ROWS_TMA`` each tile's q and dO* come
    whole through the descriptors (rows past the head's last one belong to the next head or read as
    0: their c is +inf, so p and dS are 0 there, and an edge tile reads their dO* as 0, so that a
    NaN there stays in its own head; q is finite, ``combine_rows_kernel`` wrote it so)."""
    for t in range(t_begin, t_end):
        sorted_idx = t * BLOCK_M + tl.arange(0, BLOCK_M)
        if ROWS_TMA:
            q = q_desc.load([(row_base + t * BLOCK_M).to(tl.int32), 0])
            dos = do_desc.load([(row_base + t * BLOCK_M).to(tl.int32), 0])
            if ROW_MASK:  # an edge tile's rows past L_Q hold the next head's dO*: 0 x its NaN would be NaN
                dos = tl.where((sorted_idx < L_Q)[:, None], dos, 0.0)
        else:
            q, dos = _sorted_operands(Qs_ptr, dOs_ptr, sorted_idx, L_Q, row_base, offs_d, d_mask, D_HEAD)
        c, delta, lo, hi = _sorted_stats(c_ptr, ds_ptr, spos_ptr, sorted_idx, L_Q, row_base, WINDOW)
        if ROW_MASK:
            attend = (offs_n[:, None] >= lo[None, :]) & (offs_n[:, None] <= hi[None, :]) & key_ok[:, None]
        else:
            attend = key_ok[:, None]
        s2t = tc_dot(k, tl.trans(q), UPCAST) * qk_scale  # [BLOCK_N, BLOCK_M]
        pt = tl.exp2(s2t - c[None, :])
        if ROW_MASK or HAS_MASK:
            pt = tl.where(attend, pt, 0.0)
        dv += tc_dot(operand(pt, dos, UPCAST), dos, UPCAST)
        dpt = tc_dot(v, tl.trans(dos), UPCAST)
        dst = pt * (dpt - delta[None, :])
        if ROW_MASK or HAS_MASK:
            dst = tl.where(attend, dst, 0.0)
        dk += tc_dot(operand(dst, q, UPCAST), q, UPCAST)
    return dk, dv


@triton.jit
def window_dkdv_kernel(
    Qs_ptr, K_ptr, V_ptr, mask_ptr, dOs_ptr, q_desc, do_desc, c_ptr, ds_ptr, spos_ptr,
    first_ptr, last_ptr, dK_ptr, dV_ptr, dKout_ptr, dVout_ptr,
    stride_kb, stride_kh, stride_kl, stride_mb,
    H_KV, L_Q, L_KV, REP, PARTS, PART_HEADS, WINDOW, qk_scale, sm_scale,
    D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, ROWS_TMA: tl.constexpr, UPCAST: tl.constexpr, ATOMIC_ADD: tl.constexpr,
):
    # PARTS programs per KV head, each over PART_HEADS of its REP heads; ATOMIC_ADD when PARTS > 1.
    # Query rows in sorted order (Qs, dO*, c, delta*); with ROWS_TMA q and dO* through q_desc/do_desc.
    kblock = tl.program_id(0)
    kv_head = (tl.program_id(1) // PARTS).to(tl.int64)
    part = tl.program_id(1) % PARTS
    batch = tl.program_id(2).to(tl.int64)
    offs_n = kblock * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D_HEAD
    last_pos = tl.load(spos_ptr + L_Q - 1)
    k, v, key_ok = load_key_block(K_ptr, V_ptr, batch * stride_kb + kv_head * stride_kh, stride_kl, mask_ptr,
                            batch * stride_mb, offs_n, (offs_n < L_KV) & (offs_n <= last_pos), offs_d, d_mask,
                            HAS_MASK)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    t_first = tl.load(first_ptr + kblock)
    t_last = tl.load(last_ptr + kblock)
    key_lo = kblock * BLOCK_N
    full_lo, full_hi = _full_tiles(spos_ptr, t_first, t_last, key_lo, key_lo + BLOCK_N - 1, L_Q, WINDOW, BLOCK_M)
    tail = tl.maximum(full_lo, full_hi + 1)
    for h in range(part * PART_HEADS, tl.minimum(part * PART_HEADS + PART_HEADS, REP)):
        row_base = (batch * H_KV * REP + kv_head * REP + h) * L_Q
        for segment in tl.static_range(3):  # edge tiles, full tiles, edge tiles
            dk, dv = _dkdv_tiles(
                dk, dv, k, v, key_ok, offs_n, (t_first, full_lo, tail)[segment], (full_lo, full_hi + 1, t_last + 1)[segment],
                Qs_ptr, dOs_ptr, q_desc, do_desc, c_ptr, ds_ptr, spos_ptr, L_Q, row_base, offs_d, d_mask,
                WINDOW, qk_scale, BLOCK_M, D_HEAD, segment != 1, HAS_MASK, ROWS_TMA, UPCAST,
            )
    out = (batch * H_KV + kv_head) * L_KV * D_HEAD + offs_n[:, None].to(tl.int64) * D_HEAD + offs_d[None, :]
    nd_mask = (offs_n < L_KV)[:, None] & d_mask[None, :]
    if ATOMIC_ADD:  # the launcher writes the output dtype once every part has added its sum
        tl.atomic_add(dK_ptr + out, dk * sm_scale, mask=nd_mask, sem="relaxed")
        tl.atomic_add(dV_ptr + out, dv, mask=nd_mask, sem="relaxed")
    else:
        dk = dk * sm_scale + tl.load(dK_ptr + out, mask=nd_mask, other=0.0)
        dv = dv + tl.load(dV_ptr + out, mask=nd_mask, other=0.0)
        tl.store(dKout_ptr + out, dk.to(dKout_ptr.dtype.element_ty), mask=nd_mask)
        tl.store(dVout_ptr + out, dv.to(dVout_ptr.dtype.element_ty), mask=nd_mask)


@triton.jit
def _dq_blocks(
    dq, first, end, q, dos, c, delta, lo, hi, K_ptr, V_ptr, k_desc, v_desc, desc_row, kv_base, stride_kl,
    mask_ptr, mask_base, tile_lo, tile_hi, offs_d, d_mask, qk_scale,
    BLOCK_N: tl.constexpr, ROW_MASK: tl.constexpr, HAS_MASK: tl.constexpr, TMA: tl.constexpr, UPCAST: tl.constexpr,
):
    """``dq`` plus key blocks first..end-1 of the tile's range (block i starts at key tile_lo + i *
    BLOCK_N): whole from the K/V descriptors with ``TMA``, else by pointer loads (keys past
    ``tile_hi`` or masked out read as 0); per-row [lo, hi] masks with ``ROW_MASK``, else every row
    attends every key of the blocks that the attention mask allows."""
    for i in range(first, end):
        offs_n = tile_lo + i * BLOCK_N + tl.arange(0, BLOCK_N)
        if TMA:  # only without an attention mask (key_value_descriptors)
            k = k_desc.load([desc_row + tile_lo + i * BLOCK_N, 0])
            v = v_desc.load([desc_row + tile_lo + i * BLOCK_N, 0])
        else:
            k, v, allowed = load_key_block(K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base, offs_n,
                                           offs_n <= tile_hi, offs_d, d_mask, HAS_MASK)
            k = finite_or_zero(k)  # K is finite already; the select still compiles to a faster loop than none
        s2 = tc_dot(q, tl.trans(k), UPCAST) * qk_scale
        p = tl.exp2(s2 - c[:, None])
        dp = tc_dot(dos, tl.trans(v), UPCAST)
        ds = p * (dp - delta[:, None])
        # Keys past tile_hi lie past every row's hi; p of a masked-out key (read as 0) can overflow: exp2(0 - c).
        if ROW_MASK:
            attend = in_rows(offs_n, lo, hi)
            if HAS_MASK:
                attend = attend & allowed[None, :]
            ds = tl.where(attend, ds, 0.0)
        elif HAS_MASK:
            ds = tl.where(allowed[None, :], ds, 0.0)
        dq += tc_dot(operand(ds, k, UPCAST), k, UPCAST)
    return dq


@triton.jit
def window_dq_kernel(
    Qs_ptr, K_ptr, V_ptr, k_desc, v_desc, mask_ptr, dOs_ptr, c_ptr, ds_ptr, perm_ptr, spos_ptr,
    tile_lo_ptr, tile_hi_ptr, dQ_ptr, dQout_ptr,
    stride_kb, stride_kh, stride_kl, stride_mb,
    H_Q, L_Q, L_KV, REP, WINDOW, qk_scale, sm_scale,
    D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, KV_TMA: tl.constexpr, UPCAST: tl.constexpr,
):
    # BLOCK_M sorted queries against key blocks of BLOCK_N; with KV_TMA the whole blocks of the
    # tile's key range come through the K/V descriptors (row desc_row is this group's key 0).
    # Blocks inside every row's window skip the per-row masks. Query rows are read in sorted order
    # (Qs, dO*, c, delta*) and dQ is stored at their own rows (perm).
    tile = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D_HEAD
    sorted_idx = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_base = (batch * H_Q + head) * L_Q
    q, dos = _sorted_operands(Qs_ptr, dOs_ptr, sorted_idx, L_Q, row_base, offs_d, d_mask, D_HEAD)
    c, delta, lo, hi = _sorted_stats(c_ptr, ds_ptr, spos_ptr, sorted_idx, L_Q, row_base, WINDOW)
    row_ok = sorted_idx < L_Q
    rows = tl.where(row_ok, row_base + tl.load(perm_ptr + sorted_idx, mask=row_ok, other=0), -1)
    kv_base = batch * stride_kb + (head // REP) * stride_kh
    desc_row = ((batch * (H_Q // REP) + head // REP) * L_KV).to(tl.int32)
    tile_lo = tl.load(tile_lo_ptr + tile)
    tile_hi = tl.load(tile_hi_ptr + tile)
    keys = tl.maximum(tile_hi - tile_lo + 1, 0)
    n_blocks = tl.cdiv(keys, BLOCK_N)
    whole = keys // BLOCK_N  # whole blocks of the range (the TMA path loads only these)
    # whole blocks of keys that every stored row attends (padding rows are never stored)
    first_inner, end_inner = inner_blocks(rows >= 0, lo, hi, tile_lo, tile_hi, whole, BLOCK_N)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for segment in tl.static_range(4):  # edge blocks, inner blocks, edge blocks, the partial block
        dq = _dq_blocks(
            dq, (0, first_inner, end_inner, whole)[segment], (first_inner, end_inner, whole, n_blocks)[segment],
            q, dos, c, delta, lo, hi, K_ptr, V_ptr, k_desc, v_desc, desc_row, kv_base, stride_kl, mask_ptr,
            batch * stride_mb, tile_lo, tile_hi, offs_d, d_mask, qk_scale,
            BLOCK_N, segment != 1, HAS_MASK, KV_TMA and segment != 3, UPCAST,
        )
    offsets = rows[:, None] * D_HEAD + offs_d[None, :]
    rd_mask = (rows >= 0)[:, None] & d_mask[None, :]  # rebuilt here: a mask kept across the loop spills
    dq = dq * sm_scale + tl.load(dQ_ptr + offsets, mask=rd_mask, other=0.0)
    tl.store(dQout_ptr + offsets, dq.to(dQout_ptr.dtype.element_ty), mask=rd_mask)


TABLE_BLOCK = 1024  # entries per program of window_tables_kernel


@triton.jit
def _tile_range(spos_ptr, tile, ok, L_Q, WINDOW, ROWS: tl.constexpr):
    """Key range [lo, hi] (int64) of sorted query tiles ``tile`` of ``ROWS`` rows: from the first
    row's window start to the last row's position (hi < lo: no key, when WINDOW is 0)."""
    first = tl.load(spos_ptr + tile * ROWS, mask=ok, other=0).to(tl.int64)
    last = tl.load(spos_ptr + tl.minimum(tile * ROWS + ROWS - 1, L_Q - 1), mask=ok, other=0).to(tl.int64)
    lo = tl.maximum(first - WINDOW + 1, 0)
    return lo, tl.where(WINDOW > 0, last, lo - 1)


@triton.jit
def _tiles_before(spos_ptr, key, n_tiles, L_Q, WINDOW, ROWS: tl.constexpr, BY_HI: tl.constexpr, STEPS: tl.constexpr):
    """How many of the ``n_tiles`` tiles have hi < key (``BY_HI``) or lo <= key (else): a binary
    search of ``STEPS`` halvings over the tiles' nondecreasing bounds."""
    lo_i = tl.zeros(key.shape, dtype=tl.int32)
    hi_i = lo_i + n_tiles
    for _ in tl.static_range(STEPS):  # invariant: tiles [0, lo_i) pass, tiles [hi_i, n_tiles) fail
        open_ = lo_i < hi_i
        mid = (lo_i + hi_i) // 2
        tile_lo, tile_hi = _tile_range(spos_ptr, mid, open_, L_Q, WINDOW, ROWS)
        passes = (tile_hi < key) if BY_HI else (tile_lo <= key)
        lo_i = tl.where(open_ & passes, mid + 1, lo_i)
        hi_i = tl.where(open_ & ~passes, mid, hi_i)
    return lo_i


@triton.jit
def window_tables_kernel(
    spos_ptr, perm_ptr, perm32_ptr, rank_ptr, first_ptr, last_ptr, dq_lo_ptr, dq_hi_ptr,
    L_Q, WINDOW, N_KEY_BLOCKS, N_DKDV_TILES, N_DQ_TILES,
    DKDV_ROWS: tl.constexpr, DQ_ROWS: tl.constexpr, STEPS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Everything the two window kernels read besides the sorted positions ``spos``, in one launch:
    the sorted queries' indices as int32 and each query's sorted place (``rank``); per key block of ``DQ_ROWS`` keys (the dK/dV kernel's
    blocks: its key block is the dQ kernel's query tile) the run [first, last] of the ``DKDV_ROWS``-
    row query tiles that touch it; per ``DQ_ROWS``-row query tile its key range [lo, hi] (int32)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_q = offs < L_Q
    query = tl.load(perm_ptr + offs, mask=in_q, other=0)
    tl.store(perm32_ptr + offs, query.to(tl.int32), mask=in_q)
    tl.store(rank_ptr + query, offs, mask=in_q)
    in_kb = offs < N_KEY_BLOCKS
    key_lo = offs.to(tl.int64) * DQ_ROWS
    first = _tiles_before(spos_ptr, key_lo, N_DKDV_TILES, L_Q, WINDOW, DKDV_ROWS, True, STEPS)
    last = _tiles_before(spos_ptr, key_lo + DQ_ROWS - 1, N_DKDV_TILES, L_Q, WINDOW, DKDV_ROWS, False, STEPS) - 1
    tl.store(first_ptr + offs, first, mask=in_kb)
    tl.store(last_ptr + offs, last, mask=in_kb)
    in_tile = offs < N_DQ_TILES
    lo, hi = _tile_range(spos_ptr, offs, in_tile, L_Q, WINDOW, DQ_ROWS)
    tl.store(dq_lo_ptr + offs, lo.to(tl.int32), mask=in_tile)
    tl.store(dq_hi_ptr + offs, hi.to(tl.int32), mask=in_tile)


@dataclass(frozen=True)
class WindowTables:
    """The window kernels' query order and tile tables (``window_tables``)."""

    pos: torch.Tensor  # [Lq] positions clamped to Lkv - 1, sorted
    perm: torch.Tensor  # [Lq] int32: the query at each sorted place
    rank: torch.Tensor  # [Lq] int32: each query's sorted place (perm's inverse)
    first: torch.Tensor  # [key blocks] int32: the first dK/dV query tile touching each key block
    last: torch.Tensor  # [key blocks] int32: the last one (last < first: none)
    dq_lo: torch.Tensor  # [dQ query tiles] int32: each dQ tile's key range [lo, hi]
    dq_hi: torch.Tensor


def window_tables(cache_position: torch.Tensor, key_length: int, window: int, dkdv_rows: int, dq_rows: int) -> WindowTables:
    """Sort the queries by clamped position (stable) and build both window kernels' tables with one
    launch of ``window_tables_kernel``: dK/dV query tiles of ``dkdv_rows`` rows against key blocks of
    ``dq_rows`` keys, dQ query tiles of ``dq_rows`` rows. For Lq >= 1 and Lkv >= 1."""
    pos, perm = torch.sort(cache_position.clamp(max=key_length - 1), stable=True)
    lq, device = pos.numel(), pos.device
    n_key_blocks, n_dkdv_tiles, n_dq_tiles = triton.cdiv(key_length, dq_rows), triton.cdiv(lq, dkdv_rows), triton.cdiv(lq, dq_rows)
    perm32, rank = (torch.empty(lq, device=device, dtype=torch.int32) for _ in range(2))
    first, last = (torch.empty(n_key_blocks, device=device, dtype=torch.int32) for _ in range(2))
    dq_lo, dq_hi = (torch.empty(n_dq_tiles, device=device, dtype=torch.int32) for _ in range(2))
    window_tables_kernel[(triton.cdiv(max(lq, n_key_blocks), TABLE_BLOCK),)](
        pos, perm, perm32, rank, first, last, dq_lo, dq_hi, lq, window, n_key_blocks, n_dkdv_tiles, n_dq_tiles,
        DKDV_ROWS=dkdv_rows, DQ_ROWS=dq_rows, STEPS=max(1, n_dkdv_tiles.bit_length()), BLOCK=TABLE_BLOCK, num_warps=4,
    )
    return WindowTables(pos, perm32, rank, first, last, dq_lo, dq_hi)


def window_backward(geo, config, tables: WindowTables, q_sorted, dos, c, delta_s, dq32, dk32, dv32, dq, dk, dv,
                    upcast: bool) -> None:
    """Add the window part to the span part in dq32/dk32/dv32 (fp32) and write dq/dk/dv (final dtypes).

    ``tables`` from ``window_tables`` at (``window_block_m``, ``window_block_n``); the query rows in
    its sorted order, contiguous: ``q_sorted`` [B, Hq, Lq, D] (Q with non-finite entries read as 0),
    ``dos`` [B, Hq, Lq, D], ``c`` and ``delta_s`` [B, Hq, Lq] (the combined rows of each query).
    ``geo`` holds K with non-finite entries read as 0 (``finite_keys``).
    """
    k = geo.k
    batch, hq, lq, dim = q_sorted.shape
    hkv, lkv = k.shape[1], k.shape[2]
    block_m, block_n = config["window_block_m"], config["window_block_n"]
    strides = (k.stride(0), k.stride(1), k.stride(2), geo.mask_stride)
    scales = (LOG2E / math.sqrt(dim), 1.0 / math.sqrt(dim))
    common = {"D_HEAD": dim, "BLOCK_D": max(16, triton.next_power_of_2(dim)), "HAS_MASK": geo.has_mask,
              "UPCAST": upcast, "num_warps": config["window_warps"], "num_stages": config["window_stages"]}
    part_heads = triton.cdiv(geo.rep, config["window_head_split"])
    parts = triton.cdiv(geo.rep, part_heads)
    row_tiles = row_descriptors(q_sorted, dos, block_m)  # each dK/dV query tile whole, where TMA allows it
    window_dkdv_kernel[(triton.cdiv(lkv, block_n), hkv * parts, batch)](
        q_sorted, k, geo.v, geo.mask, dos, *(row_tiles or (q_sorted, dos)), c, delta_s, tables.pos, tables.first,
        tables.last, dk32, dv32, dk, dv, *strides, hkv, lq, lkv, geo.rep, parts, part_heads, geo.window, *scales,
        BLOCK_M=block_m, BLOCK_N=block_n, ROWS_TMA=row_tiles is not None, ATOMIC_ADD=parts > 1, **common,
    )
    if parts > 1:
        dk.copy_(dk32)
        dv.copy_(dv32)
    descriptors = key_value_descriptors(geo, block_m)
    window_dq_kernel[(triton.cdiv(lq, block_n), hq, batch)](
        q_sorted, k, geo.v, *(descriptors or (k, geo.v)), geo.mask, dos, c, delta_s, tables.perm, tables.pos,
        tables.dq_lo, tables.dq_hi, dq32, dq, *strides, hq, lq, lkv, geo.rep, geo.window, *scales,
        BLOCK_M=block_n, BLOCK_N=block_m, KV_TMA=descriptors is not None, **common,
    )
