"""The layer's spans from its anchors (docs/semantics.md section 4, step 2): the tensor ops (the
reference, and the faster path on a CPU) and, on a GPU, one launch of ``spans_kernel``."""

from __future__ import annotations

import torch

from ... import geometry
from ...settings import SpanSettings


def spans_of_anchors(
    anchors: torch.Tensor,
    cache_position: torch.Tensor,
    key_length: int,
    attention_mask: torch.Tensor | None,
    settings: SpanSettings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(qstart, qend) [B, Hq, Lq, topk] of the anchors (step 2): -1 where the anchor is -1."""
    qstart = geometry.span_starts(
        anchors, cache_position, key_length, attention_mask, settings.backward_factor, settings.span_power
    )
    qend = geometry.span_ends(
        anchors, cache_position, key_length, settings.window_for(key_length), attention_mask,
        settings.forward_factor, settings.span_power,
    )
    return qstart, qend.to(torch.int64, copy=True)  # a copy: with ff = 0 qend is the anchors themselves


def anchor_spans(
    anchors: torch.Tensor,
    cache_position: torch.Tensor,
    key_length: int,
    attention_mask: torch.Tensor | None,
    settings: SpanSettings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``spans_of_anchors``'s (qstart, qend) as int32 (the span kernels' index type): one Triton
    launch on a GPU (``spans_kernel``), its tensor ops elsewhere (CPU, where they are the faster path)."""
    if anchors.device.type == "cuda":
        from .spans_kernel import spans_by_kernel  # imports Triton on first use only

        return spans_by_kernel(anchors, cache_position, key_length, attention_mask, settings)
    qstart, qend = spans_of_anchors(anchors, cache_position, key_length, attention_mask, settings)
    return qstart.to(torch.int32), qend.to(torch.int32)
