"""Bad input: every case raises the specific error naming the argument, or gives the
correct (exact, clamped) result where the input is legal. Tiny shapes; Triton under the interpreter."""

from __future__ import annotations

import math

import pytest
import torch

from superlinear_ops import decode_span_attention_staged_gqa, fused_span_attention_gqa, geometry
from superlinear_ops.api import clamped_positions
from superlinear_ops.ops.span_attention.reference import decode_reference
from superlinear_ops.ops.staged_decode.tables import decode_tables
from superlinear_ops.problem import STAGED_DECODE, Problem
from superlinear_ops.registry import REGISTRY
from superlinear_ops.settings import SpanSettings

INT2 = geometry.power_params(search_power=None, inv_search_power_int=2)
DECODE = {"sw_index": 2, "topk": 2, "backward_factor": 2.0, "forward_factor": 1.0, "span_power": 0.5}


def _span_inputs(dtype=torch.float32, lkv: int = 24):
    gen = torch.Generator().manual_seed(21)
    q = torch.randn(1, 2, 3, 8, generator=gen, dtype=dtype)
    k, v = (torch.randn(1, 1, lkv, 8, generator=gen, dtype=dtype) for _ in range(2))
    qstart = torch.tensor([[[[0, 2]] * 3] * 2])
    qend = qstart + 3
    return q, k, v, qstart, qend, torch.tensor([14, 15, 16])


