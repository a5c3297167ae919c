"""The stripe-tile search in rounds (``attention_layer/stripe_rounds``) against the float64 oracle's
anchor sets and, bit for bit, against the one-launch ``stripe_tiles``: every layer case (masks, B 2,
static caches, scattered positions, short prefixes, bf16 ties) and two at 16 heads a KV group, at
round sizes that give 1 to 10 rounds a KV group, with poisoned outputs; one launch per (group,
round); and the round size on a GPU."""

from __future__ import annotations

import dataclasses

import oracle
import pytest
import torch
import triton
from helpers import KernelSpy, poisoned_allocations
from layer_cases import CASES, LayerCase, check_anchors, check_properties, launch_search, make_inputs, problem_of

from superlinear_ops.launch import KernelConfig
from superlinear_ops.ops.layer_search import stripe_rounds
from superlinear_ops.problem import DeviceIdentity
from superlinear_ops.registry import REGISTRY

ROUNDS = REGISTRY.get("attention_layer", "stripe_rounds")
ONE_LAUNCH = REGISTRY.get("attention_layer", "stripe_tiles")
# The layer cases, and two of them at model M's 16 heads a KV group over 2 groups: one query a program, so
# rounds of a few queries (many rounds a group; B 2 halves them).
ROUND_CASES = [*CASES, *(dataclasses.replace(case, name=f"{case.name}-rep16", hq=32, hkv=2)
                         for case in CASES if case.name in ("ties-mid-chunk", "left-padding"))]


def expected_rounds(case: LayerCase, config: KernelConfig) -> int:
    """Launches the CPU (one multiprocessor) makes: per KV group, the queries in rounds of as many
    query blocks as make ``programs_per_sm`` programs."""
    head_blocks = triton.cdiv(case.hq // case.hkv, config.block_h)
    per_round = max(1, config.programs_per_sm // (head_blocks * case.batch)) * config.block_q
    return case.hkv * triton.cdiv(case.lq, per_round)


@pytest.mark.parametrize("programs", [8, 16, 32])
@pytest.mark.parametrize("case", ROUND_CASES, ids=lambda c: c.name)
def test_rounds_give_the_oracles_anchors_and_the_one_launch_search_bit_for_bit(
        case: LayerCase, programs: int, gen: torch.Generator, monkeypatch) -> None:
    """Each round size: the oracle's anchor sets and scores, the same tensors as ``stripe_tiles``, and
    one kernel launch per (KV group, round), with every output buffer poisoned before the run."""
    x = make_inputs(case, gen)
    _, traces = oracle.attention_layer(x.q1, x.q2, x.k, x.v, x.cache_position, x.mask, case.params)
    check_properties(case, x, traces)
    problem = problem_of(case, x)
    config = ROUNDS.default(problem).replace(programs_per_sm=programs)
    assert ROUNDS.contains(config) and ROUNDS.compile_check(problem, config) is None, config.text()
    spy = KernelSpy(stripe_rounds.stripe_tile_search_kernel)
    monkeypatch.setattr(stripe_rounds, "stripe_tile_search_kernel", spy)
    with poisoned_allocations():
        found = launch_search(ROUNDS, case, x, config)
    check_anchors(found, traces, case, f"stripe_rounds {config.text()}")
    assert spy.launches == expected_rounds(case, config)
    whole = launch_search(ONE_LAUNCH, case, x, ONE_LAUNCH.default(problem))
    assert torch.equal(found.anchors, whole.anchors)
    assert torch.equal(found.scores.nan_to_num(), whole.scores.nan_to_num())
    assert found.scores.isnan().equal(whole.scores.isnan())


def test_some_case_runs_in_several_rounds_per_group() -> None:
    """At the smallest rounds, the test above splits some case's KV groups into three or more rounds
    (its configuration: the variant's default for the case, with 8 programs per multiprocessor)."""
    counts = []
    for case in ROUND_CASES:
        x = make_inputs(case, torch.Generator().manual_seed(0))
        config = ROUNDS.default(problem_of(case, x)).replace(programs_per_sm=8)
        counts.append(expected_rounds(case, config) // case.hkv)
    assert max(counts) >= 3


def test_a_round_fills_the_gpu_once_for_one_group(monkeypatch) -> None:
    """On 132 multiprocessors at model M (16 heads a group, one block of them): 32 programs per
    multiprocessor make rounds of 4,224 queries, and never more than the chunk's blocks."""
    monkeypatch.setattr(stripe_rounds, "device_identity", lambda device: DeviceIdentity("NVIDIA H200", "sm_90", 132))
    config = KernelConfig(block_s=16, block_h=16, block_q=1, num_warps=1, programs_per_sm=32)
    cuda = torch.device("cuda")
    assert stripe_rounds.round_queries(1, 16, 32768, config, cuda) == 4224
    assert stripe_rounds.round_queries(2, 16, 32768, config, cuda) == 2112
    assert stripe_rounds.round_queries(1, 16, 1000, config, cuda) == 1000
    assert stripe_rounds.round_queries(1, 16, 1000, config.replace(block_h=4, block_q=4), cuda) == 1000
    assert stripe_rounds.round_queries(1, 16, 1000, config.replace(programs_per_sm=8), cuda) == 1000
    assert stripe_rounds.round_queries(1, 16, 32768, config.replace(programs_per_sm=8), cuda) == 1056


@pytest.mark.parametrize(("change", "message"), [
    (dict(programs_per_sm=None), "programs_per_sm"),
    (dict(programs_per_sm=12), "power of two"),
    (dict(block_h=1), "tensor-core dots"),
])
def test_bad_configurations_are_refused_by_name(change: dict, message: str, gen: torch.Generator) -> None:
    case = CASES[0]
    x = make_inputs(case, gen)
    config = dict(ROUNDS.default(problem_of(case, x)))
    config.update(change)
    config = KernelConfig({name: value for name, value in config.items() if value is not None})
    with pytest.raises(ValueError, match=message):
        launch_search(ROUNDS, case, x, config)
