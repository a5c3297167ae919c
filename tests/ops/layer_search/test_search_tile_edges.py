"""The layer's Triton searches at stripe counts just below, at and just above one and two tiles of
stripes (w - 1, w, w + 1, 2w - 1, 2w, 2w + 1 for a tile of w stripes): both searches, both power
paths, every tiling that passes the compile check, against the float64 oracle's anchor sets.

Each query's last (farthest) stripe lands on a key that outscores every other key for it, so an
off-by-one that drops the last stripe of a range, or a tile's last stripe, changes its anchors. One
query per count sits at its first or last position, the last one at the last key (its count is the
whole stripe table).
"""

from __future__ import annotations

import dataclasses
import itertools

import oracle
import pytest
import torch
from helpers import TRITON_SEARCHES, SearchSpies
from layer_cases import FLOAT55, INT2, LayerCase, check_anchors, launch_search, make_inputs, problem_of

from superlinear_ops.registry import REGISTRY

WIDTHS = {"stripe_tiles": (16, 32, 64, 128), "tiled_search": (16,)}  # tiled_search walks one stripe per step
HEADS = {"stripe_tiles": 16, "tiled_search": 8}  # one KV group (tiled_search's block_h 16 costs minutes here)
BEST = 4.0  # every entry of a last stripe's key; other keys' entries lie in [-2, 2] and Q1's are positive


def counts_around(width: int) -> list[int]:
    return [c for m in (width, 2 * width) for c in (m - 1, m, m + 1)]


def edge_case(power: oracle.Power, width: int, heads: int, gen: torch.Generator):
    """(case, inputs, the stripe count each query must have): one query per count around one and two
    tiles of ``width`` stripes, at the count's first t and last t by turns; the keys end at the last t
    of the largest count."""
    sw_index = 1
    counts = counts_around(width)
    offsets = [oracle.floor_power(i, power) for i in range(sw_index + 1, sw_index + max(counts) + 2)]
    lkv = offsets[max(counts)] - 1  # t = Lkv is the last with max(counts) stripes
    ts = [offsets[c] - 1 if n % 2 else offsets[c - 1] for n, c in enumerate(counts)]
    case = LayerCase(f"{power.inv_int or 'float'}-w{width}", (), hq=heads, hkv=1, lq=len(ts), lkv=lkv, start=0,
                     sw_index=sw_index, power=power, topk=3, bf=2.0, ff=1.0)
    x = make_inputs(case, gen)
    q1 = ((torch.rand(x.q1.shape, generator=gen) * 8).round() + 1) / 8  # positive
    k = ((torch.rand(x.k.shape, generator=gen) * 16 - 8).round()) / 4
    for t, count in zip(ts, counts):
        k[:, :, t - offsets[count - 1]] = BEST  # the query's last stripe outscores its others
    return case, dataclasses.replace(x, q1=q1, k=k, cache_position=torch.tensor(ts) - 1), counts


def tilings(name: str, case: LayerCase, x, width: int) -> list:
    """Every configuration of the search's space (num_warps and num_stages at their defaults: the
    interpreter runs them alike) with this stripe width that passes the compile check."""
    variant = REGISTRY.get("attention_layer", name)
    problem = problem_of(case, x)
    default = variant.default(problem)
    space = {p.name: p.values for p in variant.space}
    fixed = {"block_s": width} if name == "stripe_tiles" else {}
    configs = [default.replace(**fixed, block_h=h, block_q=q) for h, q in itertools.product(space["block_h"], space["block_q"])]
    return [c for c in configs if variant.compile_check(problem, c) is None]


@pytest.mark.parametrize("power", [INT2, FLOAT55], ids=["int2", "float055"])
@pytest.mark.parametrize(("name", "width"), [(n, w) for n in sorted(TRITON_SEARCHES) for w in WIDTHS[n]])
def test_stripe_counts_around_tile_multiples(name: str, width: int, power: oracle.Power, gen: torch.Generator,
                                             search_spy: SearchSpies) -> None:
    case, x, counts = edge_case(power, width, HEADS[name], gen)
    _, traces = oracle.attention_layer(x.q1, x.q2, x.k, x.v, x.cache_position, x.mask, case.params)
    for (_, h, q), tr in traces.items():  # the counts are real, and the last stripe is an anchor
        assert len(tr.candidates) == counts[q] and tr.candidates[0][1] == case.sw_index + counts[q], (h, q, tr.t)
    configs = tilings(name, case, x, width)
    assert len(configs) >= (3 if name == "tiled_search" else 8), [c.text() for c in configs]
    variant = REGISTRY.get("attention_layer", name)
    for config in configs:
        check_anchors(launch_search(variant, case, x, config), traces, case, f"{name} {config.text()}")
    assert search_spy[name].launches == len(configs)
