"""Sliding-window flash attention on tensor cores: the window part of span attention, once per query.

One program per (query head, tile of ``BLOCK_M`` consecutive queries, batch); the programs of one
query tile run head after head, so the heads of a KV group read the same key blocks from L2.
A tile streams the key blocks of ``[min window start, max pos]`` over its rows (per-row masks, so
any ``cache_position`` is handled; consecutive positions give ``W + BLOCK_M`` keys per tile) with
two tensor-core dots per block and an online softmax in the log2 domain. The blocks that every row
of a tile attends come through the tensor memory accelerator (TMA descriptors over K and V as one
[B * Hkv * Lkv, D] run of rows, ``row_descriptors``) where the inputs allow it: sm_90 or newer,
evenly spaced rows 16-byte aligned (faster than pointer loads for this kernel and the span-tile
kernel alike). The other blocks are
read by pointer loads (the span-tile kernel reads its edge blocks through TMA too where its caller
shows them safe: ``EDGE_TMA``).

Under an attention mask both kernels run twice (``tile_launches``): over the tiles whose keys all
lie in their batch row's allowed suffix, exactly as without a mask, and over the others with the
mask, which this kernel reads by pointer loads (hidden keys read as 0) and the span-tile kernel
through TMA (``attend_rows``: hidden keys get zero weight, and a tile whose result then holds a NaN
runs again by pointer loads).

It writes, per (b, h, q), the window attention normalised in fp32 and its log2-domain
log-sum-exp (``-inf`` when the row attends no window key), which the span kernel merges with
each span part. Keys outside the tile's range or masked out never reach an output (they are read
as 0, or meet zero weights and, where that makes a NaN, are read as 0 in a second pass), so
uninitialised (NaN) cache entries stay out; NaN in Q or in an attended key shows in the row. (A NaN
value vector that one row of a tile attends also reaches the tile's other rows, as 0 * NaN in the
shared dot: keys that some row attends are expected to be finite. With ``EDGE_TMA`` that extends
to the keys past the tile's range up to the end of its last block: keys before the position of
the query whose span ends last, which a written cache holds.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from ...launch import LaunchGeometry, hopper_or_newer
from ..kernel_helpers import LOG2E, allowed_keys, attend_block, attend_described_block, holds_nan, inner_blocks, tile_range

# Which tiles a launch takes under an attention mask (``TILES``): all of them, as the mask says; the
# tiles whose keys all lie in their batch row's allowed suffix (``allowed_suffix_start``), which
# run without the mask; or the others, with it. Under a mask each kernel runs once for each of the
# last two, so that neither compiles the other's path (a masked path beside the
# unmasked one in one kernel makes the unmasked tiles slower).
ALL_TILES, SUFFIX_TILES, MASKED_TILES = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def takes_tile(suffix_ptr, batch, row_lo, row_hi, TILES: tl.constexpr):
    """Whether this launch (``TILES``) takes the tile whose rows attend [row_lo, row_hi]: with
    ``SUFFIX_TILES`` those whose keys all lie at or past the batch row's allowed-suffix start, with
    ``MASKED_TILES`` the others (a tile that attends nothing goes to one of them)."""
    taken = True
    if TILES != ALL_TILES:
        tile_lo, _ = tile_range(row_hi >= row_lo, row_lo, row_hi)
        suffix_start = tl.load(suffix_ptr + batch)
        if TILES == SUFFIX_TILES:
            taken = tile_lo >= suffix_start
        else:
            taken = tile_lo < suffix_start
    return taken


@triton.jit
def attend_blocks(
    acc, m, l, first, end, q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base, tile_lo, tile_hi,
    row_lo, row_hi, offs_d, d_mask, qk_scale, k_desc, v_desc, desc_row,
    BLOCK_N: tl.constexpr, ROW_MASK: tl.constexpr, HAS_MASK: tl.constexpr, TMA: tl.constexpr, UPCAST: tl.constexpr,
):
    """Online-softmax steps over blocks first..end-1 of the tile's range (block i starts at key
    tile_lo + i * BLOCK_N): loaded whole from the descriptors with ``TMA`` (keys the mask hides get
    zero weights, their values met as loaded; each block's mask entries read one block ahead, so
    that no step waits for them), else by pointer loads (keys past ``tile_hi`` or masked out read
    as 0); per-row [lo, hi] masks with ``ROW_MASK``."""
    offs_n = tl.arange(0, BLOCK_N)
    keep = None
    if TMA and HAS_MASK:
        keep = allowed_keys(mask_ptr + mask_base, tile_lo + first * BLOCK_N, tile_hi, offs_n)
    for i in range(first, end):
        start = tile_lo + i * BLOCK_N
        if TMA:
            if HAS_MASK:
                keep_ahead = allowed_keys(mask_ptr + mask_base, start + BLOCK_N, tile_hi, offs_n)
            acc, m, l = attend_described_block(acc, m, l, q, k_desc, v_desc, desc_row + start, start, row_lo, row_hi,
                                               keep, qk_scale, BLOCK_N, ROW_MASK, HAS_MASK, False, UPCAST)
            if HAS_MASK:
                keep = keep_ahead
        else:
            acc, m, l = attend_block(acc, m, l, q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base, start, tile_hi,
                                     row_lo, row_hi, offs_d, d_mask, qk_scale, BLOCK_N, ROW_MASK, HAS_MASK, UPCAST)
    return acc, m, l


@triton.jit
def attend_range(
    q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base, tile_lo, tile_hi, row_lo, row_hi, present,
    offs_d, d_mask, qk_scale, k_desc, v_desc, desc_row,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, KV_TMA: tl.constexpr, EDGE_TMA: tl.constexpr, UPCAST: tl.constexpr,
):
    """The blocks of [tile_lo, tile_hi] in three runs: those before and after the blocks every
    ``present`` row attends with per-row masks (through the descriptors with ``EDGE_TMA``), those
    inside without them (through the descriptors with ``KV_TMA``). Returns (acc, m, l)."""
    n_blocks = tl.cdiv(tile_hi - tile_lo + 1, BLOCK_N)
    first_inner, end_inner = inner_blocks(present, row_lo, row_hi, tile_lo, tile_hi, n_blocks, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc, m, l = attend_blocks(
        acc, m, l, 0, first_inner, q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base, tile_lo, tile_hi,
        row_lo, row_hi, offs_d, d_mask, qk_scale, k_desc, v_desc, desc_row, BLOCK_N, True, HAS_MASK, EDGE_TMA, UPCAST,
    )
    acc, m, l = attend_blocks(
        acc, m, l, first_inner, end_inner, q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base, tile_lo, tile_hi,
        row_lo, row_hi, offs_d, d_mask, qk_scale, k_desc, v_desc, desc_row, BLOCK_N, False, HAS_MASK, KV_TMA, UPCAST,
    )
    acc, m, l = attend_blocks(
        acc, m, l, end_inner, n_blocks, q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base, tile_lo, tile_hi,
        row_lo, row_hi, offs_d, d_mask, qk_scale, k_desc, v_desc, desc_row, BLOCK_N, True, HAS_MASK, EDGE_TMA, UPCAST,
    )
    return acc, m, l


@triton.jit
def attend_rows(
    q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base, row_lo, row_hi, offs_d, d_mask, qk_scale,
    k_desc, v_desc, desc_row,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, KV_TMA: tl.constexpr, EDGE_TMA: tl.constexpr, UPCAST: tl.constexpr,
):
    """Online softmax of each row r over keys [row_lo[r], row_hi[r]] (none when hi < lo), mask applied.

    Streams the blocks of the tile's range [min lo, max hi] over the rows that attend something;
    blocks inside every such row's range skip the per-row masks, and with ``KV_TMA`` the tensor
    memory accelerator loads them whole from the K/V descriptors, whose row ``desc_row`` is this
    group's key 0. With ``EDGE_TMA`` (the caller's promise that every key up to max hi + BLOCK_N - 1
    is a finite key of this group unless the mask hides it) the edge blocks come through the
    descriptors too, per-row masks applied to their scores. Under a mask the keys it hides that
    came through TMA meet zero weights as loaded; where the result then holds a NaN (one of them
    was not finite, or an attended key was) the tile runs again on pointer loads, which read
    hidden keys as 0. Rows that attend nothing come back as (0, -inf, 0), whatever the shared
    blocks held. Returns (acc, m, l), log2 domain.
    """
    present = row_hi >= row_lo
    tile_lo, tile_hi = tile_range(present, row_lo, row_hi)
    acc, m, l = attend_range(q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base, tile_lo, tile_hi, row_lo, row_hi,
                             present, offs_d, d_mask, qk_scale, k_desc, v_desc, desc_row,
                             BLOCK_M, BLOCK_D, BLOCK_N, HAS_MASK, KV_TMA, EDGE_TMA, UPCAST)
    if HAS_MASK and KV_TMA:
        if holds_nan(acc):
            acc, m, l = attend_range(q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base, tile_lo, tile_hi, row_lo,
                                     row_hi, present, offs_d, d_mask, qk_scale, k_desc, v_desc, desc_row,
                                     BLOCK_M, BLOCK_D, BLOCK_N, HAS_MASK, False, False, UPCAST)
    acc = tl.where(present[:, None], acc, 0.0)
    m = tl.where(present, m, float("-inf"))
    l = tl.where(present, l, 0.0)
    return acc, m, l


@triton.jit
def window_attention_kernel(
    Q_ptr, K_ptr, V_ptr, k_desc, v_desc, cache_pos_ptr, mask_ptr, suffix_ptr, Ow_ptr, Lw_ptr,
    stride_qb, stride_qh, stride_ql, stride_kb, stride_kh, stride_kl, stride_mb,
    H_Q, L_Q, L_KV, REP, WINDOW, qk_scale,
    D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, TILES: tl.constexpr, KV_TMA: tl.constexpr, UPCAST: tl.constexpr,
):
    head = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < L_Q
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D_HEAD

    pos = tl.minimum(tl.load(cache_pos_ptr + offs_m, mask=row_ok, other=-1), L_KV - 1)
    row_lo = tl.maximum(pos - WINDOW + 1, 0)
    row_hi = tl.where(row_ok, pos, -1)
    desc_row = ((batch * (H_Q // REP) + head // REP) * L_KV).to(tl.int32)
    if takes_tile(suffix_ptr, batch, row_lo, row_hi, TILES):
        q_ptrs = Q_ptr + batch * stride_qb + head * stride_qh + offs_m[:, None].to(tl.int64) * stride_ql + offs_d[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_mask[None, :], other=0.0)
        acc, m, l = attend_rows(
            q, K_ptr, V_ptr, batch * stride_kb + (head // REP) * stride_kh, stride_kl, mask_ptr, batch * stride_mb,
            row_lo, row_hi, offs_d, d_mask, qk_scale, k_desc, v_desc, desc_row,
            BLOCK_M, BLOCK_D, BLOCK_N, HAS_MASK and TILES != SUFFIX_TILES, KV_TMA, False, UPCAST,
        )
        has_keys = (l > 0.0) | (l != l)  # noqa: PLR0124 - NaN must reach the output, not read as "no key"
        l_safe = tl.where(has_keys, l, 1.0)
        rows = (batch * H_Q + head) * L_Q + offs_m
        out = tl.where(has_keys[:, None], acc / l_safe[:, None], 0.0)
        tl.store(Ow_ptr + rows[:, None] * D_HEAD + offs_d[None, :], out, mask=row_ok[:, None] & d_mask[None, :])
        tl.store(Lw_ptr + rows, tl.where(has_keys, m + tl.log2(l_safe), float("-inf")), mask=row_ok)


def block_d(dim: int) -> int:
    """Padded head dimension of the tiles (a power of two, at least one tensor-core step)."""
    return max(16, triton.next_power_of_2(dim))


def key_value_descriptors(geo: LaunchGeometry, block_n: int) -> tuple[object, object] | None:
    """TMA descriptors of the geometry's K and V for the backward kernels (``row_descriptors``), or
    None under an attention mask (their masked keys must be read as zeros: the pointer loads do
    that). The forward kernels take ``row_descriptors`` under a mask too (``attend_rows``)."""
    return None if geo.has_mask else row_descriptors(geo.k, geo.v, block_n)


def row_descriptors(k: torch.Tensor, v: torch.Tensor, block_n: int) -> tuple[object, object] | None:
    """TMA descriptors of K and V [B, Hkv, Lkv, D] (or any pair of tensors of one shape and strides,
    e.g. the backward's sorted Q and dO* rows) as one [B * Hkv * Lkv, D] run of rows in [block_n,
    padded D] blocks (the interpreter runs them too), or None where the inputs do not allow them: a
    GPU older than sm_90, rows that are not one evenly spaced run (a batch or head expanded by
    stride 0), or a base address or row stride (in ``k``'s element size) that is not a multiple of
    16 bytes."""
    batch, hkv, lkv, dim = k.shape
    row = k.stride(2)
    evenly_spaced = (hkv == 1 or k.stride(1) == lkv * row) and (batch == 1 or k.stride(0) == hkv * lkv * row)
    aligned = (row * k.element_size()) % 16 == 0 and all(t.data_ptr() % 16 == 0 for t in (k, v))
    gpu_ok = k.device.type == "cpu" or hopper_or_newer(k.device)
    if not (evenly_spaced and aligned and gpu_ok) or batch * hkv * lkv > 2**31 - 1:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, block = [batch * hkv * lkv, dim], [block_n, block_d(dim)]
    return TensorDescriptor(k, rows, [row, 1], block), TensorDescriptor(v, rows, [row, 1], block)


def upcast_dots(geo: LaunchGeometry) -> bool:
    """Whether dots must run in fp32 (16-bit inputs under Triton's CPU interpreter)."""
    return geo.q.device.type == "cpu" and geo.q.dtype != torch.float32


def allowed_suffix_start(geo: LaunchGeometry) -> torch.Tensor:
    """Per batch row, int32 [B]: the first key of the row's allowed keys where they run unbroken to
    its last key (a left-padded row, or one the mask allows whole: the masks model code passes),
    else Lkv. A tile whose keys all lie at or past it needs no mask (``takes_tile``)."""
    keys = geo.k.shape[2]
    allowed = geo.mask[:, :keys]  # 0 or 1 (``mask_bytes``)
    first = allowed.argmax(dim=1)  # 0 when none is allowed
    hidden = keys - allowed.sum(dim=1)
    return torch.where(hidden == first, first, keys).to(torch.int32)


def tile_launches(geo: LaunchGeometry, suffix_start: torch.Tensor | None) -> tuple[tuple[int, torch.Tensor], ...]:
    """(``TILES``, suffix starts) of each launch of a forward kernel: one over every tile without
    a mask, else one over the tiles in their row's allowed suffix and one over the others."""
    if not geo.has_mask:
        return ((ALL_TILES.value, geo.mask),)  # the dummy mask stands in for the starts: never read
    return ((SUFFIX_TILES.value, suffix_start), (MASKED_TILES.value, suffix_start))


def window_attention(geo: LaunchGeometry, config: Mapping[str, int],
                     suffix_start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Window part of every (b, h, q): (output [B, Hq, Lq, D] fp32, normalised; lse2 [B, Hq, Lq] fp32).

    Reads ``window_block_m``, ``window_block_n``, ``window_warps``, ``window_stages`` from ``config``;
    whole key blocks come through the tensor memory accelerator where ``row_descriptors`` allows
    it. Under a mask ``suffix_start`` (``allowed_suffix_start``, computed here when not given)
    splits the tiles over two launches (``tile_launches``), and those that need the mask take
    pointer loads.
    Rows that attend no window key (W = 0, masked out) get zeros and ``-inf``.
    """
    q, k = geo.q, geo.k
    batch, hq, lq, dim = q.shape
    out = torch.empty(batch, hq, lq, dim, device=q.device, dtype=torch.float32)
    lse = torch.empty(batch, hq, lq, device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out, lse
    if geo.has_mask and suffix_start is None:
        suffix_start = allowed_suffix_start(geo)
    block_m, block_n = config["window_block_m"], config["window_block_n"]
    grid = (hq, triton.cdiv(lq, block_m), batch)
    for tiles, starts in tile_launches(geo, suffix_start):
        # The tiles that need the mask take pointer loads: through TMA, with the second pass compiled
        # beside them, they are slower.
        descriptors = None if tiles == MASKED_TILES.value else row_descriptors(k, geo.v, block_n)
        window_attention_kernel[grid](
            q, k, geo.v, *(descriptors or (k, geo.v)), geo.cache_position, geo.mask, starts, out, lse,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), geo.mask_stride,
            hq, lq, k.shape[2], geo.rep, geo.window, LOG2E / math.sqrt(dim),
            D_HEAD=dim, BLOCK_D=block_d(dim), BLOCK_M=block_m, BLOCK_N=block_n,
            HAS_MASK=geo.has_mask, TILES=tiles, KV_TMA=descriptors is not None, UPCAST=upcast_dots(geo),
            num_warps=config["window_warps"], num_stages=config["window_stages"],
        )
    return out, lse
