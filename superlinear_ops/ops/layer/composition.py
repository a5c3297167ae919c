"""The whole layer around any search (SPEC section 7, steps 2-5): spans from the anchors, span +
window attention, gate scores and gate, composed from the custom ops of ``torch_ops`` (so that
torch.compile traces the layer without entering the exact geometry, and autograd follows each
step's own backward; eagerly with nothing to differentiate, ``torch_ops.run`` calls them directly).

Differentiable in Q1 (through the gate scores), Q2, K and V: the anchors carry no gradient. The
short-prefix rule needs nothing extra: when t <= W no stripe precedes the window, every slot is
empty, every O_j is the causal attention over [0, pos] and the uniform gate returns it. No host
synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ... import torch_ops
from ...api import requires_grad
from ...settings import SpanSettings
from .steps import Chosen, gate_forward, gate_scores_forward, spans_of_anchors

# span_attention(qstart, qend) -> per-span outputs [B, Hq, Lq, K, D] (window included in each)
SpanAttention = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class GateChoices:
    """Explicit choices for the layer's gate forward (the tuner's parts): the scores' and the gate's."""

    scores: Chosen
    gate: Chosen


def attention_layer(
    q1: torch.Tensor,
    k: torch.Tensor,
    anchors: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    settings: SpanSettings,
    span_attention: SpanAttention,
    dtype: torch.dtype,
    gates: GateChoices | None = None,
    search_scores: torch.Tensor | None = None,
) -> torch.Tensor:
    """O [B, Hq, Lq, D] in ``dtype`` from the search's anchors [B, Hq, Lq, topk] (steps 2-5): the
    spans, the gate scores and the gate as the custom ops ``layer_spans``, ``layer_gate_scores`` and
    ``layer_gate`` (in float64 the spans are the tensor ops of ``spans_of_anchors``, never the GPU's
    spans kernel: the references stay PyTorch); with ``gates`` (the tuner's explicit parts) the gate
    runs those choices, forward only (no autograd). ``search_scores``, the search's scores of the
    anchors, are the gate scores when no gradient flows into Q1 or K (the search already took
    Q1 . K[anchor]); otherwise the gate scores are recomputed by their op, which autograd follows."""
    power = settings.params.arguments
    if dtype == torch.float64:  # the float64 layer (every reference) stays PyTorch throughout, spans included
        qstart, qend = spans_of_anchors(anchors, cache_position, k.shape[2], attention_mask, settings)
    else:
        qstart, qend = torch_ops.run(
            torch_ops.layer_spans, anchors, cache_position, attention_mask, k.shape[2], settings.sw_index,
            settings.backward_factor, settings.forward_factor, settings.span_power, power["search_power"],
            power["inv_search_power_int"],
        )
    span_out = span_attention(qstart, qend)  # [B, Hq, Lq, topk, D]
    if search_scores is not None and not requires_grad(q1, k):
        scores = search_scores  # the search already took Q1 . K[anchor]
    elif gates is not None:
        scores = gate_scores_forward(q1, k, anchors, gates.scores)
    else:
        scores = torch_ops.run(torch_ops.layer_gate_scores, q1, k, anchors)
    if gates is not None:
        return gate_forward(scores, span_out, dtype, gates.gate)
    return torch_ops.run(torch_ops.layer_gate, scores, span_out, dtype)
