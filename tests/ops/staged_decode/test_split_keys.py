"""The decodes with the keys split over programs (one_launch: merged by the last program;
split_merge: by a merge launch per head) against the oracle where their own arithmetic decides:
spans and windows cut at the splits of the key positions and merged, and a row's first allowed
key found past the first mask entries it reads."""

from __future__ import annotations

import oracle
import pytest
import torch
from cases import FLOAT55, DecodeCase, make_decode_inputs
from helpers import assert_close, launch_variant

from superlinear_ops.registry import REGISTRY

SPLIT_KEYS = [REGISTRY.get("staged_decode", name) for name in ("one_launch", "split_merge")]


@pytest.mark.parametrize("variant", SPLIT_KEYS, ids=[v.name for v in SPLIT_KEYS])
@pytest.mark.parametrize("mask", ["none", "holes"])
@pytest.mark.parametrize("chunk", [128, 100, 4096])
def test_splits_cut_spans_and_windows(variant, chunk: int, mask: str, gen: torch.Generator) -> None:
    """Spans of about 260 keys over 2,048 key positions: in splits of 128 (or 100, which no block
    width divides) they and the window run across several programs' splits, whose partials are
    merged; in one split of 4,096 a single program holds every row whole."""
    case = DecodeCase("fp32", 2, mask, hkv=2, lkv=2048, pos=1927, power=FLOAT55, sw_index=6)  # window 1895..1927
    x = make_decode_inputs(case, gen)
    expected, traces = x.oracle()
    spans = [(start, end) for trace in traces.values() for _, _, start, end in trace.chosen]
    window_start = case.pos - x.params.window + 1
    if chunk < case.lkv:
        assert any(start // chunk != end // chunk for start, end in spans), "no span crosses a split"
        assert window_start // chunk != case.pos // chunk, "the window lies in one split"
    got, config = launch_variant(variant, x, changes={"chunk": chunk})
    assert config.chunk == chunk
    assert_close(got, expected, torch.float32, case.lkv, f"{variant.name}, splits of {chunk} keys")


@pytest.mark.parametrize("variant", SPLIT_KEYS, ids=[v.name for v in SPLIT_KEYS])
@pytest.mark.parametrize("first", [40, 700])
def test_first_allowed_key_past_the_first_mask_entries(variant, first: int, gen: torch.Generator) -> None:
    """The forward span length counts from the row's first allowed key, which each program finds by
    reading the mask 256 entries at a time: in the first 256 or past them (row 1 starts 30 keys
    later than row 0, so the rows' lengths differ)."""
    case = DecodeCase("fp32", 2, "holes", hkv=2, lkv=1200, pos=1100, power=FLOAT55, sw_index=6)
    x = make_decode_inputs(case, gen)
    x.mask[:, :first] = False
    x.mask[0, first] = True
    x.mask[1, first: first + 30] = False
    expected, traces = x.oracle()
    assert all(trace.chosen for trace in traces.values()), "a head without a span"
    got, _ = launch_variant(variant, x, changes={"chunk": 256})
    assert_close(got, expected, torch.float32, case.lkv, f"{variant.name}, first allowed key {first}")


@pytest.mark.parametrize("variant", SPLIT_KEYS, ids=[v.name for v in SPLIT_KEYS])
def test_the_best_stripe_of_an_earlier_block_stays_chosen(variant, gen: torch.Generator) -> None:
    """Each head keeps its running top-3 over 64-stripe blocks: the best stripe lies in the first
    block, the next two in the second, so dropping the first block's kept ones when the second
    comes changes the anchors."""
    case = DecodeCase("fp32", 2, "none", hkv=2, lkv=6000, pos=5990)
    x = make_decode_inputs(case, gen)
    t, window_start = case.pos + 1, case.pos - x.params.window + 1
    locs = [t - o for o in oracle.stripe_offsets(case.lkv, case.sw_index, case.power) if 0 <= t - o < window_start]
    assert len(locs) >= 70
    direction = torch.randn(case.dim, generator=gen).abs()
    x.q1.copy_(direction.expand_as(x.q1))
    for loc, scale in ((locs[1], 3.0), (locs[66], 2.0), (locs[68], 2.5)):
        x.k[:, :, loc] = scale * direction
    expected, traces = x.oracle()
    assert all({a for _, a, _, _ in trace.chosen} == {locs[1], locs[66], locs[68]} for trace in traces.values())
    got, _ = launch_variant(variant, x)
    assert_close(got, expected, torch.float32, case.lkv, f"{variant.name}, the best stripe in the first block")