def _decode_inputs(batch: int = 1, dtype=torch.float32, lkv: int = 64):
    gen = torch.Generator().manual_seed(22)
    q1, q2 = (torch.randn(batch, 2, 1, 8, generator=gen, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(batch, 1, lkv, 8, generator=gen, dtype=dtype) for _ in range(2))
    return q1, q2, k, v, torch.tensor([40])


# --- masks and positions ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_float_additive_mask_is_rejected(dtype) -> None:
    q, k, v, qstart, qend, cp = _span_inputs()
    mask = torch.zeros(1, 24, dtype=dtype)
    mask[0, :4] = -math.inf
    with pytest.raises(TypeError, match="attention_mask.*bool or integer keep-mask"):
        fused_span_attention_gqa(q, k, v, qstart, qend, cp, mask)
    q1, q2, k, v, cp = _decode_inputs()
    with pytest.raises(TypeError, match="attention_mask.*bool or integer keep-mask"):
        decode_span_attention_staged_gqa(q1, q2, k, v, cp, torch.zeros(1, 64, dtype=dtype))
    with pytest.raises(TypeError, match="attention_mask.*bool or integer keep-mask"):
        geometry.compute_qend_from_qanchor(qstart, cache_position=torch.tensor([14, 15, 16]), key_length=24,
                                           attention_mask=mask, forward_factor=1.0)


def test_integer_and_bool_masks_agree() -> None:
    q, k, v, qstart, qend, cp = _span_inputs()
    keep = torch.ones(1, 24, dtype=torch.bool)
    keep[0, 1] = keep[0, 15] = False
    outs = [fused_span_attention_gqa(q, k, v, qstart, qend, cp, keep.to(dt)) for dt in (torch.bool, torch.int8, torch.int64)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=0, atol=0)


def test_mask_given_as_a_list_is_rejected() -> None:
    q, k, v, qstart, qend, cp = _span_inputs()
    with pytest.raises(TypeError, match="attention_mask must be a torch.Tensor"):
        fused_span_attention_gqa(q, k, v, qstart, qend, cp, [[1] * 24])
    with pytest.raises(TypeError, match="attention_mask must be a torch.Tensor"):
        geometry.compute_qend_from_qanchor(qstart, cache_position=cp, key_length=24, attention_mask=[[1] * 24])


def test_float_cache_position_is_rejected() -> None:
    q, k, v, qstart, qend, cp = _span_inputs()
    with pytest.raises(TypeError, match="cache_position must be int32 or int64"):
        fused_span_attention_gqa(q, k, v, qstart, qend, cp.float())
    q1, q2, k, v, cp = _decode_inputs()
    with pytest.raises(TypeError, match="cache_position must be int32 or int64"):
        decode_span_attention_staged_gqa(q1, q2, k, v, cp.double())
    with pytest.raises(TypeError, match="cache_position must be int32 or int64"):
        geometry.compute_qend_from_qanchor(torch.zeros(1, 1, 1, 1, dtype=torch.long), cache_position=torch.tensor([3.0]),
                                           key_length=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["kernels", "reference"])
def test_positions_beyond_int32_are_clamped_to_the_last_key(dtype) -> None:
    """cache_position = 2**32 + 5 means pos = Lkv - 1 (SPEC), with or without validate: never wraps."""
    q, k, v, qstart, qend, _ = _span_inputs(dtype)
    huge = torch.tensor([2**32 + 5, 2**40, 2**63 - 1])
    last = torch.tensor([23, 23, 23])
    expected = fused_span_attention_gqa(q, k, v, qstart, qend, last, sw_index=1)
    for validate in (False, True):
        out = fused_span_attention_gqa(q, k, v, qstart, qend, huge, sw_index=1, validate=validate)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    q1, q2, k, v, _ = _decode_inputs(dtype=dtype)
    expected = decode_span_attention_staged_gqa(q1, q2, k, v, torch.tensor([63]), **DECODE)
    for mode in (None, "sdpa"):
        want = decode_span_attention_staged_gqa(q1, q2, k, v, torch.tensor([63]), force_mode=mode, **DECODE)
        out = decode_span_attention_staged_gqa(q1, q2, k, v, torch.tensor([2**32 + 5]), force_mode=mode, **DECODE)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert torch.isfinite(expected).all()



def test_int32_positions_past_the_last_key_equal_int64_ones(monkeypatch) -> None:
    """Positions past the last key mean Lkv - 1 in int32 as in int64: spans that reach into the
    window of that last key are clamped before it (the public ops clamp positions, int32 included,
    and the span-tile plan's kernels again). The tensor-core forward runs here."""
    from superlinear_ops.ops.span_attention import tile_forward as span_tc_forward

    plans = []
    real_plan = span_tc_forward.span_tile_plan
    monkeypatch.setattr(span_tc_forward, "span_tile_plan", lambda *args: plans.append(args) or real_plan(*args))
    q, k, v, qstart, _, _ = _span_inputs()
    qend = torch.tensor([[[[20, 23]] * 3] * 2])  # ends inside the window of key 23 (W 3: keys 21..23)
    expected = fused_span_attention_gqa(q, k, v, qstart, qend, torch.tensor([23, 23, 23]), sw_index=1)
    for past in (torch.tensor([30, 40, 2**31 - 1], dtype=torch.int32), torch.tensor([30, 40, 2**31 - 1])):
        out = fused_span_attention_gqa(q, k, v, qstart, qend, past, sw_index=1)
        torch.testing.assert_close(out, expected, rtol=0, atol=0, msg=f"{past.dtype} positions past the last key")
    assert len(plans) == 3, "the tensor-core forward (its span-tile plan) ran each call"
    clamped = clamped_positions(torch.tensor([30, 2**31 - 1, 5], dtype=torch.int32), 24)
    assert clamped.dtype == torch.int32 and clamped.tolist() == [23, 23, 5], "the public ops clamp int32 positions"

# --- decode bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["kernels", "reference"])
def test_decode_batch_zero(dtype) -> None:
    q1, q2, k, v, cp = _decode_inputs(batch=0, dtype=dtype)
    for mode in (None, "sdpa"):
        out = decode_span_attention_staged_gqa(q1, q2, k, v, cp, force_mode=mode, **DECODE)
        assert out.shape == (0, 2, 1, 8) and out.dtype == dtype


def _oracle(q1, q2, k, v, cp, **settings):
    return decode_reference(q1, q2, k, v, cp, None, params=INT2, **settings)


@pytest.mark.parametrize("settings", [
    dict(DECODE, sw_index=10**6),
    dict(DECODE, topk=1000),
    dict(DECODE, backward_factor=1e6),
    dict(DECODE, forward_factor=1e6),
], ids=["sw_index-1e6", "topk-1000", "backward-1e6", "forward-1e6"])
def test_oversized_decode_settings_are_clamped_exactly(settings) -> None:
    """Huge window, topk or span factors: every decode variant gives the reference's result, with
    window, topk, span lengths and grids bounded by the keys."""
    q1, q2, k, v, cp = _decode_inputs()
    expected = _oracle(q1, q2, k, v, cp, **settings)
    out = decode_span_attention_staged_gqa(q1, q2, k, v, cp, **settings)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    decode = SpanSettings(params=INT2, **settings)
    bounded = decode.for_keys(64)
    assert bounded.topk <= 64 and decode.window_for(64) <= 64
    tables = decode_tables(64, bounded, torch.device("cpu"))
    assert tables.longest_span <= 64 and int(tables.back.max()) <= 64
    factors = (settings["backward_factor"], settings["forward_factor"], settings["span_power"])
    problem = Problem.for_decode(q2, k, settings["topk"], False, settings["sw_index"], INT2.label, factors)
    for variant in REGISTRY.variants(STAGED_DECODE):
        if not variant.not_supported_reasons(problem):
            got = variant.launch(q1, q2, k, v, cp, None, decode, variant.default(problem))
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=variant.qualified_name)


