"""What every staged-decode variant shares: the gate (semantics section 3, step 5), and the type of the
span forward a staged variant runs."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...launch import LaunchGeometry

SpanForward = Callable[[LaunchGeometry], tuple[torch.Tensor, torch.Tensor]]


def gate_and_combine(scores: torch.Tensor, span_out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Step 5: softmax of the chosen spans' scores [B, Hq, topk] (-inf: no span; all -inf: uniform)
    weighting the span outputs [B, Hq, 1, topk, D]; returns [B, Hq, 1, D] in ``dtype``."""
    any_chosen = (scores > float("-inf")).any(dim=-1, keepdim=True)
    gate = torch.softmax(torch.where(any_chosen, scores, torch.zeros_like(scores)), dim=-1)
    cdt = torch.float64 if span_out.dtype == torch.float64 else torch.float32
    return (gate[:, :, None, :, None].to(cdt) * span_out.to(cdt)).sum(dim=3).to(dtype)
