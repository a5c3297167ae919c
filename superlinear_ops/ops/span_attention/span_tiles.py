"""Grouping (query, head, span) triples into tensor-core tiles that share key blocks.

Within one (batch, KV head) group every triple attends one contiguous span of keys. Sorting the
group's triples by span start puts triples whose spans cover the same key blocks next to each
other, so a tile of ``BLOCK_M`` consecutive sorted triples streams one short range of K/V blocks
through shared memory for all its rows. The plan is built on the device by two Triton launches
around one ``torch.sort`` (each triple's sort key from its clamped bounds; the sorted triples'
bounds): no host synchronisation, shapes independent of the data (CUDA-graph safe), and few
launches (the tensor ops they replace were about 20 launches, bound by host time).

Triple numbering: the group of (b, kv head h) is ``g = b * Hkv + h``; inside it, triple ``i`` is
(query head ``h * rep + i // (Lq * K)``, query ``(i // K) % Lq``, slot ``i % K``), so its flat
slot in the contiguous [B, Hq, Lq, K] span tensors is ``g * N + i`` with ``N = rep * Lq * K``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...launch import LaunchGeometry

KEY_BLOCK = 1024  # triples per program of the plan's two kernels


@dataclass(frozen=True)
class SpanTiles:
    """The plan of each group's triples (all shape [G, N]); see ``span_tile_plan`` for the order.

    ``order[g, n]`` (int64) is the in-group triple index of the n-th sorted triple; ``lo``/``hi``
    (int32) its clamped inclusive span bounds (``hi < lo`` when it attends no span key: unused
    slot, empty or fully clamped span). Empty spans sort last.
    """

    order: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor

    @property
    def groups(self) -> int:
        """Number of (batch, KV head) groups."""
        return self.order.shape[0]

    @property
    def triples(self) -> int:
        """Triples per group (rep * Lq * K)."""
        return self.order.shape[1]


def clamped_span_bounds(geo: LaunchGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive span bounds [B, Hq, Lq, K] (int32) as every variant attends them, by tensor ops
    (the reference the plan's kernel is tested against).

    ``lo = max(qstart, 0)``; ``hi = min(qend, Lkv - 1, pos - W)`` (the last bound only when W > 0,
    so a span never reaches into its query's window, validated or not); ``hi = -1`` for an unused
    slot (qend < 0). ``pos = min(cache_position, Lkv - 1)``.
    """
    lkv = geo.k.shape[2]
    lo = geo.qstart.clamp(min=0)
    hi = geo.qend.clamp(max=lkv - 1)
    if geo.window > 0:
        pos = geo.cache_position.to(torch.int64).clamp(max=lkv - 1).view(1, 1, -1, 1)
        hi = torch.minimum(hi, pos - geo.window)
    hi = torch.where(geo.qend < 0, torch.full_like(hi, -1), hi)
    return lo.to(torch.int32), hi.to(torch.int32)


