"""``span_forward``: per-span outputs and log-sum-exp of span + window attention (SPEC section 2)."""

from __future__ import annotations

from ...problem import SPAN_FORWARD
from ..spec import OpSpec


class SpanForward(OpSpec):
    """The span forward: the base spec's behaviour (random search-like spans, dense SDPA forward)."""

    name = SPAN_FORWARD
