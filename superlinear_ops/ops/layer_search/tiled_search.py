"""The whole layer's stripe search in Triton (semantics section 4, step 1).

One program holds ``BLOCK_Q`` queries of ``BLOCK_H`` heads of one KV group: ``BLOCK_H * BLOCK_Q``
rows, row r = (head r // BLOCK_Q, query r % BLOCK_Q). It walks the stripes in increasing order.
For stripe i it gathers one key row per query, K[t_q - floor(i ** inv_p)] (consecutive rows when
the positions are consecutive; neighbouring query blocks read neighbouring rows at about the same
time), and scores all rows against all those keys with one tensor-core dot: the wanted score of
row r is the diagonal entry (r, r % BLOCK_Q), so the dot wastes BLOCK_Q - 1 of every BLOCK_Q
products but runs at the tensor-core rate and reads each key row once for the group's heads.
Products of 16-bit inputs are exact in fp32 and summed in fp32 (fp32 inputs: IEEE fp32 dots).

Each row keeps its best ``TOPK`` (score, key) pairs in registers: a new score replaces the worst
kept one when it is at least as large, the worst being the lowest score and, among equal lowest
scores, the nearest key (the smallest stripe index), so among equal scores the farther stripe
wins. A NaN score counts as +inf. Beside the anchors the kernel stores the kept scores (fp32,
EMPTY_SCORE for an empty slot): the layer's gate scores, Q1 . K[anchor], so that the forward
need not gather the anchors' keys again. No host synchronisation.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ... import geometry
from ...buckets import next_power_of_two
from ...launch import KernelConfig, check_tile_config, mask_bytes, unit_stride
from ...settings import SpanSettings
from ..gate.kernels import EMPTY_SCORE
from ..kernel_helpers import tc_dot
from .reference import Found

SEARCH_TUNABLES = ("block_q", "block_h", "num_warps", "num_stages")
EMPTY_SLOT = tl.constexpr(-(1 << 30))  # padding slots' key: never the worst, never an anchor
QUERY_BLOCK = 1024  # queries per program of query_tables_kernel


@triton.jit
def query_tables_kernel(cache_position_ptr, offsets_ptr, pos_ptr, count_ptr, L_Q, L_KV, N_STRIPES,
                        STEPS: tl.constexpr, BLOCK: tl.constexpr):
    """Each query's position clamped to [-1, Lkv - 1] (int32) and its stripe count, the number of
    offsets <= t = pos + 1 (a binary search of ``STEPS`` halvings over the increasing offsets)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < L_Q
    pos = tl.load(cache_position_ptr + offs, mask=ok, other=-1).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, -1), L_KV - 1)
    lo = tl.zeros((BLOCK,), dtype=tl.int32)
    hi = lo + N_STRIPES
    for _ in tl.static_range(STEPS):  # invariant: offsets[:lo] <= t < offsets[hi:]
        open_ = lo < hi
        mid = (lo + hi) // 2
        below = tl.load(offsets_ptr + mid, mask=open_, other=0) <= pos + 1
        lo = tl.where(open_ & below, mid + 1, lo)
        hi = tl.where(open_ & ~below, mid, hi)
    tl.store(pos_ptr + offs, pos.to(tl.int32), mask=ok)
    tl.store(count_ptr + offs, lo, mask=ok)


@triton.jit
def _stripe_keys(K_ptr, kv_base, stride_kl, mask_ptr, mask_base, offsets_ptr, j, N_STRIPES, t_k, n_k, offs_d, d_mask,
                 HAS_MASK: tl.constexpr):
    """Stripe j's key row for each query of the block: (keys [BLOCK_Q, BLOCK_D], valid [BLOCK_Q],
    the stripe's offset); a stripe past a query's count (or past the table) is invalid for it."""
    offset = tl.load(offsets_ptr + tl.minimum(j, N_STRIPES - 1)).to(tl.int32)
    loc = t_k - offset
    valid = j < n_k
    if HAS_MASK:
        valid = valid & (tl.load(mask_ptr + mask_base + loc, mask=valid, other=0) != 0)
    keys = tl.load(K_ptr + kv_base + loc[:, None].to(tl.int64) * stride_kl + offs_d[None, :],
                   mask=valid[:, None] & d_mask[None, :], other=0.0)
    return keys, valid, offset


