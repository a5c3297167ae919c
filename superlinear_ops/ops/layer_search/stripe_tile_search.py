"""The layer's stripe search over tiles of stripes (semantics section 4, step 1): no product thrown away
when a KV group has 16 or more query heads.

One program holds ``BLOCK_Q`` consecutive queries of ``BLOCK_H`` heads of one KV group: the dot's
rows are r = (query r // BLOCK_H, head r % BLOCK_H). It walks the stripes in tiles of ``BLOCK_S``:
column c = (query c // BLOCK_S, stripe j0 + c % BLOCK_S) holds that query's stripe key,
K[t - floor(j ** inv_p)], so one tensor-core dot scores each query's heads against ``BLOCK_S`` of
its stripes, and row r wants exactly the columns of its own query. With ``BLOCK_Q`` 1 (16 heads or
more per group) every product is a wanted score; each query's key rows are gathered once for all
``BLOCK_H`` heads. (``search_kernel`` is the other layout: one stripe at a time, a key row per query,
the dot's diagonal kept.)

Each row keeps its best ``TOPK`` (score, stripe) pairs in registers, ordered by score and then by
stripe index (among equal scores the farther stripe wins); a NaN score counts as +inf. A tile whose
best candidate beats no row's worst kept pair costs two row reductions over the tile (its best
score, and whether it has a candidate); otherwise its candidates are taken best first, at most
``TOPK`` per row. The next tile's key rows are loaded before this tile's work, by hand (Triton's
own pipelining added nothing), so the kernel runs with one stage. Beside the anchors it stores
their scores (``tiled_search``'s layout). No host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...launch import KernelConfig, check_tile_config
from ...settings import SpanSettings
from ..kernel_helpers import tc_dot
from .reference import Found
from .tiled_search import EMPTY_SCORE, launch_search

STRIPE_TILE_TUNABLES = ("block_s", "block_h", "block_q", "num_warps")
NO_STRIPE = tl.constexpr(1 << 30)  # padding slots' stripe: never the worst, never an anchor


@triton.jit
def _stripe_tile(K_ptr, kv_base, stride_kl, mask_ptr, mask_base, offsets_ptr, j0, N_STRIPES, t_c, n_c, offs_s, offs_d,
                 d_mask, HAS_MASK: tl.constexpr):
    """The key rows of stripes j0 + offs_s for each column's query: (keys [N, BLOCK_D], the
    columns' validity and stripe indices); a stripe past its query's count is invalid."""
    j = j0 + offs_s
    offset = tl.load(offsets_ptr + tl.minimum(j, N_STRIPES - 1)).to(tl.int32)
    loc = t_c - offset
    valid = j < n_c
    keys = tl.load(K_ptr + kv_base + loc[:, None].to(tl.int64) * stride_kl + offs_d[None, :],
                   mask=valid[:, None] & d_mask[None, :], other=0.0)
    if HAS_MASK:
        valid = valid & (tl.load(mask_ptr + mask_base + loc, mask=valid, other=0) != 0)
    return keys, valid, j


@triton.jit
def _worst_kept(best, best_j):
    """Each row's worst kept pair: the lowest score and, among equal lowest scores, the smallest stripe."""
    worst = tl.min(best, axis=1)
    worst_j = tl.min(tl.where(best == worst[:, None], best_j, NO_STRIPE), axis=1)
    return worst, worst_j


