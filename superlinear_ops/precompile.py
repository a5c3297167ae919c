"""Ahead-of-time warm-up: run each problem's chosen kernels once on zero inputs of its real shape.

After ``warmup``, the first real call and a CUDA-graph capture of the same problems neither
JIT-compile a Triton kernel nor build a geometry table.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from . import api
from .layer_api import superlinear_attention
from .problem import ATTENTION_LAYER, SPAN_BACKWARD, STAGED_DECODE, Problem

log = logging.getLogger(__name__)


def _inputs(problem: Problem, device: torch.device) -> dict:
    zeros = dict(device=device, dtype=problem.torch_dtype)
    b, hq, hkv, lq, lkv, d = (
        problem.batch, problem.q_heads, problem.kv_heads, problem.queries, problem.keys, problem.head_dim
    )
    return dict(
        q=torch.zeros(b, hq, lq, d, **zeros),
        k=torch.zeros(b, hkv, lkv, d, **zeros),
        v=torch.zeros(b, hkv, lkv, d, **zeros),
        cache_position=torch.arange(lkv - lq, lkv, device=device),
        mask=torch.ones(b, lkv, dtype=torch.bool, device=device) if problem.masked else None,
        spans=torch.full((b, hq, lq, problem.spans), -1, dtype=torch.int64, device=device),
    )


def warmup_problem(problem: Problem, device: torch.device) -> None:
    """Run ``problem``'s op once (forward and backward for span_backward) on zero inputs."""
    x = _inputs(problem, device)
    power = problem.params.arguments
    if problem.op == STAGED_DECODE:
        bf, ff, sp = problem.factors
        api.decode_span_attention_staged_gqa(
            x["q"], x["q"], x["k"], x["v"], x["cache_position"], x["mask"], problem.sw_index, problem.spans,
            backward_factor=bf, forward_factor=ff, span_power=sp, **power,
        )
        return
    if problem.op == ATTENTION_LAYER:
        bf, ff, sp = problem.factors
        superlinear_attention(
            x["q"], x["q"], x["k"], x["v"], x["cache_position"], x["mask"], problem.sw_index, problem.spans,
            backward_factor=bf, forward_factor=ff, span_power=sp, **power,
        )
        return
    q = x["q"].requires_grad_(problem.op == SPAN_BACKWARD)
    out = api.fused_span_attention_gqa(
        q, x["k"], x["v"], x["spans"], x["spans"], x["cache_position"], x["mask"], problem.sw_index, **power
    )
    if problem.op == SPAN_BACKWARD:
        out.sum().backward()


def warmup(problems: Iterable[Problem], device: torch.device | str | None = None) -> int:
    """Compile the dispatcher's choice for each problem ahead of time; returns how many ran.

    Every problem is checked first (ValueError/TypeError naming the bad field), and a CUDA device
    must be available when one is asked for.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} was asked for but PyTorch sees no GPU; pass device='cpu'")
    problems = list(problems)
    for problem in problems:
        if not isinstance(problem, Problem):
            raise TypeError(f"problems must hold superlinear_ops.Problem values, got {problem!r}")
        problem.check()
    count = 0
    for problem in problems:
        log.info("warming up %s", problem.op)
        warmup_problem(problem, device)
        count += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return count
