"""``gate_scores`` and ``gate_scores_backward``: the layer's gate scores v_j = Q1 . K[anchor_j]
(EMPTY_SCORE for an empty slot, anchor -1) and their gradients dQ1, dK (semantics section 4, step 4)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...problem import GATE_SCORES, GATE_SCORES_BACKWARD, Problem
from ..inputs import FloatCast
from . import EMPTY_SCORE
from .spec import EMPTY_SLOTS, UNSEEN, GateOp


@dataclass
class ScoreInputs(FloatCast):
    """The gate scores' inputs: Q1 [B, Hq, Lq, D], K [B, Hkv, Lkv, D], int64 anchors [B, Hq, Lq, topk]
    (-1: empty) and, for the backward, the scores' gradient (fp32)."""

    q1: torch.Tensor
    k: torch.Tensor
    anchors: torch.Tensor
    grad: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        """Where the inputs live (the device the tuner synchronises)."""
        return self.k.device


def split_empty(scores: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the used slots' scores, each empty slot's distance from EMPTY_SCORE), zero elsewhere: compared
    apart, so that the empty slots' -1e9 does not set the scale of the error allowed on the others."""
    used = anchors >= 0
    return torch.where(used, scores, 0.0), torch.where(used, 0.0, scores - EMPTY_SCORE)


class GateScores(GateOp):
    """The gate scores: one row of Q1 against the key rows of its anchors, per (b, h, q)."""

    name = GATE_SCORES

    def problem_of(self, q1: torch.Tensor, k: torch.Tensor, anchors: torch.Tensor) -> Problem:
        """The problem of a call on Q1, K and the anchors."""
        return Problem.for_span(self.name, q1, k, anchors.shape[-1], **UNSEEN)

    def random(self, problem: Problem, device: torch.device, gen: torch.Generator) -> ScoreInputs:
        dtype = problem.torch_dtype
        b, hq, hkv, lq, lkv, d = (problem.batch, problem.q_heads, problem.kv_heads, problem.queries, problem.keys,
                                  problem.head_dim)
        q1 = torch.randn(b, hq, lq, d, generator=gen, device=device).to(dtype)
        k = torch.randn(b, hkv, lkv, d, generator=gen, device=device).to(dtype)
        anchors = torch.randint(0, lkv, (b, hq, lq, problem.spans), generator=gen, device=device)
        empty = torch.rand(anchors.shape, generator=gen, device=device) < EMPTY_SLOTS
        return ScoreInputs(q1, k, torch.where(empty, -1, anchors))

    def run(self, variant, config, problem: Problem, x: ScoreInputs, parts):
        return split_empty(variant.launch(x.q1, x.k, x.anchors, config), x.anchors)

    def traffic(self, case, timed) -> tuple[float, float]:
        """Q1 and the anchors read, the scores written (the key rows read depend on the anchors); a dot
        product of D per slot."""
        p = case.problem
        rows, elem = p.batch * p.q_heads * p.queries, p.torch_dtype.itemsize
        return rows * (p.head_dim * elem + p.spans * (8 + 4)), 2.0 * rows * p.spans * p.head_dim


class GateScoresBackward(GateScores):
    """The gate-score backward: (dQ1, dK) for the scores' gradient (no forward needed)."""

    name = GATE_SCORES_BACKWARD

    def random(self, problem: Problem, device: torch.device, gen: torch.Generator) -> ScoreInputs:
        x = super().random(problem, device, gen)
        x.grad = torch.randn(x.anchors.shape, generator=gen, device=device)
        return x

    def run(self, variant, config, problem: Problem, x: ScoreInputs, parts):
        return tuple(variant.launch(x.q1, x.k, x.anchors, x.grad, config))

    def traffic(self, case, timed) -> tuple[float, float]:
        """The forward's reads, the scores' gradient, dQ1 and the whole of dK written; two FLOPs more per slot element."""
        p = case.problem
        bytes_, flops = super().traffic(case, timed)
        elem = p.torch_dtype.itemsize
        return bytes_ + p.batch * (p.q_heads * p.queries * p.head_dim + p.kv_heads * p.keys * p.head_dim) * elem, 2 * flops
