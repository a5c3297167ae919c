"""Staged-decode stripe search in one Triton program per (batch, query head).

It scores every stripe key against the search query (fp32, unscaled; invalid stripes -inf), keeps
the top ``TOPK`` (lowest stripe index first among ties; missing slots score -inf with anchor -1; a
NaN score counts as +inf, so it is chosen and the gate's softmax turns the output NaN),
and turns each anchor into its span [qstart, qend] with the exact span-length tables
(semantics section 3, steps 1-3): one launch in place of a chain of small PyTorch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...launch import mask_bytes, unit_stride


@triton.jit
def stripe_search_kernel(
    Q1_ptr, K_ptr, offsets_ptr, cache_pos_ptr, mask_ptr, first_ptr, back_ptr, forward_ptr,
    scratch_ptr, qstart_ptr, qend_ptr, score_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_mb,
    H_Q, L_KV, REP, WINDOW, N_STRIPES, LAST,
    TOPK: tl.constexpr, S_POW2: tl.constexpr, BLOCK_S: tl.constexpr, D_HEAD: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_MASK: tl.constexpr, HAS_FORWARD: tl.constexpr,
):
    head = tl.program_id(0).to(tl.int64)
    batch = tl.program_id(1).to(tl.int64)
    row = batch * H_Q + head
    pos = tl.minimum(tl.load(cache_pos_ptr + LAST), L_KV - 1)
    t = pos + 1
    window_start = tl.maximum(pos - WINDOW + 1, 0)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D_HEAD
    q = tl.load(Q1_ptr + batch * stride_qb + head * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    kv_base = batch * stride_kb + (head // REP) * stride_kh

    for s0 in range(0, N_STRIPES, BLOCK_S):
        idx = s0 + tl.arange(0, BLOCK_S)
        in_table = idx < N_STRIPES
        loc = t - tl.load(offsets_ptr + idx, mask=in_table, other=0)  # other=0 gives loc = t: invalid
        valid = (loc >= 0) & (loc < window_start)
        if HAS_MASK:
            allowed = tl.load(mask_ptr + batch * stride_mb + loc, mask=valid, other=0)
            valid = valid & (allowed != 0)
        keys = tl.load(
            K_ptr + kv_base + loc[:, None].to(tl.int64) * stride_kl + offs_d[None, :],
            mask=valid[:, None] & d_mask[None, :], other=0.0,
        ).to(tl.float32)
        scores = tl.where(valid, tl.sum(keys * q[None, :], axis=1), float("-inf"))
        scores = tl.where(scores != scores, float("inf"), scores)  # a NaN score wins and makes the gate NaN
        tl.store(scratch_ptr + row * S_POW2 + idx, scores, mask=in_table)
    tl.debug_barrier()

    slots = tl.arange(0, S_POW2)
    scores = tl.load(scratch_ptr + row * S_POW2 + slots, mask=slots < N_STRIPES, other=float("-inf"))
    back = tl.load(back_ptr + t)
    limit = tl.where(WINDOW > 0, pos - WINDOW, pos)
    if HAS_FORWARD:
        forward = tl.load(forward_ptr + tl.maximum(t - tl.load(first_ptr + batch), 0))
    for j in tl.static_range(TOPK):
        best = tl.max(scores, axis=0)
        pick = tl.min(tl.where(scores == best, slots, S_POW2), axis=0)
        chosen = best > float("-inf")
        anchor = t - tl.load(offsets_ptr + pick)
        start = tl.where(chosen, tl.maximum(anchor - back, 0), -1)
        if HAS_FORWARD:
            end = tl.minimum(anchor + forward, limit)
        else:
            end = anchor
        end = tl.where(chosen, end, -1)
        tl.store(qstart_ptr + row * TOPK + j, start)
        tl.store(qend_ptr + row * TOPK + j, end)
        tl.store(score_ptr + row * TOPK + j, best)
        scores = tl.where(slots == pick, float("-inf"), scores)


def stripe_search(
    q1: torch.Tensor,
    k: torch.Tensor,
    offsets: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    back_table: torch.Tensor,
    forward_table: torch.Tensor | None,
    window: int,
    topk: int,
    block_s: int = 32,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qstart, qend) [B, Hq, 1, topk] int64 and the chosen scores [B, Hq, topk] fp32."""
    batch, hq, _, dim = q1.shape
    lkv = k.shape[2]
    q1, k, mask = unit_stride(q1), unit_stride(k), mask_bytes(attention_mask, q1.device)
    has_forward = forward_table is not None
    if has_forward and attention_mask is not None:
        first = (attention_mask[:, :lkv] != 0).to(torch.int8).argmax(dim=1)
    else:
        first = torch.zeros(batch, dtype=torch.int64, device=q1.device)
    n_stripes = offsets.numel()
    s_pow2 = triton.next_power_of_2(n_stripes)
    scratch = torch.empty(batch * hq * s_pow2, dtype=torch.float32, device=q1.device)
    qstart = torch.empty(batch, hq, 1, topk, dtype=torch.int64, device=q1.device)
    qend = torch.empty_like(qstart)
    scores = torch.empty(batch, hq, topk, dtype=torch.float32, device=q1.device)
    cache_position = cache_position if cache_position.dtype == torch.int64 else cache_position.long()
    stripe_search_kernel[(hq, batch)](
        q1, k, offsets, cache_position, mask, first, back_table,
        forward_table if has_forward else back_table,
        scratch, qstart, qend, scores,
        q1.stride(0), q1.stride(1), k.stride(0), k.stride(1), k.stride(2),
        mask.stride(0) if attention_mask is not None else 0,
        hq, lkv, hq // k.shape[1], window, n_stripes, cache_position.numel() - 1,
        TOPK=topk, S_POW2=s_pow2, BLOCK_S=block_s, D_HEAD=dim, BLOCK_D=triton.next_power_of_2(dim),
        HAS_MASK=attention_mask is not None, HAS_FORWARD=has_forward, num_warps=num_warps,
    )
    return qstart, qend, scores
