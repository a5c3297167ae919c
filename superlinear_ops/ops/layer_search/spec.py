"""``attention_layer``: the whole layer (search, spans, span + window attention, gate; semantics section 4).

Its variants are the search's; the layer's other parts (the span attention and the gate) run with
the configurations the bench resolved for them (``parts``), so that a tuned search entry does not
depend on whatever cache the dispatcher had loaded while tuning; this forward takes its gate scores
from the search (the gate-score part is tuned here for the forwards that need a gradient). At every
part's reference (``runner.reference_parts``) the whole layer is PyTorch in float64.
"""

from __future__ import annotations

import torch

from ... import geometry
from ...launch import LaunchGeometry
from ...problem import ATTENTION_LAYER, GATE, GATE_SCORES, SPAN_FORWARD, Problem
from ...registry import REGISTRY
from ...settings import SpanSettings
from ..inputs import Inputs
from ..layer.composition import attention_layer, explicit_steps
from ..spec import OpSpec, Parts, PublicOps, call_searching

SPAN, SCORES, GATE_PART = "span", "gate_scores", "gate"  # the parts: span attention, gate scores, gate


class AttentionLayer(OpSpec):
    """The layer: real-size rows may differ from the baseline by a near-tie of the search."""

    name = ATTENTION_LAYER
    searching = True
    near_ties = True

    def parts(self, problem: Problem) -> dict[str, Problem]:
        return {SPAN: problem._replace(op=SPAN_FORWARD, factors=()), SCORES: REGISTRY.spec(GATE_SCORES).canonical(problem),
                GATE_PART: REGISTRY.spec(GATE).canonical(problem)}

    def companions(self, problem: Problem) -> dict[str, Problem]:
        """The gate parts: tuned with the layer (the span part's problems come from the span ops' kinds)."""
        return {name: part for name, part in self.parts(problem).items() if name != SPAN}

    def run(self, variant, config, problem: Problem, x: Inputs, parts: Parts):
        settings = SpanSettings.of_problem(problem).for_keys(problem.keys)
        found = variant.launch(x.q1, x.k, x.cache_position, x.mask, settings, config)
        span, span_config = parts[SPAN]

        def span_attention(qstart: torch.Tensor, qend: torch.Tensor) -> torch.Tensor:
            geo = LaunchGeometry.prepare(x.q, x.k, x.v, qstart, qend, x.cache_position, x.mask, problem.window)
            return span.launch(geo, span_config)[0]

        steps = explicit_steps(parts[SCORES], parts[GATE_PART])
        return (attention_layer(x.q1, x.k, found.anchors, x.cache_position, x.mask, settings, span_attention, x.q.dtype,
                                steps, found.scores),)

    def traffic(self, case, timed) -> tuple[float, float]:
        """The span attention's, plus the search: one stripe key per (query head, query, stripe), and Q1."""
        p = case.problem
        bytes_, flops = super().traffic(case, timed)
        elem = torch.empty(0, dtype=p.torch_dtype).element_size()
        stripes = geometry.stripe_count(p.keys, p.sw_index, p.params) - p.sw_index
        flops += 2.0 * p.batch * p.q_heads * p.queries * stripes * p.head_dim
        return bytes_ + p.batch * p.q_heads * p.queries * p.head_dim * elem, flops

    def warmup(self, problem: Problem, device: torch.device, public: PublicOps) -> None:
        call_searching(public.superlinear_attention, problem, device)
