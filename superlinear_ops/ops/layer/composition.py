"""The whole layer around any search (docs/semantics.md section 4, steps 2-5): spans from the
anchors, span + window attention, gate scores and gate, each step run by the caller's ``LayerSteps``:
the custom ops of ``torch_ops`` in the public API (so that torch.compile traces the layer without
entering the exact geometry, and autograd follows each step's own backward), or explicit variants
and configurations for the tuner (``explicit_steps``).

Differentiable in Q1 (through the gate scores), Q2, K and V: the anchors carry no gradient. The
short-prefix rule needs nothing extra: when t <= W no stripe precedes the window, every slot is
empty, every O_j is the causal attention over [0, pos] and the uniform gate returns it. No host
synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...launch import KernelConfig
from ...registry import Variant
from ...settings import SpanSettings
from ...validation import requires_grad
from .spans import anchor_spans, spans_of_anchors

# span_attention(qstart, qend) -> per-span outputs [B, Hq, Lq, K, D] (window included in each)
SpanAttention = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Chosen = tuple[Variant, KernelConfig]  # an explicit choice: a gate op's variant and its configuration


@dataclass(frozen=True)
class LayerSteps:
    """How the layer runs its steps after the search: ``spans(anchors, cache_position, key_length,
    attention_mask, settings) -> (qstart, qend)`` (int32, as ``spans.anchor_spans``), ``gate_scores(q1, k, anchors) -> scores`` and
    ``gate(scores, span_out, dtype) -> out``."""

    spans: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    gate_scores: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    gate: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]


def explicit_steps(scores: Chosen, gate: Chosen) -> LayerSteps:
    """The steps with explicit gate choices (the tuner's parts), forward only (no autograd)."""
    (scores_variant, scores_config), (gate_variant, gate_config) = scores, gate
    return LayerSteps(
        spans=anchor_spans,
        gate_scores=lambda q1, k, anchors: scores_variant.launch(q1, k, anchors, scores_config),
        gate=lambda scores, span_out, dtype: gate_variant.launch(scores, span_out, dtype, gate_config),
    )


def attention_layer(
    q1: torch.Tensor,
    k: torch.Tensor,
    anchors: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    settings: SpanSettings,
    span_attention: SpanAttention,
    dtype: torch.dtype,
    steps: LayerSteps,
    search_scores: torch.Tensor | None = None,
) -> torch.Tensor:
    """O [B, Hq, Lq, D] in ``dtype`` from the search's anchors [B, Hq, Lq, topk] (steps 2-5): the
    spans, the gate scores and the gate by ``steps`` (in float64 the spans are the tensor ops of
    ``spans_of_anchors``, never the GPU's spans kernel: the references stay PyTorch). ``search_scores``,
    the search's scores of the anchors, are the gate scores when no gradient flows into Q1 or K (the
    search already took Q1 . K[anchor]); otherwise ``steps.gate_scores`` recomputes them."""
    if dtype == torch.float64:  # the float64 layer (every reference) stays PyTorch throughout, spans included
        qstart, qend = spans_of_anchors(anchors, cache_position, k.shape[2], attention_mask, settings)
    else:
        qstart, qend = steps.spans(anchors, cache_position, k.shape[2], attention_mask, settings)
    span_out = span_attention(qstart, qend)  # [B, Hq, Lq, topk, D]
    if search_scores is not None and not requires_grad(q1, k):
        scores = search_scores  # the search already took Q1 . K[anchor]
    else:
        scores = steps.gate_scores(q1, k, anchors)
    return steps.gate(scores, span_out, dtype)
