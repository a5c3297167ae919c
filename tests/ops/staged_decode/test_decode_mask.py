"""Masked staged decode over a full context, every variant against the independent oracle: the
masks model code passes (all ones, holes, left padding; B = 2 with a different mask per row), in
the dtypes it passes them in, and NaN in the keys and values the mask hides."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from cases import DecodeCase, make_decode_inputs
from helpers import DecodeInputs, assert_close, launch_variant

from superlinear_ops.registry import REGISTRY

VARIANTS = REGISTRY.variants("staged_decode")
IDS = [v.name for v in VARIANTS]
# A full context (pos = Lkv - 1), W = 35, 12 stripes, spans of up to 52 + 18 keys, two KV groups.
CASE = DecodeCase("fp32", 2, mask="none", hkv=2, lkv=300, pos=299)
PADDING = (17, 120)  # left-padded keys of rows 0 and 1 (row 1's covers several stripes and spans)


def row_mask(kind: str, row: int, keys: int, gen: torch.Generator) -> torch.Tensor:
    """One row of a keep-mask: 'ones', 'holes' (20% of the keys before the last) or 'left_padding'."""
    allowed = torch.ones(keys, dtype=torch.bool)
    if kind == "holes":
        allowed[:-1] = torch.rand(keys - 1, generator=gen) >= 0.2
    elif kind == "left_padding":
        allowed[: PADDING[row]] = False
    return allowed


def masked(x: DecodeInputs, kinds: tuple[str, str], gen: torch.Generator, dtype: torch.dtype = torch.bool,
           extra_columns: int = 0) -> DecodeInputs:
    """``x`` with row b masked by ``kinds[b]`` in ``dtype`` (integer masks hold 0 and assorted nonzero
    values); ``extra_columns`` masked columns past Lkv (a mask may be longer than the keys)."""
    keys = x.k.shape[2]
    rows = torch.stack([row_mask(kind, b, keys, gen) for b, kind in enumerate(kinds)])
    rows = torch.nn.functional.pad(rows, (0, extra_columns))
    if dtype == torch.bool:
        return replace(x, mask=rows)
    nonzero = torch.randint(1, 3, rows.shape, generator=gen) << (32 if dtype == torch.int64 else 8 if dtype == torch.int32 else 0)
    return replace(x, mask=torch.where(rows, nonzero, 0).to(dtype))


def check(variant, x: DecodeInputs, what: str) -> torch.Tensor:
    got, _ = launch_variant(variant, x)
    assert_close(got, x.oracle()[0], torch.float32, x.k.shape[2], f"{variant.name}, {what}")
    return got


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
@pytest.mark.parametrize("kinds", [("ones", "ones"), ("holes", "holes"), ("left_padding", "left_padding"),
                                   ("holes", "left_padding")], ids=lambda k: "-".join(k))
def test_masked_full_context_matches_oracle(variant, kinds, gen: torch.Generator) -> None:
    x = masked(make_decode_inputs(CASE, gen), kinds, gen)
    got = check(variant, x, "/".join(kinds))
    unmasked, _ = launch_variant(variant, replace(x, mask=None))
    if kinds == ("ones", "ones") and variant.name == "stripe_spans":
        # Its masked window comes through TMA in block_k-key blocks, the unmasked one by pointer loads in
        # 64-key blocks (faster each way on the H200): the same keys, summed in another order.
        torch.testing.assert_close(got, unmasked, rtol=1e-6, atol=1e-6, msg="a mask of ones changed the result")
    elif kinds == ("ones", "ones"):
        assert torch.equal(got, unmasked), "a mask of ones must give exactly the unmasked result"
    else:
        for b, kind in enumerate(kinds):  # each row's own mask shows in that row
            assert (got[b] - unmasked[b]).abs().max() > 1e-3, f"row {b}: the {kind} mask changed nothing"


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8], ids=str)
def test_integer_masks_mean_nonzero_and_may_be_longer_than_the_keys(variant, dtype, gen: torch.Generator) -> None:
    """Integer keep-masks with values such as 2**32 (int64: nonzero in the high word alone) or 256, and
    masked columns past Lkv, give the bool mask's result."""
    x = make_decode_inputs(CASE, gen)
    as_bool = masked(x, ("holes", "left_padding"), torch.Generator().manual_seed(1))
    as_int = masked(x, ("holes", "left_padding"), torch.Generator().manual_seed(1), dtype, extra_columns=9)
    assert torch.equal(as_int.mask[:, : x.k.shape[2]] != 0, as_bool.mask)
    got = check(variant, as_int, f"{dtype} mask")
    assert_close(got, launch_variant(variant, as_bool)[0].double(), torch.float32, x.k.shape[2], "bool vs integer")


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_masked_keys_and_values_never_show(variant, poison: float, gen: torch.Generator) -> None:
    """Keys and values the mask hides (padding, holes inside spans and the window) hold NaN or +-inf
    (a zero weight times either is NaN: the span passes that take hidden values as loaded must find
    that and attend again with them zeroed)."""
    x = masked(make_decode_inputs(CASE, gen), ("holes", "left_padding"), gen)
    hidden = ~x.mask[:, None, :, None].expand_as(x.k)
    poisoned = replace(x, k=x.k.masked_fill(hidden, poison), v=x.v.masked_fill(hidden, poison))
    check(variant, poisoned, f"{poison} behind the mask")


