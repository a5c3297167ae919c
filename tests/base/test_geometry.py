"""Geometry against brute force: exact on the integer path, off-by-one-proof on the float path."""

from __future__ import annotations

import math
from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np
import oracle
import pytest
import torch

from superlinear_ops import compute_qend_from_qanchor, geometry, max_stripe_index_for_token_pos, window_len_from_sw_index


def _decimal_pow(base: int, exponent: float) -> Decimal:
    with localcontext() as ctx:
        ctx.prec = 80
        return Decimal(base) ** Decimal(exponent)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_max_stripe_index_integer_path_every_t_to_a_million(n: int) -> None:
    limit = 10**6
    powers = [i**n for i in range(int(limit ** (1 / n)) + 3)]
    expected = np.searchsorted(np.array(powers, dtype=np.int64), np.arange(limit + 1), side="right") - 1
    got = [max_stripe_index_for_token_pos(t, inv_search_power_int=n) for t in range(limit + 1)]
    assert np.array_equal(np.array(got), expected)


@pytest.mark.parametrize("p", [0.55, 0.6, 0.45, 0.7, 0.51])
def test_max_stripe_index_float_path_dense_sample(p: float) -> None:
    params = geometry.power_params(search_power=p, inv_search_power_int=None)
    assert not params.integer_path
    top = int((2**22) ** p) + 2
    # b_i = floor(i ** inv_p) in 80-digit arithmetic; the answer for t is #{i >= 1 : b_i <= t}.
    bounds = np.array(
        [int(_decimal_pow(i, params.inv_p).to_integral_value(rounding="ROUND_FLOOR")) for i in range(1, top)]
    )
    sample = np.unique(np.concatenate([np.arange(0, 50001), bounds - 1, bounds, bounds + 1]))
    sample = sample[(sample >= 0) & (sample <= 2**22)]
    expected = np.searchsorted(bounds, sample, side="right")
    got = [max_stripe_index_for_token_pos(int(t), search_power=p, inv_search_power_int=None) for t in sample]
    assert np.array_equal(np.array(got), expected)


def test_float_path_that_is_integer_uses_integer_powers() -> None:
    params = geometry.power_params(search_power=0.5, inv_search_power_int=None)
    assert params.integer_path and params.inv_int == 2
    assert window_len_from_sw_index(44, search_power=0.5, inv_search_power_int=None) == 2024
    third = geometry.power_params(search_power=1 / 3, inv_search_power_int=None)
    assert third.inv_int == 3
    assert max_stripe_index_for_token_pos(27, search_power=1 / 3, inv_search_power_int=None) == 3


@pytest.mark.parametrize("p", [0.55, 0.6, 0.45, 0.7])
def test_window_length_float_path_matches_exact_definition(p: float) -> None:
    params = geometry.power_params(search_power=p, inv_search_power_int=None)
    for sw in range(400):
        exact = int(_decimal_pow(sw + 1, params.inv_p).to_integral_value(rounding="ROUND_FLOOR")) - 1
        assert window_len_from_sw_index(sw, search_power=p, inv_search_power_int=None) == exact


def test_model_m_window_lengths() -> None:
    assert window_len_from_sw_index(65, search_power=0.55, inv_search_power_int=None) == 2032
    assert window_len_from_sw_index(44, inv_search_power_int=2) == 2024
    assert window_len_from_sw_index(0) == 0


@pytest.mark.parametrize("factor,span_power", [(2.0, 0.5), (3.0, 0.55), (1.0, 0.55), (0.5, 0.25), (2.5, 0.5)])
def test_span_length_table_is_exact(factor: float, span_power: float) -> None:
    limit = 20000
    table = geometry.span_length_table(factor, span_power, limit, torch.device("cpu")).numpy()
    fexact = Fraction(factor)
    for d in range(limit + 1):
        value = int(table[d])
        if d == 0:
            assert value == 0
            continue
        # ceil(f * d**sp) == value  <=>  value - 1 < f * d**sp <= value, checked in 80 digits.
        with localcontext() as ctx:
            ctx.prec = 80
            x = Decimal(fexact.numerator) / Decimal(fexact.denominator) * _decimal_pow(d, span_power)
        assert value - 1 < x <= value, (d, value, x)
    # Perfect squares are where float64 pow alone is most at risk for span_power 0.5.
    if span_power == 0.5 and factor.is_integer():
        for m in range(1, 141):
            assert table[m * m] == int(factor) * m


