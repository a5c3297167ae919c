"""The span ops' specs: ``span_forward`` (per-span outputs and log-sum-exp of span + window
attention, docs/semantics.md section 2) and ``span_backward`` (dQ, dK, dV of the span forward; a
candidate runs as a training step does)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...launch import KernelConfig, LaunchGeometry
from ...problem import SPAN_BACKWARD, SPAN_FORWARD, Problem
from ..inputs import Inputs
from ..spec import DenseCalls, OpSpec, Parts, PublicOps, dense_flops, grouped_heads, zero_inputs

FORWARD = "forward"
TRAINING_FLOPS = 3.5  # forward + backward: 1 + 2.5 forwards of FLOPs


class SpanForward(OpSpec):
    """The span forward: the base spec's behaviour (random search-like spans, dense SDPA forward)."""

    name = SPAN_FORWARD


class SpanBackward(OpSpec):
    """A candidate backward runs behind the forward the dispatcher chooses for the same shape (the
    ``forward`` part), so its times cover forward + backward, as dense SDPA's do."""

    name = SPAN_BACKWARD
    tolerance_scale = 4.0

    def parts(self, problem: Problem) -> dict[str, Problem]:
        return {FORWARD: problem._replace(op=SPAN_FORWARD)}

    def inputs(self, case, device, gen, queries, keys) -> Inputs:
        x = super().inputs(case, device, gen, queries, keys)
        p = case.problem
        x.grad_out = torch.randn(p.batch, p.q_heads, queries, p.spans, p.head_dim, generator=gen,
                                 device=device).to(p.torch_dtype)
        return x

    def run(self, variant, config: KernelConfig, problem: Problem, x: Inputs, parts: Parts):
        geo = LaunchGeometry.prepare(x.q, x.k, x.v, x.qstart, x.qend, x.cache_position, x.mask, problem.window)
        forward, forward_config = parts[FORWARD]
        out, lse = forward.launch(geo, forward_config)
        return tuple(variant.launch(geo, config, out, lse, x.grad_out))

    def traffic(self, case, timed) -> tuple[float, float]:
        bytes_, flops = super().traffic(case, timed)
        return 3 * bytes_, TRAINING_FLOPS * flops

    def dense(self, case, x: Inputs) -> DenseCalls:
        grad = torch.randn_like(x.q)

        def training_call(expand: bool):
            q, k, v = (t.detach().clone().requires_grad_() for t in (x.q, *grouped_heads(x, expand)))
            return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not expand).backward(grad)

        return DenseCalls("causal forward + backward", (training_call,),
                          flops=TRAINING_FLOPS * dense_flops(x.q, x.k.shape[2], causal=True))

    def warmup(self, problem: Problem, device: torch.device, public: PublicOps) -> None:
        self.public_call(problem, zero_inputs(problem, device), public, requires_grad=True).sum().backward()