@triton.jit
def layer_search_kernel(
    Q1_ptr, K_ptr, pos_ptr, count_ptr, offsets_ptr, mask_ptr, anchor_ptr, score_ptr,
    stride_qb, stride_qh, stride_ql, stride_kb, stride_kh, stride_kl, stride_mb,
    H_Q, L_Q, REP, N_HEAD_BLOCKS, N_STRIPES,
    TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, HAS_MASK: tl.constexpr, UPCAST: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_H * BLOCK_Q
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1) // N_HEAD_BLOCKS
    head_block = tl.program_id(1) % N_HEAD_BLOCKS
    batch = tl.program_id(2).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D_HEAD
    # Key rows: one per query of the block.
    offs_k = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    t_k = tl.load(pos_ptr + offs_k, mask=offs_k < L_Q, other=-1) + 1
    n_k = tl.load(count_ptr + offs_k, mask=offs_k < L_Q, other=0)  # stripes with loc >= 0
    # Score rows: (head, query) pairs.
    rows = tl.arange(0, BLOCK_M)
    local_head = head_block * BLOCK_H + rows // BLOCK_Q
    offs_q = q_block * BLOCK_Q + rows % BLOCK_Q
    row_ok = (local_head < REP) & (offs_q < L_Q)
    t_r = tl.load(pos_ptr + offs_q, mask=row_ok, other=-1) + 1
    heads = (kv_head * REP + local_head).to(tl.int64)
    q1 = tl.load(Q1_ptr + batch * stride_qb + heads[:, None] * stride_qh + offs_q[:, None].to(tl.int64) * stride_ql
                 + offs_d[None, :], mask=row_ok[:, None] & d_mask[None, :], other=0.0)
    diagonal = (rows % BLOCK_Q)[:, None] == tl.arange(0, BLOCK_Q)[None, :]
    kv_base = batch * stride_kb + kv_head.to(tl.int64) * stride_kh

    slot = tl.arange(0, TOPK_PAD)[None, :]
    zeros = tl.zeros((BLOCK_M, TOPK_PAD), dtype=tl.int32)
    best = tl.where(slot < TOPK, float("-inf"), float("inf")) + zeros.to(tl.float32)
    best_key = tl.where(slot < TOPK, -1 - slot, EMPTY_SLOT) + zeros  # distinct: one worst slot at a time

    mask_base = batch * stride_mb
    keys, key_ok, offset = _stripe_keys(K_ptr, kv_base, stride_kl, mask_ptr, mask_base, offsets_ptr, 0, N_STRIPES,
                                        t_k, n_k, offs_d, d_mask, HAS_MASK)
    for j in range(0, tl.max(n_k, axis=0)):
        # Issue the next stripe's loads before this stripe's work, so that their latency overlaps it.
        next_keys, next_ok, next_offset = _stripe_keys(K_ptr, kv_base, stride_kl, mask_ptr, mask_base, offsets_ptr,
                                                       j + 1, N_STRIPES, t_k, n_k, offs_d, d_mask, HAS_MASK)
        scores = tc_dot(q1, tl.trans(keys), UPCAST)  # [BLOCK_M, BLOCK_Q]; row r wants column r % BLOCK_Q
        score = tl.sum(tl.where(diagonal, scores, 0.0), axis=1)
        score = tl.where(score != score, float("inf"), score)
        ok = tl.sum(tl.where(diagonal, key_ok.to(tl.int32)[None, :], 0), axis=1) > 0
        worst = tl.min(best, axis=1)
        is_worst = best == worst[:, None]
        worst_key = tl.max(tl.where(is_worst, best_key, EMPTY_SLOT), axis=1)  # nearest key among the worst
        take = is_worst & (best_key == worst_key[:, None]) & ((score >= worst) & ok)[:, None]
        best = tl.where(take, score[:, None], best)
        best_key = tl.where(take, (t_r - offset)[:, None] + zeros, best_key)
        keys, key_ok, offset = next_keys, next_ok, next_offset

    found = best_key >= 0
    out = ((batch * H_Q + heads[:, None]) * L_Q + offs_q[:, None].to(tl.int64)) * TOPK + slot
    tl.store(anchor_ptr + out, tl.where(found, best_key, -1).to(tl.int64), mask=row_ok[:, None] & (slot < TOPK))
    tl.store(score_ptr + out, tl.where(found, best, EMPTY_SCORE), mask=row_ok[:, None] & (slot < TOPK))