def test_float64_decode_stays_float64() -> None:
    """The float64 decode (reference path) matches the float64 oracle to rounding, not fp32's 1e-8."""
    q1, q2, k, v, cp = _decode_inputs(dtype=torch.float64)
    q1 = q1 * 1e3  # search scores far from fp32-exact
    out = decode_span_attention_staged_gqa(q1, q2, k, v, cp, **DECODE)
    expected = _oracle(q1, q2, k, v, cp, **DECODE)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-13, atol=1e-13)


def test_sw_index_past_any_window_is_rejected_by_the_ops() -> None:
    q1, q2, k, v, cp = _decode_inputs()
    with pytest.raises(ValueError, match="sw_index"):
        decode_span_attention_staged_gqa(q1, q2, k, v, cp, **dict(DECODE, sw_index=10**30))
    q, k, v, qstart, qend, cp = _span_inputs()
    with pytest.raises(ValueError, match="sw_index"):
        fused_span_attention_gqa(q, k, v, qstart, qend, cp, sw_index=10**30)


# --- geometry helpers ---------------------------------------------------------------------------


def test_geometry_helpers_bound_their_inputs() -> None:
    with pytest.raises(ValueError, match="sw_index = 10+ gives a window longer than 2\\*\\*62"):
        geometry.window_len_from_sw_index(10**30)
    assert geometry.window_len_from_sw_index(10**6) == (10**6 + 1) ** 2 - 1
    for power in (1e-3, 1e-300):
        with pytest.raises(ValueError, match="search_power must be in \\[0.02, 1\\)"):
            geometry.window_len_from_sw_index(3, search_power=power, inv_search_power_int=None)
        with pytest.raises(ValueError, match="search_power"):
            geometry.max_stripe_index_for_token_pos(100, search_power=power, inv_search_power_int=None)
    with pytest.raises(ValueError, match="token_pos must be < 2\\*\\*62"):
        geometry.max_stripe_index_for_token_pos(10**30)
    with pytest.raises(ValueError, match="token_pos must be < 2\\*\\*62"):
        geometry.max_stripe_index_for_token_pos(10**30, search_power=0.55, inv_search_power_int=None)
    assert geometry.max_stripe_index_for_token_pos(2**62 - 1, search_power=0.55, inv_search_power_int=None) > 0
    assert geometry.max_stripe_index_for_token_pos(2**62 - 1) == 2**31 - 1


def test_smallest_search_power_stays_exact() -> None:
    """p = 0.02 (inv_p 50): powers past 2**62 are capped, the window and stripe search stay exact."""
    assert geometry.window_len_from_sw_index(1, search_power=0.02, inv_search_power_int=None) == 2**50 - 1
    assert geometry.max_stripe_index_for_token_pos(2**50 - 1, search_power=0.02, inv_search_power_int=None) == 1
    assert geometry.max_stripe_index_for_token_pos(2**50, search_power=0.02, inv_search_power_int=None) == 2
    assert geometry.window_len_from_sw_index(0, search_power=1e-2 * 2, inv_search_power_int=None) == 0


def test_compute_qend_with_a_huge_key_length_sizes_its_table_by_the_positions() -> None:
    anchors = torch.tensor([[[[5, -1]]]])
    qend = geometry.compute_qend_from_qanchor(anchors, cache_position=torch.tensor([100]), key_length=2**31 - 1,
                                              forward_factor=1.0)
    assert qend.tolist() == [[[[5 + 11, -1]]]]  # ceil(1.0 * 101 ** 0.5) = 11
    with pytest.raises(ValueError, match="key_length must be in \\[1, 2\\*\\*62\\]"):
        geometry.compute_qend_from_qanchor(anchors, cache_position=torch.tensor([100]), key_length=2**70)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.uint8])
def test_narrow_anchor_dtypes_are_rejected(dtype) -> None:
    anchors = torch.tensor([[[[120]]]], dtype=dtype)
    with pytest.raises(TypeError, match="qanchor must be int32 or int64"):
        geometry.compute_qend_from_qanchor(anchors, cache_position=torch.tensor([200]), key_length=256,
                                           forward_factor=1.0)
    qend = geometry.compute_qend_from_qanchor(anchors.long(), cache_position=torch.tensor([200]), key_length=256,
                                              forward_factor=1.0)
    assert qend.item() == 120 + 15  # ceil(201 ** 0.5) = 15, no wrap past 127
