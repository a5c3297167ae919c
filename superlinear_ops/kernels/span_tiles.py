"""Grouping (query, head, span) triples into tensor-core tiles that share key blocks.

Within one (batch, KV head) group every triple attends one contiguous span of keys. Sorting the
group's triples by span start puts triples whose spans cover the same key blocks next to each
other, so a tile of ``BLOCK_M`` consecutive sorted triples streams one short range of K/V blocks
through shared memory for all its rows. The plan is built on the device with ``torch.sort``: no
host synchronisation, shapes independent of the data (CUDA-graph safe).

Triple numbering: the group of (b, kv head h) is ``g = b * Hkv + h``; inside it, triple ``i`` is
(query head ``h * rep + i // (Lq * K)``, query ``(i // K) % Lq``, slot ``i % K``), so its flat
slot in the contiguous [B, Hq, Lq, K] span tensors is ``g * N + i`` with ``N = rep * Lq * K``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .launch import LaunchGeometry


@dataclass(frozen=True)
class SpanTiles:
    """Triples of each group sorted by clamped span start (all int32, shape [G, N]); see
    ``span_tile_plan`` for the order within a block of starts.

    ``order[g, n]`` is the in-group triple index of the n-th sorted triple; ``lo``/``hi`` its
    clamped inclusive span bounds (``hi < lo`` when it attends no span key: unused slot, empty or
    fully clamped span). Empty spans sort last.
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
    """Inclusive span bounds [B, Hq, Lq, K] (int32) as every variant attends them.

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


def span_tile_plan(geo: LaunchGeometry, start_block: int = 1) -> SpanTiles:
    """Sort each group's triples by clamped span start (empty spans last), on the device.

    With ``start_block`` > 1 the sort key is (start // start_block, end): triples whose spans start
    in the same block of keys are ordered by span end, so a tile of them covers about one span
    length plus ``start_block`` keys even where many spans of different lengths start together
    (training: every query attends a few early keys).
    """
    if isinstance(start_block, bool) or not isinstance(start_block, int) or start_block < 1:
        raise ValueError(f"start_block must be a positive int, got {start_block!r}")
    groups = geo.qstart.shape[0] * geo.k.shape[1]
    lo, hi = clamped_span_bounds(geo)
    lo, hi = lo.reshape(groups, -1), hi.reshape(groups, -1)
    empty = hi < lo
    lkv = geo.k.shape[2]
    if start_block == 1:
        key = lo
    else:  # lo // start_block and hi (0 <= hi < Lkv) packed into one int (int32 where it fits: faster sort)
        wide = (lkv // start_block + 1) * (lkv + 1) >= torch.iinfo(torch.int32).max
        dtype = torch.int64 if wide else torch.int32
        key = (lo // start_block).to(dtype) * (lkv + 1) + hi.to(dtype)
    key = torch.where(empty, torch.full_like(key, torch.iinfo(key.dtype).max), key)
    key, order = torch.sort(key, dim=1, stable=True)
    return SpanTiles(
        order=order.to(torch.int32),
        lo=torch.gather(lo, 1, order),
        hi=torch.gather(hi, 1, order),
    )
