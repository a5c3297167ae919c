"""The layer's Triton searches across group sizes, head dims and long stripe lists, against the float64
oracle's anchor sets (the exact inputs, properties and checks of ``test_layer``).

- every rep in {1, 2, 4, 16} with every D in {64, 96, 128, 256}, both power paths, B 2 with left
  padding or a static cache with a hole, ties at the top-k boundary;
- a chunk whose queries have more stripes than one tile holds, so that the top-k merges across
  tiles (ties across tiles included) and across the stripe-tile kernel's ``while`` rounds;
- a chunk in the middle of a static cache whose unwritten tail holds NaN or +inf;
- fewer valid stripes than topk under a mask with left padding and holes (B 2), both power paths, several
  topk and tilings.
"""

from __future__ import annotations

import dataclasses

import oracle
import pytest
import torch
from helpers import TRITON_SEARCHES, SearchSpies
from layer_cases import (
    CASES,
    FLOAT55,
    INT2,
    TILES,
    LayerCase,
    check_anchors,
    check_properties,
    check_tilings,
    launch_search,
    make_inputs,
    problem_of,
)

from superlinear_ops.registry import REGISTRY

MASKS = ("left-pad", "static", "none", "left-pad")  # by rep index
EXPECT = {"left-pad": ("tie", "padding"), "static": ("tie", "mid", "static", "masked-stripe"), "none": ("tie", "mid")}
SHAPE_CASES = [
    LayerCase(f"rep{rep}-d{dim}", EXPECT[MASKS[i]],
              batch=2 if MASKS[i] == "left-pad" else 1, hq=rep * (2 if rep == 1 else 1), hkv=2 if rep == 1 else 1,
              lq=10, lkv=80 if MASKS[i] == "static" else 64, start=44 if MASKS[i] == "static" else 54, dim=dim,
              power=FLOAT55 if (i + j) % 2 else INT2, sw_index=2, topk=3, bf=3.0, ff=1.0, mask=MASKS[i], ties=True)
    for i, rep in enumerate((1, 2, 4, 16)) for j, dim in enumerate((64, 96, 128, 256))
]


def run_search(name: str, case: LayerCase, x, traces, config=None) -> None:
    variant = REGISTRY.get("attention_layer", name)
    check_anchors(launch_search(variant, case, x, config), traces, case, f"{name} {case.name}")


@pytest.mark.parametrize("case", SHAPE_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("name", sorted(TRITON_SEARCHES))
def test_group_sizes_and_head_dims(name: str, case: LayerCase, gen: torch.Generator, search_spy: SearchSpies) -> None:
    """Default tiles of each Triton search at every (rep, D): the oracle's anchor sets."""
    x = make_inputs(case, gen)
    _, traces = oracle.attention_layer(x.q1, x.q2, x.k, x.v, x.cache_position, x.mask, case.params)
    check_properties(case, x, traces)
    run_search(name, case, x, traces)
    assert search_spy[name].launches == 1


# 600 keys on the integer path: up to 24 stripes per query, so tiles of 16 stripes merge across tiles.
LONG = LayerCase("many-stripes", ("tie", "mid"), hq=4, hkv=2, lq=8, lkv=600, start=592, sw_index=1, topk=3, ties=True)
LONG_TILES = {
    "stripe_tiles": [dict(block_s=16, block_h=2, block_q=8), dict(block_s=16, block_h=1, block_q=16)],
    "tiled_search": [dict(block_q=16, block_h=2)],
}


@pytest.mark.parametrize("topk", [1, 3, 5])
@pytest.mark.parametrize("name", sorted(TRITON_SEARCHES))
def test_top_k_merges_across_stripe_tiles(name: str, topk: int, gen: torch.Generator, search_spy: SearchSpies) -> None:
    """Queries with more stripes than a tile holds (ties across tiles): the oracle's anchor sets."""
    case = dataclasses.replace(LONG, topk=topk)
    x = make_inputs(case, gen)
    _, traces = oracle.attention_layer(x.q1, x.q2, x.k, x.v, x.cache_position, x.mask, case.params)
    check_properties(case, x, traces)
    assert min(len(tr.candidates) for tr in traces.values()) > 16, "every query must have more stripes than a tile"
    variant = REGISTRY.get("attention_layer", name)
    default = variant.default(problem_of(case, x))
    for tiles in LONG_TILES[name]:
        config = default.replace(**tiles)
        assert variant.contains(config) and variant.compile_check(problem_of(case, x), config) is None, config.text()
        run_search(name, case, x, traces, config)
    assert search_spy[name].launches == len(LONG_TILES[name])


STATIC_CASES = [case for case in CASES if "static" in case.expect]  # a chunk in the middle of a static cache


@pytest.mark.parametrize("poison", ["nan", "inf"])
@pytest.mark.parametrize("case", STATIC_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("name", sorted(TRITON_SEARCHES))
def test_an_unwritten_cache_tail_never_reaches_the_anchors(name: str, case: LayerCase, poison: str,
                                                           gen: torch.Generator, search_spy: SearchSpies) -> None:
    """Keys past the chunk's last position were never written (NaN or +inf there, with and without a mask):
    each Triton search gives the oracle's anchor sets and scores of the clean inputs."""
    x = make_inputs(case, gen)
    _, traces = oracle.attention_layer(x.q1, x.q2, x.k, x.v, x.cache_position, x.mask, case.params)
    check_properties(case, x, traces)
    tail = int(x.cache_position.max()) + 1
    x.k[:, :, tail:] = float(poison)
    run_search(name, case, x, traces)
    assert search_spy[name].launches == 1


FEWER_CASES = [
    LayerCase(f"fewer-{'int' if power.inv_int else 'float'}-topk{topk}-rep{hq // hkv}",
              ("fewer", "holes", "masked-stripe", "mid"), batch=2,
              hq=hq, hkv=hkv, lq=12, lkv=64, start=30, sw_index=2, power=power, topk=topk, bf=3.0, ff=1.0,
              mask="padded-holes", ties=True)
    for power, topk, (hq, hkv) in ((INT2, 3, (4, 2)), (INT2, 5, (16, 1)), (FLOAT55, 4, (2, 2)), (FLOAT55, 6, (8, 2)))
]


@pytest.mark.parametrize("case", FEWER_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("name", sorted(TRITON_SEARCHES))
def test_fewer_valid_stripes_than_topk_under_padding_and_holes(name: str, case: LayerCase, gen: torch.Generator,
                                                               search_spy: SearchSpies) -> None:
    """B 2 rows padded differently with holes under stripes, so many queries have fewer allowed stripes
    than topk: each tiling of each Triton search gives the oracle's anchor sets with -1 in the empty slots."""
    x = make_inputs(case, gen)
    _, traces = oracle.attention_layer(x.q1, x.q2, x.k, x.v, x.cache_position, x.mask, case.params)
    check_properties(case, x, traces)
    tried = check_tilings(name, case, x, traces, [{}, *TILES[name]])  # {}: the default tiles
    assert search_spy[name].launches == tried >= 2
