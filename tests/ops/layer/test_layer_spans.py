"""The layer's spans from its anchors (semantics section 4, step 2): the one-launch Triton kernel
(``ops.layer.spans_kernel``) against an element-by-element oracle (exact decimal span lengths, the
first allowed key found by a scan) and against the tensor ops it replaces, bit for bit.

Anchors cover every clamp of the rule: -1 (empty slot), anchors just after the first allowed key
(the start clamps there), just before the window (the end clamps at pos - W) and far back; the
chunk sits in the middle of a static cache (keys past the last position), one position lies past
the keys and one is -1 (both clamp). Outputs start poisoned, so an unwritten entry shows.
"""

from __future__ import annotations

import oracle
import pytest
import torch
from helpers import poisoned_allocations

from superlinear_ops import geometry
from superlinear_ops.ops.layer.spans import spans_of_anchors
from superlinear_ops.ops.layer.spans_kernel import BLOCK, spans_by_kernel
from superlinear_ops.settings import SpanSettings

POISON = 1 << 40  # what an unwritten entry holds
POWERS = {"int2": {"search_power": None, "inv_search_power_int": 2}, "float0.55": {"search_power": 0.55, "inv_search_power_int": None}}


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal integers everywhere, or an AssertionError naming the first entry that differs."""
    differ = (got != want).nonzero()
    if len(differ):
        at = tuple(differ[0].tolist())
        raise AssertionError(f"{what}: {len(differ)} entries differ, first at {at}: got {got[at]}, want {want[at]}")


def oracle_spans(anchors, cache_position, key_length, mask, bf, ff, span_power, window):
    """(qstart, qend) by the rule, one entry at a time (shares no code with the library), and where
    each clamp bound: (start clamped at the first allowed key, end clamped before the window)."""
    qstart, qend = torch.full_like(anchors, -7), torch.full_like(anchors, -7)
    start_bound, end_bound = torch.zeros_like(anchors, dtype=torch.bool), torch.zeros_like(anchors, dtype=torch.bool)
    batch, heads, lq, slots = anchors.shape
    for b in range(batch):
        first = next((x for x in range(key_length) if mask is None or mask[b, x]), 0)
        for q in range(lq):
            pos = min(max(int(cache_position[q]), 0), key_length - 1)
            distance = min(max(pos + 1 - first, 0), key_length)
            back = min(oracle.ceil_scaled(bf, distance, span_power), key_length)
            reach = min(oracle.ceil_scaled(ff, distance, span_power), key_length)
            for h in range(heads):
                for j in range(slots):
                    a = int(anchors[b, h, q, j])
                    if a < 0:
                        qstart[b, h, q, j] = qend[b, h, q, j] = -1
                        continue
                    qstart[b, h, q, j] = max(a - back, first)
                    start_bound[b, h, q, j] = a - back < first
                    end = a if ff == 0 else min(a + reach, pos - window if window > 0 else pos)
                    qend[b, h, q, j] = end
                    end_bound[b, h, q, j] = ff != 0 and a + reach > end
    return qstart, qend, start_bound, end_bound


def make_anchors(gen, batch, heads, lq, slots, cache_position, key_length, first, window):
    """Anchors of every kind the rule clamps (see the module docstring), -1 in some slots."""
    anchors = torch.full((batch, heads, lq, slots), -1, dtype=torch.int64)
    for b in range(batch):
        for q in range(lq):
            pos = min(max(int(cache_position[q]), 0), key_length - 1)
            last = pos - window  # the last key a stripe can hold
            if last < first[b]:
                continue
            kinds = (first[b], min(first[b] + 1, last), last, max(last - 1, first[b]))
            for h in range(heads):
                for j in range(slots):
                    pick = int(torch.randint(0, 6, (), generator=gen))
                    if pick < 4:
                        anchors[b, h, q, j] = kinds[pick]
                    elif pick == 4:
                        anchors[b, h, q, j] = int(torch.randint(first[b], last + 1, (), generator=gen))
    return anchors


@pytest.mark.parametrize("mask_kind", ["none", "left padding", "holes"])
@pytest.mark.parametrize("ff", [0.0, 1.0])
@pytest.mark.parametrize("power", list(POWERS.values()), ids=list(POWERS))
@pytest.mark.parametrize("sw_index", [0, 4], ids=["W0", "sw4"])
def test_kernel_spans_equal_the_oracle_and_the_tensor_ops(mask_kind, ff, power, sw_index, gen: torch.Generator):
    batch, heads, lq, slots, key_length, bf, span_power = 2, 3, 23, 3, 400, 3.0, 0.55
    settings = SpanSettings(sw_index, slots, bf, ff, span_power, geometry.power_params(**power))
    window = settings.window_for(key_length)
    assert (window == 0) == (sw_index == 0)
    cache_position = torch.arange(300, 300 + lq)  # mid static cache: keys past the last position
    cache_position[5], cache_position[9] = key_length + 7, -1  # clamp to the last key / to 0
    mask = None
    first = [0] * batch
    if mask_kind != "none":
        mask = torch.ones(batch, key_length, dtype=torch.bool)
        mask[1, :37] = False  # row 1 left-padded: spans start at 37 at the earliest
        first[1] = 37
        if mask_kind == "holes":
            mask[0, 50:90] = False  # holes change no span bound (only the first allowed key does)
            mask[1, 200:240] = False
    anchors = make_anchors(gen, batch, heads, lq, slots, cache_position, key_length, first, window)
    assert anchors.numel() > BLOCK // 8 and (anchors < 0).any() and (anchors >= 0).sum() > anchors.numel() // 2
    with poisoned_allocations(integer=POISON):
        qstart, qend = spans_by_kernel(anchors, cache_position, key_length, mask, settings)
    assert qstart.dtype == qend.dtype == torch.int32, "the span kernels' index type"
    want_start, want_end, start_bound, end_bound = oracle_spans(anchors, cache_position, key_length, mask, bf, ff,
                                                                span_power, window)
    assert_same(qstart, want_start, "qstart")
    assert_same(qend, want_end, "qend")
    used = anchors >= 0
    assert (start_bound & used).any() and (~start_bound & used).any(), "both sides of the start clamp"
    if mask_kind != "none":
        assert start_bound[1].any(), "the left-padded row's starts clamp at its first allowed key"
    if ff:
        assert (end_bound & used).any() and (~end_bound & used).any(), "both sides of the end clamp"
    ops_start, ops_end = spans_of_anchors(anchors, cache_position, key_length, mask, settings)
    assert_same(qstart, ops_start, "qstart (tensor ops)")
    assert_same(qend, ops_end, "qend (tensor ops)")


def test_more_entries_than_one_program(gen: torch.Generator):
    """Several programs (and a ragged last one): every entry written, int32 anchors and strided
    int32 positions (every other entry of a wider tensor) read."""
    settings = SpanSettings(2, 4, 2.0, 1.0, 0.5, geometry.power_params(search_power=None, inv_search_power_int=2))
    key_length, lq = 3000, 700
    cache_position = torch.arange(key_length - lq, key_length, dtype=torch.int32).repeat_interleave(2)[::2]
    assert cache_position.stride(0) == 2
    window = settings.window_for(key_length)
    anchors = make_anchors(gen, 1, 2, lq, 4, cache_position, key_length, [0], window).to(torch.int32)
    assert anchors.numel() > 5 * BLOCK and anchors.numel() % BLOCK
    with poisoned_allocations(integer=POISON):
        qstart, qend = spans_by_kernel(anchors, cache_position, key_length, None, settings)
    want = oracle_spans(anchors.long(), cache_position, key_length, None, 2.0, 1.0, 0.5, window)[:2]
    assert_same(qstart, want[0], "qstart")
    assert_same(qend, want[1], "qend")


def test_shapes_the_kernel_cannot_broadcast_raise(gen: torch.Generator):
    """A position per query and a mask row per batch row: anything else raises ValueError naming the
    argument (the tensor ops would broadcast; the kernel would read past them)."""
    settings = SpanSettings(4, 3, 3.0, 1.0, 0.55, geometry.power_params(search_power=None, inv_search_power_int=2))
    anchors = torch.full((2, 2, 5, 3), 10, dtype=torch.int64)
    positions = torch.arange(300, 305)
    mask = torch.ones(2, 400, dtype=torch.bool)
    with pytest.raises(ValueError, match="cache_position"):
        spans_by_kernel(anchors, positions[:1], 400, mask, settings)
    for wrong in (mask[:1], mask[:, :399], mask[0]):
        with pytest.raises(ValueError, match="attention_mask"):
            spans_by_kernel(anchors, positions, 400, wrong, settings)
