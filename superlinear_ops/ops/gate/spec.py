"""``gate`` and ``gate_backward``: the layer's gate O = sum_j softmax(v)_j O_j over the span outputs
and its backward (semantics section 4, step 4), and ``GateOp``, what every gate op shares.

A gate call sees neither the mask, the window nor the search power (and ``gate`` sees no keys), so
its problem fixes those fields (``GateOp.fixed``): a call's problem (``problem_of``), the layer's
parts (``ops.attention_layer``) and a tuned entry's key then agree; ``check`` refuses other values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...problem import GATE, GATE_BACKWARD, Problem, device_identity
from ..inputs import FloatCast
from ..spec import DenseCalls, OpSpec, PublicOps
from . import EMPTY_SCORE

UNSEEN = dict(masked=False, sw_index=0, power="int2")  # what a gate call does not see, fixed
EMPTY_SLOTS = 0.125  # fraction of empty slots (anchor -1, score EMPTY_SCORE) in random inputs
SCORE_SCALE = 4.0  # random gate scores: N(0, 4^2), like Q1 . K over a few dozen dimensions


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32."""
    return str(dtype).removeprefix("torch.")


class GateOp(OpSpec):
    """A gate op: fixed unseen fields, no dense counterpart, random inputs from ``random``."""

    def fixed(self, problem: Problem) -> dict:
        """The fields of ``problem`` this op fixes, with their values."""
        return dict(UNSEEN)

    def canonical(self, problem: Problem) -> Problem:
        """``problem`` as this op's: its name, no factors, and the fixed fields (``fixed``)."""
        problem = problem._replace(op=self.name, factors=())
        return problem._replace(**self.fixed(problem))

    def check(self, problem: Problem) -> None:
        for name, value in self.fixed(problem).items():
            if getattr(problem, name) != value:
                raise ValueError(f"{name} must be {value!r} for {self.name} (a gate call does not see it), "
                                 f"got {getattr(problem, name)!r}")

    def random(self, problem: Problem, device: torch.device, gen: torch.Generator):
        """Random inputs of ``problem``'s shape."""
        raise NotImplementedError

    def inputs(self, case, device, gen, queries, keys):
        return self.random(case.problem._replace(queries=queries, keys=keys), device, gen)

    def dense(self, case, x) -> DenseCalls:
        return DenseCalls("no dense counterpart (a step of the layer)", ())

    def warmup(self, problem: Problem, device: torch.device, public: PublicOps) -> None:
        """Run the dispatcher's choice for ``problem`` once on random inputs of its shape."""
        choice = public.select(problem)
        self.run(choice.variant, choice.config, problem, self.random(problem, device, torch.Generator(device=device).manual_seed(0)), {})


@dataclass
class GateInputs(FloatCast):
    """The gate's inputs: scores [B, Hq, Lq, topk] (fp32), span outputs [B, Hq, Lq, topk, D] and, for
    the backward, the output's gradient [B, Hq, Lq, D]."""

    scores: torch.Tensor
    span_out: torch.Tensor
    grad_out: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        """Where the inputs live (the device the tuner synchronises)."""
        return self.span_out.device


def _elements(problem: Problem) -> tuple[int, int, int, int]:
    """(rows B Hq Lq, slots, D, bytes per element)."""
    rows = problem.batch * problem.q_heads * problem.queries
    return rows, problem.spans, problem.head_dim, problem.torch_dtype.itemsize


class Gate(GateOp):
    """The gate forward: reads the scores and the span outputs, no keys (kv_heads = q_heads, keys = 1)."""

    name = GATE

    def fixed(self, problem: Problem) -> dict:
        return {**super().fixed(problem), "kv_heads": problem.q_heads, "keys": 1}

    def problem_of(self, scores: torch.Tensor, span_out: torch.Tensor) -> Problem:
        """The problem of a call on ``span_out`` [B, Hq, Lq, topk, D] (and its scores)."""
        batch, heads, queries, slots, dim = span_out.shape
        return Problem(self.name, dtype_name(span_out.dtype), dim, heads, heads, slots, queries, 1, batch,
                       device=device_identity(span_out.device), **UNSEEN)

    def random(self, problem: Problem, device: torch.device, gen: torch.Generator) -> GateInputs:
        b, hq, lq, slots, d = problem.batch, problem.q_heads, problem.queries, problem.spans, problem.head_dim
        scores = torch.randn(b, hq, lq, slots, generator=gen, device=device) * SCORE_SCALE
        empty = torch.rand(scores.shape, generator=gen, device=device) < EMPTY_SLOTS
        span_out = torch.randn(b, hq, lq, slots, d, generator=gen, device=device).to(problem.torch_dtype)
        return GateInputs(torch.where(empty, EMPTY_SCORE, scores), span_out)

    def run(self, variant, config, problem: Problem, x: GateInputs, parts):
        return (variant.launch(x.scores, x.span_out, problem.torch_dtype, config),)

    def traffic(self, case, timed) -> tuple[float, float]:
        """The scores and span outputs read, the output written; 2 FLOPs per span output element."""
        rows, slots, d, elem = _elements(case.problem)
        return rows * (slots * (4 + d * elem) + d * elem), 2.0 * rows * slots * d


class GateBackward(Gate):
    """The gate backward: (d scores, d span outputs) for the output's gradient (no forward needed)."""

    name = GATE_BACKWARD

    def random(self, problem: Problem, device: torch.device, gen: torch.Generator) -> GateInputs:
        x = super().random(problem, device, gen)
        x.grad_out = torch.randn(x.span_out[..., 0, :].shape, generator=gen, device=device).to(problem.torch_dtype)
        return x

    def run(self, variant, config, problem: Problem, x: GateInputs, parts):
        return tuple(variant.launch(x.scores, x.span_out, x.grad_out, config))

    def traffic(self, case, timed) -> tuple[float, float]:
        """The forward's reads, the output's gradient, both gradients written; 4 FLOPs per span output element."""
        rows, slots, d, elem = _elements(case.problem)
        return rows * (2 * slots * (4 + d * elem) + d * elem), 4.0 * rows * slots * d
