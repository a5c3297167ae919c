"""Cases and span makers shared by the tensor-core kernel tests (tiny shapes, many tiles)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from superlinear_ops import geometry


@dataclass(frozen=True)
class TileCase:
    """One tensor-core test case; ``config`` overrides the kernel's tiles (None: the test's own)."""

    dtype: torch.dtype
    batch: int
    hq: int
    hkv: int
    lq: int
    lkv: int
    dim: int
    spans: int
    sw_index: int
    search_power: float | None  # None: integer path (inv_search_power_int=2)
    masked: bool
    max_span: int
    consecutive: bool  # cache_position = a run of consecutive positions (prefill, training) or random ones
    transposed_q: bool = False
    config: dict | None = None

    @property
    def window(self) -> int:
        inv = None if self.search_power is not None else 2
        return geometry.window_len_from_sw_index(self.sw_index, search_power=self.search_power, inv_search_power_int=inv)


def random_spans(gen, batch, heads, cache_position, n_spans, key_length, window, max_len):
    """Random valid spans ending before each query's window (slots of rows with t <= W, and about a
    quarter of the others, unused: -1)."""
    pos = cache_position.clamp(max=key_length - 1).view(1, 1, -1, 1)
    limit = (pos - window + 1).clamp(min=0) if window > 0 else pos + 1  # spans end before this
    shape = (batch, heads, cache_position.numel(), n_spans)
    end = (torch.rand(shape, generator=gen) * limit).floor().long()
    start = (end - torch.randint(1, max_len + 1, shape, generator=gen) + 1).clamp(min=0)
    unused = (torch.rand(shape, generator=gen) < 0.25) | (limit <= 0).expand(shape)
    return torch.where(unused, -1, start), torch.where(unused, -1, end)