def test_compute_qend_matches_spec_and_marks_unused() -> None:
    window = window_len_from_sw_index(3)  # 15
    anchors = torch.tensor([[[[2, -1, 40]]]])
    cache_position = torch.tensor([100])
    qend = compute_qend_from_qanchor(
        anchors, cache_position=cache_position, key_length=128, sw_index=3, forward_factor=1.0, span_power=0.5
    )
    forward = math.ceil(1.0 * 101**0.5)
    expected = [min(2 + forward, 100, 127, 100 - window), -1, min(40 + forward, 100 - window)]
    assert qend.tolist() == [[[expected]]]
    same = compute_qend_from_qanchor(anchors, cache_position=cache_position, key_length=128, forward_factor=0.0)
    assert same is anchors


def test_compute_qend_uses_each_rows_first_allowed_key() -> None:
    mask = torch.ones(2, 64, dtype=torch.bool)
    mask[1, :30] = False
    anchors = torch.tensor([[[[5]]], [[[35]]]])
    qend = compute_qend_from_qanchor(
        anchors, cache_position=torch.tensor([60]), key_length=64, attention_mask=mask,
        forward_factor=2.0, span_power=0.5,
    )
    assert qend[0].item() == 5 + math.ceil(2 * 61**0.5)
    assert qend[1].item() == 35 + math.ceil(2 * 31**0.5)


@pytest.mark.parametrize(
    "kwargs,error",
    [
        (dict(search_power=0.5, inv_search_power_int=2), ValueError),
        (dict(search_power=None, inv_search_power_int=None), ValueError),
        (dict(search_power=1.5, inv_search_power_int=None), ValueError),
        (dict(search_power=float("nan"), inv_search_power_int=None), ValueError),
        (dict(search_power=None, inv_search_power_int=7), ValueError),
        (dict(search_power="0.5", inv_search_power_int=None), TypeError),
    ],
)
def test_bad_power_parameters_name_the_argument(kwargs, error) -> None:
    with pytest.raises(error, match="search_power|inv_search_power_int"):
        window_len_from_sw_index(3, **kwargs)


def test_bad_sw_index_and_token_pos() -> None:
    with pytest.raises(ValueError, match="sw_index"):
        window_len_from_sw_index(-1)
    with pytest.raises(TypeError, match="sw_index"):
        window_len_from_sw_index(2.0)
    with pytest.raises(ValueError, match="token_pos"):
        max_stripe_index_for_token_pos(-3)
    with pytest.raises(ValueError, match="span_power"):
        geometry.check_span_power(1.0)
    with pytest.raises(ValueError, match="forward_factor"):
        geometry.check_factor("forward_factor", -1.0, allow_zero=True)


ORACLE_POWERS = [oracle.Power.of(inv_search_power_int=n) for n in (2, 3)] + [
    oracle.Power.of(search_power=p) for p in (0.55, 0.6, 0.45)
]


@pytest.mark.parametrize("power", ORACLE_POWERS, ids=lambda p: f"int{p.inv_int}" if p.inv_int else f"inv{p.inv_p:.4f}")
def test_stripes_and_windows_match_the_independent_oracle(power) -> None:
    """stripe_count, stripe_offsets and window_length against the oracle's integer search, at every
    key length up to 1200 and every sw_index up to 12 (the decode tables are built from these)."""
    params = geometry.power_params(**power.kwargs())
    for sw_index in range(13):
        assert geometry.window_length(sw_index, params) == oracle.window_length(sw_index, power)
        for key_length in range(1, 1201, 7 if sw_index else 1):
            assert geometry.stripe_count(key_length, sw_index, params) == oracle.stripe_count(key_length, sw_index, power)
        offsets = geometry.stripe_offsets(1200, sw_index, params).tolist()
        assert offsets == oracle.stripe_offsets(1200, sw_index, power), sw_index


@pytest.mark.parametrize("factor,span_power", [(3.0, 0.55), (2.0, 0.5), (0.5, 0.45)])
def test_span_length_table_matches_the_independent_oracle(factor: float, span_power: float) -> None:
    table = geometry.span_length_table(factor, span_power, 3000, torch.device("cpu")).tolist()
    assert table == [oracle.ceil_scaled(factor, d, span_power) for d in range(3001)]
