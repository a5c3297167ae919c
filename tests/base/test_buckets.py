"""Shape buckets and problem keys."""

from __future__ import annotations

import pytest
from helpers import problem

from superlinear_ops.buckets import key_of, neighbours, next_power_of_two, query_bucket
from superlinear_ops.problem import DeviceIdentity


@pytest.mark.parametrize("n,expected", [(0, 1), (1, 1), (2, 2), (3, 4), (8192, 8192), (8193, 16384), (139000, 262144)])
def test_next_power_of_two(n: int, expected: int) -> None:
    assert next_power_of_two(n) == expected


def test_decode_is_its_own_query_bucket() -> None:
    assert query_bucket(1) == 1 and query_bucket(2) == 2
    assert key_of(problem(queries=1)).queries == 1


def test_sizes_in_one_bucket_share_a_key_and_exact_fields_do_not() -> None:
    a, b = key_of(problem(keys=131073)), key_of(problem(keys=262144))
    assert a == b and a.keys == 262144
    assert key_of(problem(queries=5000)) == key_of(problem(queries=8192))
    for change in (dict(head_dim=64), dict(q_heads=16), dict(spans=2), dict(masked=True), dict(sw_index=44),
                   dict(power="int2"), dict(dtype="float16"), dict(device=DeviceIdentity("NVIDIA H100", "sm_90", 132))):
        assert key_of(problem(**change)) != key_of(problem()), change


def test_key_text_is_stable_and_complete() -> None:
    text = key_of(problem()).text()
    assert text == "span_forward|bfloat16|D128|H32/2|K3|Lq8192|Lkv262144|B1|nomask|sw65|float0.55|f-|NVIDIA H200|sm_90"


def test_neighbours_move_sizes_by_one_factor_of_two() -> None:
    key = key_of(problem())
    near = neighbours(key, 1)
    assert all(steps == 1 for steps, _ in near)
    assert {(k.queries, k.keys, k.batch) for _, k in near} == {
        (4096, 262144, 1), (16384, 262144, 1), (8192, 131072, 1), (8192, 524288, 1), (8192, 262144, 2)
    }


def test_decode_neighbours_keep_one_query_and_others_never_reach_it() -> None:
    decode = key_of(problem(op="staged_decode", queries=1, factors=(3.0, 1.0, 0.55)))
    assert all(k.queries == 1 for _, k in neighbours(decode, 2))
    two = key_of(problem(queries=2))
    assert all(k.queries != 1 for _, k in neighbours(two, 2))
