"""Random inputs of a problem's shape, as the tuner, ``bench`` and ``verify`` feed its candidates.

Spans are drawn as the search would produce them (``search_like_spans``); decode masks are one of
the kinds a workload names (``decode_mask``). The op specs build on ``random_inputs``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from ..problem import Problem


class FloatCast:
    """Mixin of the input dataclasses: ``cast`` converts every floating-point tensor field."""

    def cast(self, dtype: torch.dtype):
        """The same inputs with the floating tensors in ``dtype`` (index, mask and None fields kept)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{name: value.to(dtype) for name, value in values.items()
                                if isinstance(value, torch.Tensor) and value.is_floating_point()})


@dataclass
class Inputs(FloatCast):
    """Tensors for one problem (decode uses q1/q2 and ignores the span tensors)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    qstart: torch.Tensor
    qend: torch.Tensor
    cache_position: torch.Tensor
    mask: torch.Tensor | None
    q1: torch.Tensor
    grad_out: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        """Where the inputs live (the device the tuner synchronises)."""
        return self.k.device


def search_like_spans(shape: tuple[int, int, int, int], cache_position: torch.Tensor, key_length: int, window: int,
                      factors: tuple[float, float, float], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(qstart, qend) of ``shape`` [B, Hq, Lq, K] as the search would produce them: anchors uniform
    before each query's window, spans ceil(bf t^p) back and ceil(ff t^p) forward (clamped to end
    before the window); -1 where no key precedes the window. Also used by the comparison scripts."""
    backward_factor, forward_factor, span_power = factors
    pos = cache_position.clamp(max=key_length - 1).view(1, 1, -1, 1).long()
    limit = (pos - window + 1).clamp(min=0) if window > 0 else pos + 1
    anchor = (torch.rand(shape, generator=gen, device=pos.device) * limit).floor().long()
    t = (pos + 1).double()
    back = torch.ceil(backward_factor * t.pow(span_power)).long()
    forward = torch.ceil(forward_factor * t.pow(span_power)).long()
    qstart = (anchor - back).clamp(min=0)
    qend = torch.minimum(anchor + forward, limit - 1)
    unused = (limit <= 0).expand(shape)
    return torch.where(unused, -1, qstart), torch.where(unused, -1, qend)


LEFT_PADDING = 100  # keys of padding per row (row b: 100 (b + 1)) in a 'left_padding' mask
HOLES = 0.1  # fraction of masked keys in a 'holes' mask
MASK_DROPPED = 0.05  # fraction of keys a random keep-mask drops


def decode_mask(kind: str | None, batch: int, keys: int, filled: int, device: torch.device,
                gen: torch.Generator) -> torch.Tensor | None:
    """A decode keep-mask [B, keys] (bool): None without ``kind``; 'prefix' (a static cache: the first
    ``filled`` keys), or over a full context 'ones', 'holes' (``HOLES`` of the keys before the last)
    or 'left_padding' (row b's first ``LEFT_PADDING`` (b + 1) keys masked)."""
    if kind is None:
        return None
    mask = torch.ones(batch, keys, dtype=torch.bool, device=device)
    if kind == "prefix":
        mask[:, filled:] = False
    elif kind == "holes":
        mask[:, :-1] = torch.rand(batch, keys - 1, generator=gen, device=device) >= HOLES
    elif kind == "left_padding":
        for row in range(batch):
            mask[row, : min(LEFT_PADDING * (row + 1), keys - 1)] = False
    elif kind != "ones":
        raise ValueError(f"mask kind must be 'prefix', 'ones', 'holes' or 'left_padding', got {kind!r}")
    return mask


def random_inputs(problem: Problem, span_factors: tuple[float, float, float], device: torch.device,
                  gen: torch.Generator, queries: int, keys: int, random_mask: bool = True) -> Inputs:
    """Q, Q1, K, V of the problem's heads at ``queries`` x ``keys``, the last ``queries`` positions,
    search-like spans, and a random keep-mask when the problem is masked and ``random_mask``."""
    dtype = problem.torch_dtype
    b, hq, hkv, d = problem.batch, problem.q_heads, problem.kv_heads, problem.head_dim
    randn = lambda *shape: torch.randn(*shape, generator=gen, device=device).to(dtype)  # noqa: E731
    q, q1 = randn(b, hq, queries, d), randn(b, hq, queries, d)
    k, v = randn(b, hkv, keys, d), randn(b, hkv, keys, d)
    cache_position = torch.arange(keys - queries, keys, device=device)
    mask = None
    if problem.masked and random_mask:
        mask = torch.rand(b, keys, generator=gen, device=device) > MASK_DROPPED
    qstart, qend = search_like_spans((b, hq, queries, problem.spans), cache_position, keys, problem.window,
                                     span_factors, gen)
    return Inputs(q, k, v, qstart, qend, cache_position, mask, q1)
