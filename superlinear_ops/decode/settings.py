"""What every staged-decode variant shares: its checked scalar settings and the gate (SPEC section 3,
step 5)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import geometry
from ..kernels.launch import LaunchGeometry

SpanForward = Callable[[LaunchGeometry], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class DecodeSettings:
    """The checked scalar arguments of a staged-decode call."""

    sw_index: int
    topk: int
    backward_factor: float
    forward_factor: float
    span_power: float
    params: geometry.PowerParams

    @property
    def window(self) -> int:
        """Sliding-window length W."""
        return geometry.window_length(self.sw_index, self.params)


def gate_and_combine(scores: torch.Tensor, span_out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Step 5: softmax of the chosen spans' scores [B, Hq, topk] (-inf: no span; all -inf: uniform)
    weighting the span outputs [B, Hq, 1, topk, D]; returns [B, Hq, 1, D] in ``dtype``."""
    any_chosen = (scores > float("-inf")).any(dim=-1, keepdim=True)
    gate = torch.softmax(torch.where(any_chosen, scores, torch.zeros_like(scores)), dim=-1)
    return (gate[:, :, None, :, None] * span_out.float()).sum(dim=3).to(dtype)
