"""A short end-to-end run of the public API, checked against the float64 reference.

On a GPU it uses the released model's head layout (semantics section 5); without one it runs the
Triton kernels under Triton's interpreter on a scaled-down problem.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from . import geometry
from .api import decode_span_attention_staged_gqa, fused_span_attention_gqa
from .ops.span_attention.reference import span_forward_reference

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoShape:
    """Sizes of the demonstration problems."""

    hq: int
    hkv: int
    dim: int
    sw_index: int
    context: int
    chunk: int

    @classmethod
    def for_device(cls, device: torch.device) -> "DemoShape":
        """Model M's heads on a GPU; a small GQA problem for the CPU interpreter."""
        if device.type == "cuda":
            return cls(hq=32, hkv=2, dim=128, sw_index=44, context=16384, chunk=256)
        return cls(hq=4, hkv=2, dim=32, sw_index=6, context=256, chunk=4)


@dataclass(frozen=True)
class DemoResult:
    """One checked step of the demo."""

    step: str
    seconds: float
    max_error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        """True when the error is finite and within tolerance."""
        return self.max_error == self.max_error and self.max_error <= self.tolerance


def _random_spans(gen: torch.Generator, shape: DemoShape, cache_position: torch.Tensor, window: int, device):
    lq = cache_position.numel()
    window_start = (cache_position - window + 1).clamp(min=0).view(1, 1, lq, 1)
    size = (1, shape.hq, lq, 3)
    end = (torch.rand(size, generator=gen) * window_start).floor().long()
    start = (end - torch.randint(1, 64, size, generator=gen)).clamp(min=0)
    return start.to(device), end.to(device)


def run_demo(device: torch.device, dtype: torch.dtype, seed: int = 0) -> list[DemoResult]:
    """Run span forward, backward and staged decode once each and compare with the reference."""
    shape = DemoShape.for_device(device)
    window = geometry.window_len_from_sw_index(shape.sw_index)
    gen = torch.Generator().manual_seed(seed)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2

    def randn(*size):
        return torch.randn(*size, generator=gen).to(device=device, dtype=dtype)

    k, v = randn(1, shape.hkv, shape.context, shape.dim), randn(1, shape.hkv, shape.context, shape.dim)
    q = randn(1, shape.hq, shape.chunk, shape.dim).requires_grad_()
    cache_position = torch.arange(shape.context - shape.chunk, shape.context, device=device)
    qstart, qend = _random_spans(gen, shape, cache_position.cpu(), window, device)
    results = []
    steps = tqdm(["span forward", "span backward", "staged decode"], desc="demo", unit="step")
    for step in steps:
        steps.set_postfix_str(step)
        start = time.perf_counter()
        if step == "span forward":
            out = fused_span_attention_gqa(q, k, v, qstart, qend, cache_position, None, shape.sw_index)
            got = out.detach()
            expected = span_forward_reference(
                q.detach().double(), k.double(), v.double(), qstart, qend, cache_position, None, window
            )
        elif step == "span backward":
            out.sum().backward()
            got = q.grad
            q64 = q.detach().double().requires_grad_()
            span_forward_reference(q64, k.double(), v.double(), qstart, qend, cache_position, None, window).sum().backward()
            expected = q64.grad
        else:
            q1, q2 = randn(1, shape.hq, 1, shape.dim), randn(1, shape.hq, 1, shape.dim)
            got = decode_span_attention_staged_gqa(q1, q2, k, v, cache_position[-1:], sw_index=shape.sw_index)
            expected = decode_span_attention_staged_gqa(
                q1.double(), q2.double(), k.double(), v.double(), cache_position[-1:], sw_index=shape.sw_index
            )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        error = (got.double() - expected.double()).abs().max().item()
        results.append(DemoResult(step, seconds, error, tolerance))
        log.info("%s: %.3f s, max |error| %.2e", step, seconds, error)
    return results
