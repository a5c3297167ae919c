"""Span-op edge cases for every registered variant: a batch row that attends nothing at all, and
inputs that break the span/window contract (unvalidated). The full matrix is in tests/ops/test_variants.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from cases import DTYPES, SPAN_CASES, make_span_inputs
from helpers import assert_close, launch_variant

from superlinear_ops.registry import REGISTRY

CASE = replace(SPAN_CASES[0], batch=2)


def nothing_attended_in_row_0(gen: torch.Generator):
    x = make_span_inputs(CASE, gen)
    mask = torch.ones(CASE.batch, CASE.lkv, dtype=torch.bool)
    mask[0] = False
    return replace(x, mask=mask)


@pytest.mark.parametrize("variant", REGISTRY.variants("span_forward"), ids=lambda v: v.name)
def test_forward_row_with_no_attended_key_gives_zeros(variant, gen: torch.Generator) -> None:
    x = nothing_attended_in_row_0(gen)
    (out, lse), _ = launch_variant(variant, x)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isposinf(lse[0]).all()
    expected, _ = x.oracle_forward()
    assert_close(out, expected, torch.float32, CASE.lkv, "out")


@pytest.mark.parametrize("variant", REGISTRY.variants("span_backward"), ids=lambda v: v.name)
def test_backward_row_with_no_attended_key_gives_zero_gradients(variant, gen: torch.Generator) -> None:
    x = nothing_attended_in_row_0(gen)
    out, lse = x.oracle_forward()
    grad_out = torch.randn(out.shape, generator=gen)
    (dq, dk, dv), _ = launch_variant(variant, x, (out.float(), lse.float(), grad_out))
    for name, grad in zip(("dQ", "dK", "dV"), (dq, dk, dv)):
        assert torch.equal(grad[0], torch.zeros_like(grad[0])), name


@pytest.mark.parametrize("variant", REGISTRY.variants("span_forward"), ids=lambda v: v.name)
def test_forward_clamps_spans_that_overlap_the_window(variant, gen: torch.Generator) -> None:
    """Unvalidated spans that run into the window (or past the last key) attend the span up to the
    window's start only, on every path."""
    case = next(c for c in SPAN_CASES if c.dtype == "bf16")
    x = make_span_inputs(case, gen)
    qend = torch.where(x.qend >= 0, torch.full_like(x.qend, case.lkv + 5), x.qend)
    x = replace(x, qend=qend)
    (out, _), _ = launch_variant(variant, x)
    assert_close(out, x.oracle_forward()[0], DTYPES[case.dtype], case.lkv, "out")
