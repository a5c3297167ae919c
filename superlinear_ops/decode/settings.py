"""What every staged-decode variant shares: its checked scalar settings and the gate (SPEC section 3,
step 5)."""

from __future__ import annotations

import dataclasses
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

    def window_for(self, key_length: int) -> int:
        """W clamped to ``key_length``: exact (a window at least as long as the keys covers them all,
        no stripe precedes it) and keeps buffers sized by the window bounded by the keys."""
        return min(self.window, key_length)

    def for_keys(self, key_length: int) -> DecodeSettings:
        """These settings with topk at most the number of stripes of ``key_length`` keys: exact (the
        extra slots would always be empty) and keeps grids bounded by the keys."""
        stripes = geometry.stripe_count(key_length, self.sw_index, self.params) - self.sw_index
        return self if self.topk <= stripes else dataclasses.replace(self, topk=stripes)


def gate_and_combine(scores: torch.Tensor, span_out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Step 5: softmax of the chosen spans' scores [B, Hq, topk] (-inf: no span; all -inf: uniform)
    weighting the span outputs [B, Hq, 1, topk, D]; returns [B, Hq, 1, D] in ``dtype``."""
    any_chosen = (scores > float("-inf")).any(dim=-1, keepdim=True)
    gate = torch.softmax(torch.where(any_chosen, scores, torch.zeros_like(scores)), dim=-1)
    cdt = torch.float64 if span_out.dtype == torch.float64 else torch.float32
    return (gate[:, :, None, :, None].to(cdt) * span_out.to(cdt)).sum(dim=3).to(dtype)
