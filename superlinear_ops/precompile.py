"""Ahead-of-time warm-up: run each problem's chosen kernels once on zero inputs of its real shape.

After ``warmup``, the first real call and a CUDA-graph capture of the same problems neither
JIT-compile a Triton kernel nor build a geometry table.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable

import torch

from .problem import Problem
from .registry import REGISTRY

log = logging.getLogger(__name__)


def warmup_problem(problem: Problem, device: torch.device) -> None:
    """Run ``problem``'s public op once on zero inputs (its op's spec: forward and backward for span_backward)."""
    REGISTRY.spec(problem.op).warmup(problem, device, sys.modules[__package__])


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
