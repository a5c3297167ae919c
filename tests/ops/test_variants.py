"""Every registered variant of every op, called directly, against the independent oracle.

Parametrised over the registry: a variant is tested the day it is registered. Each case asserts
the properties its name claims (long spans, multi-block windows, mask holes, unused slots, t <= W,
strided inputs) before comparing, so a change of the input makers cannot hollow a test.
"""

from __future__ import annotations

import oracle
import pytest
import torch
from cases import (
    DECODE_CASES,
    DTYPES,
    SPAN_CASES,
    DecodeCase,
    SpanCase,
    check_decode_properties,
    check_span_properties,
    make_decode_inputs,
    make_span_inputs,
)
from helpers import GRADIENT_SPREAD, assert_close, launch_variant

from superlinear_ops.registry import REGISTRY


def _ids(variants):
    return [v.name for v in variants]


# --- span forward / backward ----------------------------------------------------------------


@pytest.mark.random_seeds(1)
@pytest.mark.parametrize("variant", REGISTRY.variants("span_forward"), ids=_ids(REGISTRY.variants("span_forward")))
@pytest.mark.parametrize("case", SPAN_CASES, ids=lambda c: c.name)
def test_span_forward_variant_matches_oracle(case: SpanCase, variant, gen: torch.Generator) -> None:
    x = make_span_inputs(case, gen)
    check_span_properties(case, x)
    (out, lse), _ = launch_variant(variant, x)
    expected, expected_lse = x.oracle_forward()
    dtype = DTYPES[case.dtype]
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close(out, expected, dtype, case.lkv, "out")
    nobody = torch.isinf(expected_lse)
    assert torch.equal(torch.isposinf(lse), nobody), "lse is +inf exactly where no key is attended"
    assert torch.equal(out[nobody], torch.zeros_like(out[nobody])), "zeros where no key is attended"
    assert_close(lse[~nobody], expected_lse[~nobody], torch.float32, case.lkv, "lse")


@pytest.mark.parametrize("variant", REGISTRY.variants("span_backward"), ids=_ids(REGISTRY.variants("span_backward")))
@pytest.mark.parametrize("case", SPAN_CASES, ids=lambda c: c.name)
def test_span_backward_variant_matches_oracle(case: SpanCase, variant, gen: torch.Generator) -> None:
    x = make_span_inputs(case, gen)
    check_span_properties(case, x)
    dtype = DTYPES[case.dtype]
    out, lse = x.oracle_forward()
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(dtype)
    (dq, dk, dv), _ = launch_variant(variant, x, (out.to(dtype), lse.float(), grad_out))
    expected = oracle.span_gradients(x.q, x.k, x.v, x.qstart, x.qend, x.cache_position, x.mask, x.window, grad_out)
    for name, got, want in zip(("dQ", "dK", "dV"), (dq, dk, dv), expected):
        assert got.dtype == dtype, name
        assert_close(got, want, dtype, case.lkv, name, spread=GRADIENT_SPREAD)


# --- staged decode ----------------------------------------------------------------------------


# --- staged decode ----------------------------------------------------------------------------


@pytest.mark.parametrize("variant", REGISTRY.variants("staged_decode"), ids=_ids(REGISTRY.variants("staged_decode")))
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: c.name)
def test_decode_variant_matches_oracle(case: DecodeCase, variant, gen: torch.Generator) -> None:
    x = make_decode_inputs(case, gen)
    expected, traces = x.oracle()
    check_decode_properties(case, x, traces)
    out, _ = launch_variant(variant, x)
    dtype = DTYPES[case.dtype]
    assert out.shape == expected.shape and out.dtype == dtype
    assert_close(out, expected, dtype, case.lkv, "decode out")


# --- the comparisons themselves ---------------------------------------------------------------


@pytest.mark.random_seeds(2)
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_a_one_percent_error_fails_and_rounding_passes(dtype: str, gen: torch.Generator) -> None:
    case = next(c for c in SPAN_CASES if c.dtype == dtype)
    x = make_span_inputs(case, gen)
    expected, _ = x.oracle_forward()
    torch_dtype = DTYPES[dtype]
    assert_close(expected.to(torch_dtype), expected, torch_dtype, case.lkv, "rounded")
    with pytest.raises(AssertionError, match="exceeds|scaled by"):
        assert_close((expected * 1.01).to(torch_dtype), expected, torch_dtype, case.lkv, "scaled")
    grads = oracle.span_gradients(x.q, x.k, x.v, x.qstart, x.qend, x.cache_position, x.mask, x.window,
                                  torch.randn(expected.shape, generator=gen, dtype=torch.float64))
    for grad in grads:
        assert_close(grad.to(torch_dtype), grad, torch_dtype, case.lkv, "rounded", spread=GRADIENT_SPREAD)
        with pytest.raises(AssertionError, match="scaled by|exceeds"):
            assert_close((grad * 1.01).to(torch_dtype), grad, torch_dtype, case.lkv, "scaled", spread=GRADIENT_SPREAD)
    broken = expected.to(torch_dtype).clone()
    broken.view(-1)[broken.numel() // 2] = float("nan")
    with pytest.raises(AssertionError, match="NaN"):
        assert_close(broken, expected, torch_dtype, case.lkv, "NaN")


def test_unwritten_outputs_show_as_nan() -> None:
    from helpers import poisoned_allocations

    with poisoned_allocations():
        buffer = torch.empty(3, 4)
        ints = torch.empty(3, dtype=torch.int32)
    assert torch.isnan(buffer).all() and ints.dtype == torch.int32
    assert not torch.isnan(torch.empty(3).fill_(0)).any()