class SearchTables(NamedTuple):
    """What both search kernels read besides the tiles, and the outputs they fill: the anchors and
    their scores (uninitialised), the stripe offsets, each query's position (int32) and stripe count,
    Q1 and K with unit D strides, and the mask bytes."""

    found: Found
    offsets: torch.Tensor
    positions: torch.Tensor
    count: torch.Tensor
    q1: torch.Tensor
    k: torch.Tensor
    mask: torch.Tensor


def search_tables(q1: torch.Tensor, k: torch.Tensor, cache_position: torch.Tensor, attention_mask: torch.Tensor | None,
                  settings: SpanSettings) -> SearchTables:
    """The search's tables for validated inputs (one launch of ``query_tables_kernel``)."""
    batch, hq, lq, _ = q1.shape
    device = q1.device
    found = Found(torch.empty(batch, hq, lq, settings.topk, dtype=torch.int64, device=device),
                  torch.empty(batch, hq, lq, settings.topk, dtype=torch.float32, device=device))
    offsets = geometry.stripe_offsets_tensor(k.shape[2], settings.sw_index, settings.params, device)
    positions = torch.empty(lq, dtype=torch.int32, device=device)
    count = torch.empty_like(positions)
    if lq:
        query_tables_kernel[(triton.cdiv(lq, QUERY_BLOCK),)](
            cache_position.contiguous(), offsets, positions, count, lq, k.shape[2], offsets.numel(),
            STEPS=max(1, offsets.numel().bit_length()), BLOCK=QUERY_BLOCK, num_warps=4,
        )
    return SearchTables(found, offsets, positions, count, unit_stride(q1), unit_stride(k),
                        mask_bytes(attention_mask, device))


def launch_search(kernel, q1: torch.Tensor, k: torch.Tensor, cache_position: torch.Tensor,
                  attention_mask: torch.Tensor | None, settings: SpanSettings, config: KernelConfig, **own) -> Found:
    """Anchors and scores from a search ``kernel`` run over (query blocks, KV heads x head blocks,
    batch): the arguments both search kernels take, then ``own`` (the kernel's other constexprs and
    launch options)."""
    tables = search_tables(q1, k, cache_position, attention_mask, settings)
    if tables.found.anchors.numel() == 0:
        return tables.found
    batch, hq, lq, dim = q1.shape
    hkv = k.shape[1]
    rep = hq // hkv
    head_blocks = triton.cdiv(rep, config.block_h)
    grid = (triton.cdiv(lq, config.block_q), hkv * head_blocks, batch)
    q1, k, mask = tables.q1, tables.k, tables.mask
    kernel[grid](
        q1, k, tables.positions, tables.count, tables.offsets, mask, *tables.found,
        q1.stride(0), q1.stride(1), q1.stride(2), k.stride(0), k.stride(1), k.stride(2), mask.stride(0),
        hq, lq, rep, head_blocks, tables.offsets.numel(),
        TOPK=settings.topk, TOPK_PAD=next_power_of_two(settings.topk), D_HEAD=dim, BLOCK_D=max(16, next_power_of_two(dim)),
        BLOCK_Q=config.block_q, BLOCK_H=config.block_h, HAS_MASK=attention_mask is not None,
        UPCAST=q1.device.type == "cpu", num_warps=config.num_warps, **own,
    )
    return tables.found


def tiled_search(
    q1: torch.Tensor,
    k: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    settings: SpanSettings,
    config: KernelConfig,
) -> Found:
    """Anchors [B, Hq, Lq, topk] (int64, -1: empty slot) and their scores for validated inputs (see
    the module docstring)."""
    check_tile_config(config, SEARCH_TUNABLES)
    return launch_search(layer_search_kernel, q1, k, cache_position, attention_mask, settings, config,
                         num_stages=config.num_stages)