@triton.jit
def triple_bounds(qstart_ptr, qend_ptr, pos_ptr, group, triple, ok, N_TRIPLES, L_Q, L_KV, WINDOW, K_SPANS: tl.constexpr):
    """(lo, hi) (int64) of in-group triples ``triple`` of ``group``, as ``clamped_span_bounds``
    (positions past the last key read as Lkv - 1, whatever their dtype)."""
    slot = group * N_TRIPLES + triple
    qstart = tl.load(qstart_ptr + slot, mask=ok, other=-1).to(tl.int64)
    qend = tl.load(qend_ptr + slot, mask=ok, other=-1).to(tl.int64)
    pos = tl.minimum(tl.load(pos_ptr + (triple // K_SPANS) % L_Q, mask=ok, other=-1).to(tl.int64), L_KV - 1)
    hi = tl.minimum(qend, L_KV - 1)
    hi = tl.where(WINDOW > 0, tl.minimum(hi, pos - WINDOW), hi)
    return tl.maximum(qstart, 0), tl.where(qend < 0, -1, hi)


@triton.jit
def span_tile_keys_kernel(
    qstart_ptr, qend_ptr, pos_ptr, key_ptr, N_TRIPLES, L_Q, L_KV, WINDOW,
    K_SPANS: tl.constexpr, START_BLOCK: tl.constexpr, WIDE: tl.constexpr, BLOCK: tl.constexpr,
):
    """The sort key of each triple of group ``program_id(1)``: (lo // START_BLOCK, hi) packed into one
    int (lo alone for START_BLOCK 1), the dtype's largest value for an empty span."""
    group = tl.program_id(1).to(tl.int64)
    triple = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = triple < N_TRIPLES
    lo, hi = triple_bounds(qstart_ptr, qend_ptr, pos_ptr, group, triple, ok, N_TRIPLES, L_Q, L_KV, WINDOW, K_SPANS)
    if START_BLOCK == 1:
        key = lo
    else:
        key = (lo // START_BLOCK) * (L_KV + 1) + hi
    if WIDE:
        key = tl.where(hi < lo, 0x7FFFFFFFFFFFFFFF, key)
    else:
        key = tl.where(hi < lo, 0x7FFFFFFF, key).to(tl.int32)
    tl.store(key_ptr + group * N_TRIPLES + triple, key, mask=ok)


@triton.jit
def sorted_bounds_kernel(
    qstart_ptr, qend_ptr, pos_ptr, order_ptr, lo_ptr, hi_ptr, N_TRIPLES, L_Q, L_KV, WINDOW,
    K_SPANS: tl.constexpr, BLOCK: tl.constexpr,
):
    """lo/hi (int32) of the n-th sorted triple of group ``program_id(1)`` at [group, n]: the tile
    kernels read a tile's bounds as one contiguous run, beside its order (not after it)."""
    group = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N_TRIPLES
    triple = tl.load(order_ptr + group * N_TRIPLES + offs, mask=ok, other=0)
    lo, hi = triple_bounds(qstart_ptr, qend_ptr, pos_ptr, group, triple, ok, N_TRIPLES, L_Q, L_KV, WINDOW, K_SPANS)
    tl.store(lo_ptr + group * N_TRIPLES + offs, lo.to(tl.int32), mask=ok)
    tl.store(hi_ptr + group * N_TRIPLES + offs, hi.to(tl.int32), mask=ok)


def span_tile_plan(geo: LaunchGeometry, start_block: int = 1) -> SpanTiles:
    """Sort each group's triples by clamped span start (empty spans last), on the device.

    With ``start_block`` > 1 the sort key is (start // start_block, end): triples whose spans start
    in the same block of keys are ordered by span end, so a tile of them covers about one span
    length plus ``start_block`` keys even where many spans of different lengths start together
    (training: every query attends a few early keys). The sort is stable: ties keep triple order.
    """
    if isinstance(start_block, bool) or not isinstance(start_block, int) or start_block < 1:
        raise ValueError(f"start_block must be a positive int, got {start_block!r}")
    batch, hq, lq, n_spans = geo.qstart.shape
    hkv, lkv = geo.k.shape[1], geo.k.shape[2]
    groups, triples = batch * hkv, hq // hkv * lq * n_spans
    # the packed key in int32 where it fits (a faster sort), else int64; lo // 1 alone always fits
    wide = start_block > 1 and (lkv // start_block + 1) * (lkv + 1) >= torch.iinfo(torch.int32).max
    device = geo.q.device
    key = torch.empty(groups, triples, device=device, dtype=torch.int64 if wide else torch.int32)
    lo = torch.empty(groups, triples, device=device, dtype=torch.int32)
    hi = torch.empty_like(lo)
    if not lo.numel():
        return SpanTiles(order=key.long(), lo=lo, hi=hi)
    grid = (triton.cdiv(triples, KEY_BLOCK), groups)
    bounds = (geo.qstart, geo.qend, geo.cache_position)
    span_tile_keys_kernel[grid](*bounds, key, triples, lq, lkv, geo.window, K_SPANS=n_spans, START_BLOCK=start_block,
                                WIDE=wide, BLOCK=KEY_BLOCK, num_warps=4)
    order = torch.sort(key, dim=1, stable=True).indices
    sorted_bounds_kernel[grid](*bounds, order, lo, hi, triples, lq, lkv, geo.window, K_SPANS=n_spans, BLOCK=KEY_BLOCK,
                               num_warps=4)
    return SpanTiles(order=order, lo=lo, hi=hi)
