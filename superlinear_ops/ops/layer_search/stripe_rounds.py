"""The stripe-tile search launched in rounds that fill the GPU once (semantics section 4, step 1).

Each query gathers one key row per stripe, and a key row is wanted by about as many queries as a
chunk spans stripe gaps (some 20 at 32,768 queries over 10M keys), all at different stripe indices.
One launch of ``stripe_tile_search_kernel`` over the whole chunk runs its programs in waves that
drift apart, so those queries gather the row at different times and each gather goes to memory.
Here the same kernel is launched once per round of ``programs_per_sm`` programs per multiprocessor,
for one KV group at a time: a round's programs start together and walk their stripes at one pace,
so at any moment they read keys within one window as wide as the round's queries, and a key row
gathered by one query is still in L2 when another query of the round wants it. The reuse grows with
the round: of the queries wanting a row, those within one round share it (a round of R consecutive
queries shares a stripe's rows where the stripe gap is below R: gaps reach about 930 positions at
1M keys and 2,600 at 10M), and a round is at most the programs a GPU holds at once. Each round
writes its own [B, group heads, queries, topk] block, copied into place after the launch. The
anchors and scores are the stripe-tile search's, bit for bit. No host synchronisation; the
multiprocessor count is the device's (1 on the CPU, where the interpreter runs programs one at a
time).
"""

from __future__ import annotations

import torch
import triton

from ...buckets import next_power_of_two
from ...launch import KernelConfig, check_tile_config
from ...problem import device_identity
from ...settings import SpanSettings
from .reference import Found
from .stripe_tile_search import STRIPE_TILE_TUNABLES, stripe_tile_search_kernel
from .tiled_search import search_tables

ROUND_TUNABLES = (*STRIPE_TILE_TUNABLES, "programs_per_sm")


def round_queries(batch: int, group_heads: int, queries: int, config: KernelConfig, device: torch.device) -> int:
    """Queries per round: as many query blocks as make ``programs_per_sm`` programs on each of the
    device's multiprocessors for one KV group (at least one block)."""
    programs = config.programs_per_sm * max(1, device_identity(device).multiprocessors)
    blocks = max(1, programs // (triton.cdiv(group_heads, config.block_h) * batch))
    return min(blocks * config.block_q, triton.cdiv(queries, config.block_q) * config.block_q)


def stripe_round_search(
    q1: torch.Tensor,
    k: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    settings: SpanSettings,
    config: KernelConfig,
) -> Found:
    """Anchors [B, Hq, Lq, topk] (int64, -1: empty slot) and their scores for validated inputs, in
    rounds (see the module docstring)."""
    check_tile_config(config, ROUND_TUNABLES)
    if config.block_q * config.block_h < 16 or config.block_q * config.block_s < 16:
        raise ValueError(f"config needs block_q * block_h >= 16 and block_q * block_s >= 16 (tensor-core dots), "
                         f"got {config.text()}")
    tables = search_tables(q1, k, cache_position, attention_mask, settings)
    found = tables.found
    if found.anchors.numel() == 0:
        return found
    batch, hq, lq, dim = q1.shape
    groups = k.shape[1]
    rep = hq // groups
    head_blocks = triton.cdiv(rep, config.block_h)
    per_round = round_queries(batch, rep, lq, config, q1.device)
    staged = Found(found.anchors.new_empty(batch * rep * per_round * settings.topk),
                   found.scores.new_empty(batch * rep * per_round * settings.topk))
    q1_all, k_all, mask = tables.q1, tables.k, tables.mask
    for group in range(groups):
        heads = slice(group * rep, (group + 1) * rep)
        k_group = k_all[:, group:group + 1]
        for start in range(0, lq, per_round):
            count = min(per_round, lq - start)
            q1_round = q1_all[:, heads, start:start + count]
            anchors, scores = (t[:batch * rep * count * settings.topk].view(batch, rep, count, settings.topk) for t in staged)
            stripe_tile_search_kernel[(triton.cdiv(count, config.block_q), head_blocks, batch)](
                q1_round, k_group, tables.positions[start:start + count], tables.count[start:start + count],
                tables.offsets, mask, anchors, scores,
                q1_round.stride(0), q1_round.stride(1), q1_round.stride(2), k_group.stride(0), k_group.stride(1),
                k_group.stride(2), mask.stride(0), rep, count, rep, head_blocks, tables.offsets.numel(),
                TOPK=settings.topk, TOPK_PAD=next_power_of_two(settings.topk), D_HEAD=dim,
                BLOCK_D=max(16, next_power_of_two(dim)), BLOCK_S=config.block_s, BLOCK_Q=config.block_q,
                BLOCK_H=config.block_h, HAS_MASK=attention_mask is not None, UPCAST=q1.device.type == "cpu",
                num_warps=config.num_warps, num_stages=1,
            )
            found.anchors[:, heads, start:start + count].copy_(anchors)
            found.scores[:, heads, start:start + count].copy_(scores)
    return found