@pytest.mark.parametrize("name", ["grouped", "stripe_spans"])
@pytest.mark.parametrize("block_k", [16, 64])
def test_masked_window_ignores_nan_past_the_position(name: str, block_k: int, gen: torch.Generator) -> None:
    """A static cache under a mask: the window's last blocks come through TMA whole (stripe_spans),
    and with 16- or 64-key blocks they reach keys past the position that the cache has not written
    (NaN here, allowed by a mask of ones, hidden too by holes): those keys must not reach the output."""
    case = DecodeCase("fp32", 2, mask="none", hkv=2, lkv=300, pos=250)
    x = masked(make_decode_inputs(case, gen), ("ones", "holes"), gen)
    x.k[:, :, case.pos + 1:] = float("nan")
    x.v[:, :, case.pos + 1:] = float("nan")
    got, config = launch_variant(REGISTRY.get("staged_decode", name), x, changes={"block_k": block_k})
    assert config.block_k == block_k
    assert_close(got, x.oracle()[0], torch.float32, case.lkv, f"{name}, NaN past the position")


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_a_mask_that_hides_key_0_alone_shortens_the_forward_reach(variant, gen: torch.Generator) -> None:
    """Row 0's mask hides key 0 only, so its first allowed key is 1: at t = 290 the forward reach is
    ceil((t - 1) ** 0.5) = 17 keys, one less than the 18 of a row whose mask allows key 0 (row 1). A
    kernel that takes the reach from key 0 whenever the first allowed key is small attends one key
    more per span in row 0."""
    case = DecodeCase("fp32", 2, mask="none", hkv=2, lkv=300, pos=289)
    x = make_decode_inputs(case, gen)
    mask = torch.ones(2, case.lkv, dtype=torch.bool)
    mask[0, 0] = False
    x = replace(x, mask=mask)
    expected, traces = x.oracle()
    reach = {b: {end - anchor for (rb, _), tr in traces.items() if rb == b for _, anchor, _, end in tr.chosen
                 if end < case.pos - case.params.window} for b in (0, 1)}
    assert reach == {0: {17}, 1: {18}}, f"the spans' forward reach is not what this test needs: {reach}"
    got, _ = launch_variant(variant, x)
    assert_close(got, expected, torch.float32, case.lkv, f"{variant.name}, key 0 hidden")


@pytest.mark.parametrize("name", ["grouped", "stripe_spans"])
@pytest.mark.parametrize("kinds", [None, ("holes", "left_padding")], ids=["no-mask", "holes-left_padding"])
def test_grouped_pointer_loads_where_tma_is_not_allowed(name: str, kinds, gen: torch.Generator) -> None:
    """K and V whose batch rows are one row expanded (stride 0) are no evenly spaced run of rows: no
    TMA descriptors, so every span block takes the pointer loads (masked keys read as zeros)."""
    from superlinear_ops.ops.span_attention.window_forward import row_descriptors

    x = make_decode_inputs(CASE, gen)
    x = replace(x, k=x.k[:1].expand_as(x.k), v=x.v[:1].expand_as(x.v))
    if kinds is not None:
        x = masked(x, kinds, gen)
    assert row_descriptors(x.k, x.v, 64) is None
    check(REGISTRY.get("staged_decode", name), x, f"expanded K/V, mask {kinds}")


@pytest.mark.parametrize("name", ["grouped", "stripe_spans"])
def test_grouped_first_allowed_key_is_read_only_before_the_window(name: str, gen: torch.Generator, monkeypatch) -> None:
    """Left padding across many 16-entry mask slices: row 1's first allowed key lies in its eighth
    slice, past the 16-entry mask head every program reads first (so the slice programs scan), and
    row 0 allows nothing before the window (no stripe, window only)."""
    from superlinear_ops.ops.staged_decode import group_stage

    monkeypatch.setattr(group_stage, "MASK_SLICE", 16)
    monkeypatch.setattr(group_stage, "MASK_HEAD", 16)
    x = masked(make_decode_inputs(CASE, gen), ("ones", "left_padding"), gen)
    window_start = CASE.pos + 1 - CASE.params.window
    x.mask[0, :window_start] = False
    expected, traces = x.oracle()
    assert not any(tr.chosen for (b, _), tr in traces.items() if b == 0)
    assert all(tr.chosen for (b, _), tr in traces.items() if b == 1)
    got, _ = launch_variant(REGISTRY.get("staged_decode", name), x)
    assert_close(got, expected, torch.float32, CASE.lkv, f"{name}, slices")


def test_bool_masks_reach_the_grouped_kernels_without_a_copy() -> None:
    from superlinear_ops.ops.staged_decode.group_stage import mask_operand

    mask = torch.ones(2, 64, dtype=torch.bool)
    assert mask_operand(mask).dtype == torch.uint8 and mask_operand(mask).data_ptr() == mask.data_ptr()
    wide = torch.ones(2, 64, dtype=torch.int64)
    assert mask_operand(wide) is wide  # read in its own dtype: no conversion pass
    strided = torch.ones(2, 128, dtype=torch.bool)[:, ::2]
    assert mask_operand(strided).stride(1) == 1
