"""Numerics: the float64 path is differentiable, unattended NaN never leaks, attended NaN
always shows, and spans overlapping the window give the same result on every variant.

Every registered variant that applies on this machine runs directly (the Triton ones under the
interpreter, see conftest); the oracle is the float64 reference on clean inputs. Seeds are fixed
per test (printed on failure through the test id).
"""

from __future__ import annotations

import math

import pytest
import torch

from superlinear_ops import decode_span_attention_staged_gqa, fused_span_attention_gqa, geometry
from superlinear_ops.launch import LaunchGeometry
from superlinear_ops.ops.span_attention.reference import decode_reference, span_backward_reference, span_forward_reference
from superlinear_ops.problem import SPAN_BACKWARD, SPAN_FORWARD, STAGED_DECODE, Problem
from superlinear_ops.registry import REGISTRY
from superlinear_ops.settings import SpanSettings

INT2 = geometry.power_params(search_power=None, inv_search_power_int=2)


def _variants(op: str, problem: Problem) -> list:
    return [v for v in REGISTRY.variants(op) if not v.not_supported_reasons(problem)]


# --- span attention inputs --------------------------------------------------------------------


def _span_case(seed: int, *, overlap: bool = False, lkv: int = 32):
    """Hq 2 over Hkv 1, Lq 4 queries at positions 20..23, W = 8 (sw_index 2), K = 2 spans in [0, 15]
    (``overlap``: spans reaching into and past each query's window)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, 4, 16, generator=gen)
    k = torch.randn(1, 1, lkv, 16, generator=gen)
    v = torch.randn(1, 1, lkv, 16, generator=gen)
    qstart = torch.randint(0, 8, (1, 2, 4, 2), generator=gen)
    qend = qstart + torch.randint(0, 8, (1, 2, 4, 2), generator=gen)
    if overlap:
        qend = qend + 12  # ends at 12..29: inside the window [pos - 7, pos] or past pos
    qend[0, 1, 2, 1] = qstart[0, 1, 2, 1] = -1  # one unused slot
    return q, k, v, qstart, qend, torch.arange(20, 24), 8


def _launch_forward(variant, q, k, v, qstart, qend, cp, window, mask=None):
    geo = LaunchGeometry.prepare(q, k, v, qstart, qend, cp, mask, window)
    return variant.launch(geo, variant.default(_span_problem(SPAN_FORWARD, q, k)))


def _launch_backward(variant, q, k, v, qstart, qend, cp, window, out, lse, grad):
    geo = LaunchGeometry.prepare(q, k, v, qstart, qend, cp, None, window)
    return variant.launch(geo, variant.default(_span_problem(SPAN_BACKWARD, q, k)), out, lse, grad)


def _span_problem(op: str, q, k) -> Problem:
    return Problem.for_span(op, q, k, 2, False, 2, INT2.label)


def test_float64_reference_path_is_differentiable() -> None:
    """fused_span_attention_gqa on CPU float64 (the reference path): backward runs and gradcheck passes."""
    q, k, v, qstart, qend, cp, _ = _span_case(1)
    leaves = [t.double().requires_grad_() for t in (q[:, :, :, :4], k[:, :, :24, :4], v[:, :, :24, :4])]
    mask = torch.ones(1, 24, dtype=torch.bool)
    mask[0, 3] = False

    def op(a, b, c):
        return fused_span_attention_gqa(a, b, c, qstart, qend.clamp(max=23), cp, mask, sw_index=2)

    op(*leaves).sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)
    assert torch.autograd.gradcheck(op, leaves)


def test_reference_backward_matches_autograd() -> None:
    """The analytic reference backward (the span_backward reference variant) equals autograd."""
    q, k, v, qstart, qend, cp, window = _span_case(2, overlap=True)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out = span_forward_reference(*leaves, qstart, qend, cp, None, window)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    expected = torch.autograd.grad(out, leaves, grad)
    actual = span_backward_reference(*[t.detach() for t in leaves], qstart, qend, cp, None, window, grad)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def _poison_tail(k: torch.Tensor, v: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = k.clone(), v.clone()
    k[:, :, first:] = math.nan
    v[:, :, first:, ::2] = math.inf
    v[:, :, first:, 1::2] = math.nan
    return k, v


def _assert_every_pair_matches(q, k, v, qstart, qend, cp, window, grad, expected, expected_grads) -> None:
    """Every span-forward variant's output, and every backward variant's dQ, dK, dV after it, equal
    the expected ones (rtol 1e-4, atol 1e-5)."""
    for variant in _variants(SPAN_FORWARD, _span_problem(SPAN_FORWARD, q, k)):
        out, lse = _launch_forward(variant, q, k, v, qstart, qend, cp, window)
        torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5, msg=variant.qualified_name)
        for backward in _variants(SPAN_BACKWARD, _span_problem(SPAN_BACKWARD, q, k)):
            grads = _launch_backward(backward, q, k, v, qstart, qend, cp, window, out, lse, grad)
            for name, g, e in zip(("dQ", "dK", "dV"), grads, expected_grads):
                torch.testing.assert_close(g.double(), e, rtol=1e-4, atol=1e-5,
                                           msg=f"{variant.qualified_name} + {backward.qualified_name}: {name}")


def test_unattended_nan_never_leaks_span_forward_and_backward() -> None:
    """NaN/Inf in K and V past every query's position (a static-cache tail) and at a key no span or
    window covers: every forward and backward variant equals the reference on clean data."""
    q, k, v, qstart, qend, cp, window = _span_case(4)
    qstart[..., 0], qend[..., 0], qstart[..., 1], qend[..., 1] = 0, 2, 1, 3  # keys 4..12: nobody's
    bad_k, bad_v = _poison_tail(k, v, 24)
    bad_k[:, :, 6], bad_v[:, :, 6] = math.nan, math.nan
    expected = span_forward_reference(q.double(), k.double(), v.double(), qstart, qend, cp, None, window)
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(5))
    expected_grads = span_backward_reference(q.double(), k.double(), v.double(), qstart, qend, cp, None, window,
                                             grad.double())
    _assert_every_pair_matches(q, bad_k, bad_v, qstart, qend, cp, window, grad, expected, expected_grads)


def test_unattended_nan_never_leaks_through_the_api() -> None:
    """The reference path of the public op (float64) with NaN beyond every position and a masked NaN key."""
    q, k, v, qstart, qend, cp, _ = _span_case(6)
    mask = torch.ones(1, 32, dtype=torch.bool)
    mask[0, 2] = False
    bad_k, bad_v = _poison_tail(k, v, 24)
    bad_k[:, :, 2], bad_v[:, :, 2] = math.nan, math.inf
    args = (qstart, qend, cp, mask)
    expected = fused_span_attention_gqa(q.double(), k.double(), v.double(), *args, sw_index=2)
    actual = fused_span_attention_gqa(q.double(), bad_k.double(), bad_v.double(), *args, sw_index=2)
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


def test_attended_nan_shows_on_every_forward_variant() -> None:
    """NaN in one Q2 row, or in an attended key, gives NaN exactly where the reference (dense
    attention over the attended keys) gives NaN; every other output is unchanged."""
    q, k, v, qstart, qend, cp, window = _span_case(7)
    q[0, 0, 1, 3] = math.nan  # row (h 0, q 1): every span of it
    k[0, 0, 14, 5] = math.nan  # in the windows of queries 0 and 1 (and in some spans)
    v[0, 0, 23, 0] = math.nan  # window key of query 3 only, one column
    expected = span_forward_reference(q.double(), k.double(), v.double(), qstart, qend, cp, None, window)
    assert expected.isnan().any() and (~expected.isnan()).any()
    for variant in _variants(SPAN_FORWARD, _span_problem(SPAN_FORWARD, q, k)):
        out, _ = _launch_forward(variant, q, k, v, qstart, qend, cp, window)
        assert (out.isnan() | ~expected.isnan()).all(), variant.qualified_name  # every attended NaN shows
        if variant.name != "tc_tiles":
            assert torch.equal(out.isnan(), expected.isnan()), variant.qualified_name
        # Tensor-core tiles share one P @ V product: a non-finite value one row attends also reaches
        # the rows of its tile (0 * NaN), as in FlashAttention; keys no row attends never do
        # (test_unattended_nan_never_leaks_span_forward_and_backward).
        same = ~out.isnan()
        torch.testing.assert_close(out.double()[same], expected[same], rtol=1e-4, atol=1e-5)


def test_spans_overlapping_the_window_match_on_every_variant() -> None:
    """Unvalidated spans reaching into (and past) the window: every variant clamps them to end at
    pos - W, as the reference does (forward and backward)."""
    q, k, v, qstart, qend, cp, window = _span_case(8, overlap=True)
    expected = span_forward_reference(q.double(), k.double(), v.double(), qstart, qend, cp, None, window)
    clamped = torch.minimum(qend, cp.view(1, 1, -1, 1) - window)
    clamped = torch.where(qend < 0, qend, clamped)
    same = span_forward_reference(q.double(), k.double(), v.double(), qstart, clamped, cp, None, window)
    torch.testing.assert_close(expected, same, rtol=0, atol=0)  # the reference clamps
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(9))
    expected_grads = span_backward_reference(q.double(), k.double(), v.double(), qstart, qend, cp, None, window,
                                             grad.double())
    _assert_every_pair_matches(q, k, v, qstart, qend, cp, window, grad, expected, expected_grads)


# --- decode -------------------------------------------------------------------------------------

DECODE = {"sw_index": 2, "topk": 2, "backward_factor": 2.0, "forward_factor": 1.0, "span_power": 0.5}


def _decode_case(seed: int, dtype=torch.float32):
    """A 64-key static cache filled up to pos 40 (W 8, four valid stripes), Hq 2 over Hkv 1."""
    gen = torch.Generator().manual_seed(seed)
    q1, q2 = (torch.randn(1, 2, 1, 16, generator=gen, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(1, 1, 64, 16, generator=gen, dtype=dtype) for _ in range(2))
    return q1, q2, k, v, torch.tensor([40])


def _decode_variants(q2, k, masked: bool) -> list:
    factors = (DECODE["backward_factor"], DECODE["forward_factor"], DECODE["span_power"])
    problem = Problem.for_decode(q2, k, DECODE["topk"], masked, DECODE["sw_index"], INT2.label, factors)
    return _variants(STAGED_DECODE, problem)


def _run_decode(variant, q1, q2, k, v, cp, mask):
    settings = SpanSettings(DECODE["sw_index"], DECODE["topk"], DECODE["backward_factor"],
                              DECODE["forward_factor"], DECODE["span_power"], INT2)
    factors = (DECODE["backward_factor"], DECODE["forward_factor"], DECODE["span_power"])
    problem = Problem.for_decode(q2, k, DECODE["topk"], mask is not None, DECODE["sw_index"], INT2.label, factors)
    return variant.launch(q1, q2, k, v, cp, mask, settings, variant.default(problem))


def _decode_oracle(q1, q2, k, v, cp, mask):
    return decode_reference(q1, q2, k, v, cp, mask, params=INT2, **DECODE)


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
def test_static_cache_nan_tail_never_leaks_in_decode(masked: bool) -> None:
    """NaN/Inf in the unused tail 50..63 of a static cache (pos 40), with or without a mask zeroing
    it: every decode variant, and force_mode='sdpa', equals the reference on clean data."""
    q1, q2, k, v, cp = _decode_case(10)
    mask = None
    if masked:
        mask = torch.ones(1, 64, dtype=torch.int32)
        mask[0, 50:] = 0
    bad_k, bad_v = _poison_tail(k, v, 50)
    expected = _decode_oracle(q1, q2, k, v, cp, mask)
    for variant in _decode_variants(q2, k, masked):
        out = _run_decode(variant, q1, q2, bad_k, bad_v, cp, mask)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5, msg=variant.qualified_name)
    for dtype in (torch.float32, torch.float64):  # the kernel path and the reference path
        args = [t.to(dtype) for t in (q1, q2, bad_k, bad_v)]
        sdpa = decode_span_attention_staged_gqa(*args, cp, mask, force_mode="sdpa", **DECODE)
        dense = torch.softmax(q2.double() @ k[:, :, :41].double().transpose(-1, -2) / 4.0, dim=-1) @ v[:, :, :41].double()
        torch.testing.assert_close(sdpa.double(), dense, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("where", ["q1", "q2", "window-key"])
def test_attended_nan_shows_in_decode(where: str) -> None:
    """NaN in Q1 (the search reads it), in Q2, or in an attended window key: NaN output for that
    head on every decode variant, as in the reference; the other head is unchanged."""
    q1, q2, k, v, cp = _decode_case(11)
    q1b, q2b = torch.cat([q1, q1], dim=1), torch.cat([q2, q2], dim=1)  # Hq 4 over Hkv 2
    kb, vb = torch.cat([k, k], dim=1), torch.cat([v, v], dim=1)
    if where == "q1":
        q1b[0, 0, 0, 3] = math.nan
    elif where == "q2":
        q2b[0, 0, 0, 3] = math.nan
    else:
        kb[0, 0, 38, 1] = math.nan  # in the window [33, 40] of kv head 0 (query heads 0 and 1)
    expected = _decode_oracle(q1b, q2b, kb, vb, cp, None)
    nan_heads = [0] if where != "window-key" else [0, 1]
    assert expected[0, nan_heads].isnan().all() and torch.isfinite(expected[0, 2:]).all()
    for variant in _decode_variants(q2b, kb, False):
        out = _run_decode(variant, q1b, q2b, kb, vb, cp, None)
        assert out[0, nan_heads].isnan().all(), variant.qualified_name
        torch.testing.assert_close(out[0, 2:], expected[0, 2:], rtol=1e-4, atol=1e-5, msg=variant.qualified_name)
