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

ONE_LAUNCH, SPLIT_MERGE = (REGISTRY.get("staged_decode", name) for name in ("one_launch", "split_merge"))
# Both variants share the search and rows (``_split_rows``): the mask is exercised through one_launch.
SPLITS = [(ONE_LAUNCH, mask, chunk) for mask in ("none", "holes") for chunk in (128, 100, 4096)] + [
    (SPLIT_MERGE, "none", chunk) for chunk in (128, 100, 4096)]


@pytest.mark.parametrize(("variant", "mask", "chunk"), SPLITS, ids=[f"{v.name}-{m}-{c}" for v, m, c in SPLITS])
def test_splits_cut_spans_and_windows(variant, mask: str, chunk: int, gen: torch.Generator) -> None:
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


@pytest.mark.parametrize("first", [40, 700])
def test_first_allowed_key_past_the_first_mask_entries(first: int, gen: torch.Generator) -> None:
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
    got, _ = launch_variant(ONE_LAUNCH, x, changes={"chunk": 256})
    assert_close(got, expected, torch.float32, case.lkv, f"one_launch, first allowed key {first}")


def test_the_best_stripe_of_an_earlier_block_stays_chosen(gen: torch.Generator) -> None:
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
    got, _ = launch_variant(ONE_LAUNCH, x)
    assert_close(got, expected, torch.float32, case.lkv, "one_launch, the best stripe in the first block")


def test_split_merge_refuses_more_splits_than_its_merge_holds() -> None:
    """A merge program holds every split's partial of a slot at once: 4,096 keys in splits of 128
    (32) run, in 64 (64) run, in 32 (128) are refused with a reason naming ``chunk``; the default
    at 131,072 keys takes splits long enough."""
    from superlinear_ops.ops.staged_decode.variants import SPLIT_MERGE_SPLITS
    from superlinear_ops.problem import STAGED_DECODE, DeviceIdentity, Problem

    split_merge = SPLIT_MERGE
    h100 = DeviceIdentity("NVIDIA H100 80GB HBM3", "sm_90", 132)
    short = Problem(STAGED_DECODE, "bfloat16", 128, 32, 2, 3, 1, 4096, 4, False, 65, "float0.55", h100)
    config = split_merge.default(short)
    assert split_merge.compile_check(short, config.replace(chunk=4096 // SPLIT_MERGE_SPLITS)) is None
    reason = split_merge.compile_check(short, config.replace(chunk=4096 // SPLIT_MERGE_SPLITS // 2))
    assert reason is not None and reason.startswith(f"chunk: {2 * SPLIT_MERGE_SPLITS} splits")
    long = short._replace(keys=131072)
    assert split_merge.compile_check(long, split_merge.default(long)) is None
    assert -(-131072 // split_merge.default(long).chunk) <= SPLIT_MERGE_SPLITS
