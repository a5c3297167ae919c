"""The exact integer tables a staged-decode step reads on the device, built once per shape."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ... import geometry
from ...settings import SpanSettings


class DecodeTables(NamedTuple):
    """Stripe offsets floor(i ** inv_p), span-length tables indexed by t, and the longest span."""

    offsets: torch.Tensor
    back: torch.Tensor
    forward: torch.Tensor | None  # None when the forward factor is 0
    longest_span: int  # most keys one span can hold for this key length (shapes never depend on pos)


@functools.lru_cache(maxsize=256)
def decode_tables(key_length: int, settings: SpanSettings, device: torch.device) -> DecodeTables:
    """The tables for caches of ``key_length`` keys (cached: a decode step builds nothing)."""
    back = geometry.span_length_table(settings.backward_factor, settings.span_power, key_length, device)
    forward = None
    if settings.forward_factor > 0:
        forward = geometry.span_length_table(settings.forward_factor, settings.span_power, key_length, device)
    longest = min(
        geometry.ceil_scaled_power(settings.backward_factor, key_length, settings.span_power)
        + geometry.ceil_scaled_power(settings.forward_factor, key_length, settings.span_power)
        + 1,
        key_length,
    )
    offsets = geometry.stripe_offsets_tensor(key_length, settings.sw_index, settings.params, device)
    return DecodeTables(offsets, back, forward, longest)