@triton.jit
def stripe_tile_search_kernel(
    Q1_ptr, K_ptr, pos_ptr, count_ptr, offsets_ptr, mask_ptr, anchor_ptr, score_ptr,
    stride_qb, stride_qh, stride_ql, stride_kb, stride_kh, stride_kl, stride_mb,
    H_Q, L_Q, REP, N_HEAD_BLOCKS, N_STRIPES,
    TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, D_HEAD: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, HAS_MASK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    BLOCK_N: tl.constexpr = BLOCK_Q * BLOCK_S
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1) // N_HEAD_BLOCKS
    head_block = tl.program_id(1) % N_HEAD_BLOCKS
    batch = tl.program_id(2).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D_HEAD
    # Columns: (query, stripe) pairs.
    cols = tl.arange(0, BLOCK_N)
    offs_s = cols % BLOCK_S
    col_q = q_block * BLOCK_Q + cols // BLOCK_S
    t_c = tl.load(pos_ptr + col_q, mask=col_q < L_Q, other=-1) + 1
    n_c = tl.load(count_ptr + col_q, mask=col_q < L_Q, other=0)  # stripes with loc >= 0
    # Rows: (query, head) pairs.
    rows = tl.arange(0, BLOCK_M)
    local_head = head_block * BLOCK_H + rows % BLOCK_H
    offs_q = q_block * BLOCK_Q + rows // BLOCK_H
    row_ok = (local_head < REP) & (offs_q < L_Q)
    heads = (kv_head * REP + local_head).to(tl.int64)
    q1 = tl.load(Q1_ptr + batch * stride_qb + heads[:, None] * stride_qh + offs_q[:, None].to(tl.int64) * stride_ql
                 + offs_d[None, :], mask=row_ok[:, None] & d_mask[None, :], other=0.0)
    own_query = (rows // BLOCK_H)[:, None] == (cols // BLOCK_S)[None, :]
    kv_base = batch * stride_kb + kv_head.to(tl.int64) * stride_kh
    mask_base = batch * stride_mb

    slot = tl.arange(0, TOPK_PAD)[None, :]
    zeros = tl.zeros((BLOCK_M, TOPK_PAD), dtype=tl.int32)
    best = tl.where(slot < TOPK, float("-inf"), float("inf")) + zeros.to(tl.float32)
    best_j = tl.where(slot < TOPK, -1 - slot, NO_STRIPE) + zeros  # distinct: one worst slot at a time

    keys, col_ok, j = _stripe_tile(K_ptr, kv_base, stride_kl, mask_ptr, mask_base, offsets_ptr, 0, N_STRIPES, t_c, n_c,
                                   offs_s, offs_d, d_mask, HAS_MASK)
    for j0 in range(0, tl.max(n_c, axis=0), BLOCK_S):
        # Issue the next tile's loads before this tile's work, so that their latency overlaps it.
        next_keys, next_ok, next_j = _stripe_tile(K_ptr, kv_base, stride_kl, mask_ptr, mask_base, offsets_ptr,
                                                  j0 + BLOCK_S, N_STRIPES, t_c, n_c, offs_s, offs_d, d_mask, HAS_MASK)
        scores = tc_dot(q1, tl.trans(keys), UPCAST)  # [BLOCK_M, BLOCK_N]
        scores = tl.where(scores != scores, float("inf"), scores)
        candidate = own_query & col_ok[None, :]
        top = tl.max(tl.where(candidate, scores, float("-inf")), axis=1)
        present = tl.max(candidate.to(tl.int32), axis=1) > 0
        worst, worst_j = _worst_kept(best, best_j)
        go = present & (top >= worst)
        # Take candidates best first while one beats a row's worst kept pair (at most TOPK per row).
        while tl.max(go.to(tl.int32), axis=0) > 0:
            top_j = tl.max(tl.where(candidate & (scores == top[:, None]), j[None, :], -1), axis=1)
            beats = go & ((top > worst) | (top_j > worst_j))
            take = (best == worst[:, None]) & (best_j == worst_j[:, None]) & beats[:, None]
            best = tl.where(take, top[:, None], best)
            best_j = tl.where(take, top_j[:, None], best_j)
            candidate = candidate & (j[None, :] != top_j[:, None])
            top = tl.max(tl.where(candidate, scores, float("-inf")), axis=1)
            present = tl.max(candidate.to(tl.int32), axis=1) > 0
            worst, worst_j = _worst_kept(best, best_j)
            go = beats & present & (top >= worst)
        keys, col_ok, j = next_keys, next_ok, next_j

    found = (best_j >= 0) & (best_j < NO_STRIPE)
    offset = tl.load(offsets_ptr + tl.where(found, best_j, 0), mask=found, other=0).to(tl.int32)
    t_r = tl.load(pos_ptr + offs_q, mask=row_ok, other=-1) + 1
    anchors = tl.where(found, t_r[:, None] - offset, -1).to(tl.int64)
    out = ((batch * H_Q + heads[:, None]) * L_Q + offs_q[:, None].to(tl.int64)) * TOPK + slot
    tl.store(anchor_ptr + out, anchors, mask=row_ok[:, None] & (slot < TOPK))
    tl.store(score_ptr + out, tl.where(found, best, EMPTY_SCORE), mask=row_ok[:, None] & (slot < TOPK))


def stripe_tile_search(
    q1: torch.Tensor,
    k: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    settings: SpanSettings,
    config: KernelConfig,
) -> Found:
    """Anchors [B, Hq, Lq, topk] (int64, -1: empty slot) and their scores for validated inputs (see
    the module docstring)."""
    check_tile_config(config, STRIPE_TILE_TUNABLES)
    if config.block_q * config.block_h < 16 or config.block_q * config.block_s < 16:
        raise ValueError(f"config needs block_q * block_h >= 16 and block_q * block_s >= 16 (tensor-core dots), "
                         f"got {config.text()}")
    return launch_search(stripe_tile_search_kernel, q1, k, cache_position, attention_mask, settings, config,
                         BLOCK_S=config.block_s, num_stages=1)
