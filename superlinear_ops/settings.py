"""The settings of a searching call (staged decode, the whole layer), checked once per public call.

``SpanSettings.checked`` builds them from the original's arguments (ValueError/TypeError naming
the bad one); they then travel as this one object, down to the custom ops' boundary, where
``op_arguments``/``from_op_arguments`` are the only (un)packing into the scalars a
``torch.library`` schema takes. The tuner builds them from a problem (``of_problem``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import geometry

if TYPE_CHECKING:
    from .problem import Problem


@dataclass(frozen=True)
class SpanSettings:
    """Window, topk, span factors and power, and the search power's parameters."""

    sw_index: int
    topk: int
    backward_factor: float
    forward_factor: float
    span_power: float
    params: geometry.PowerParams

    @classmethod
    def checked(cls, key_length: int, sw_index: int, topk: int, backward_factor: float, forward_factor: float,
                span_power: float, search_power: float | None, inv_search_power_int: int | None) -> SpanSettings:
        """The checked settings of a call over ``key_length`` keys, topk clamped to its stripes
        (``for_keys``; under torch.compile the custom ops clamp it themselves: the exact stripe
        count is host geometry that dynamo cannot trace)."""
        params = geometry.power_params(search_power=search_power, inv_search_power_int=inv_search_power_int)
        sw_index = geometry.check_non_negative_int("sw_index", sw_index)
        geometry.check_window_bound(sw_index, params)
        settings = cls(
            sw_index, topk,
            geometry.check_factor("backward_factor", backward_factor, allow_zero=True),
            geometry.check_factor("forward_factor", forward_factor, allow_zero=True),
            geometry.check_span_power(span_power),
            params,
        )
        return settings if torch.compiler.is_compiling() else settings.for_keys(key_length)

    @classmethod
    def of_problem(cls, problem: Problem) -> SpanSettings:
        """The settings of a searching problem (its factors are (backward, forward, span power))."""
        bf, ff, sp = problem.factors
        return cls(problem.sw_index, problem.spans, bf, ff, sp, problem.params)

    @classmethod
    def from_op_arguments(cls, sw_index: int, topk: int, backward_factor: float, forward_factor: float,
                          span_power: float, search_power: float | None, inv_search_power_int: int | None) -> SpanSettings:
        """The settings a custom op received as ``op_arguments`` (already checked by the public call)."""
        params = geometry.power_params(search_power=search_power, inv_search_power_int=inv_search_power_int)
        return cls(sw_index, topk, backward_factor, forward_factor, span_power, params)

    def op_arguments(self) -> tuple:
        """(sw_index, topk, backward_factor, forward_factor, span_power, search_power, inv_search_power_int):
        the scalars of the custom ops' schemas."""
        power = self.params.arguments
        return (self.sw_index, self.topk, self.backward_factor, self.forward_factor, self.span_power,
                power["search_power"], power["inv_search_power_int"])

    @property
    def window(self) -> int:
        """Sliding-window length W."""
        return geometry.window_length(self.sw_index, self.params)

    def window_for(self, key_length: int) -> int:
        """W clamped to ``key_length``: exact (a window at least as long as the keys covers them all,
        no stripe precedes it) and keeps buffers sized by the window bounded by the keys."""
        return min(self.window, key_length)

    def for_keys(self, key_length: int) -> SpanSettings:
        """These settings with topk at most the number of stripes of ``key_length`` keys: exact (the
        extra slots would always be empty) and keeps grids bounded by the keys."""
        stripes = geometry.stripe_count(key_length, self.sw_index, self.params) - self.sw_index
        return self if self.topk <= stripes else dataclasses.replace(self, topk=stripes)
