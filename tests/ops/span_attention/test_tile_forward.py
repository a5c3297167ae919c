"""Tensor-core span forward (window once + sorted span tiles) under the interpreter vs float64."""

from __future__ import annotations

import pytest
import torch
from cases import DTYPES, SPAN_CASES, SpanCase, check_span_properties, make_span_inputs
from helpers import LaunchSpy, assert_close, poisoned_allocations
from tile_cases import TileCase, random_spans

from superlinear_ops.launch import LaunchGeometry
from superlinear_ops.ops.span_attention.reference import span_forward_reference
from superlinear_ops.ops.span_attention.span_tiles import clamped_span_bounds, span_tile_plan
from superlinear_ops.ops.span_attention.tile_forward import span_forward_tc
from superlinear_ops.ops.span_attention.variants import TC_FORWARD_DEFAULTS


def check_against_reference(case, out, lse, ref_out, ref_lse, dtype=None):
    """Outputs within the dtype's tolerance; lse finite exactly where the reference's is, and close."""
    dtype = dtype or case.dtype
    assert_close(out, ref_out, dtype, case.lkv, "out")
    nobody = torch.isinf(ref_lse)
    assert torch.equal(torch.isposinf(lse), nobody), "lse is +inf exactly where no key is attended"
    assert torch.equal(out[nobody], torch.zeros_like(out[nobody])), "zeros where no key is attended"
    assert_close(lse[~nobody], ref_lse[~nobody], torch.float32, case.lkv, "lse")


def spied_forward_kernels(monkeypatch) -> dict[str, LaunchSpy]:
    """The window and span-tile kernels replaced in their modules by spies, by kernel name."""
    from superlinear_ops.ops.span_attention import tile_forward as span_tc_forward
    from superlinear_ops.ops.span_attention import window_forward as window_attention

    spies = {"window_attention_kernel": LaunchSpy(window_attention.window_attention_kernel),
             "span_tile_kernel": LaunchSpy(span_tc_forward.span_tile_kernel)}
    monkeypatch.setattr(window_attention, "window_attention_kernel", spies["window_attention_kernel"])
    monkeypatch.setattr(span_tc_forward, "span_tile_kernel", spies["span_tile_kernel"])
    return spies


TINY = {  # 16-row tiles and 16-key blocks: every case crosses many tiles and key blocks
    "window_block_m": 16, "window_block_n": 16, "window_warps": 1, "window_stages": 1,
    "span_block_m": 16, "span_block_n": 16, "span_warps": 1, "span_stages": 1,
}


CASES = [
    # fp32, rep 2, float power path (W 17: windows over 2-3 key blocks), mask with holes, D 24, prefill chunk
    TileCase(torch.float32, 2, 4, 2, 21, 80, 24, 3, 4, 0.55, True, 40, True),
    # bf16, MHA, integer path (W 24), no mask, random positions (some past the last key), transposed Q
    TileCase(torch.bfloat16, 1, 2, 2, 12, 70, 32, 2, 4, None, False, 30, False, True),
    # fp16, rep 4, no window (sw_index 0), short spans (tiles that share few key blocks), D 40
    TileCase(torch.float16, 1, 4, 1, 9, 64, 40, 3, 0, None, True, 3, False),
    # fp32, rep 4, one span, integer path W 15, training-like positions 0.. (t <= W rows)
    TileCase(torch.float32, 1, 4, 1, 40, 40, 16, 1, 3, None, True, 25, True),
]


def make_inputs(case: TileCase, gen: torch.Generator):
    shape_q = (case.batch, case.lq, case.hq, case.dim) if case.transposed_q else (case.batch, case.hq, case.lq, case.dim)
    q = torch.randn(shape_q, generator=gen).to(case.dtype)
    q = q.transpose(1, 2) if case.transposed_q else q
    k = torch.randn(case.batch, case.hkv, case.lkv, case.dim, generator=gen).to(case.dtype)
    v = torch.randn(case.batch, case.hkv, case.lkv, case.dim, generator=gen).to(case.dtype)
    if case.consecutive:
        cache_position = torch.arange(case.lkv - case.lq, case.lkv)
    else:
        cache_position = torch.randint(0, case.lkv + 4, (case.lq,), generator=gen)
        cache_position[0] = min(3, case.lkv - 1)
    qstart, qend = random_spans(gen, case.batch, case.hq, cache_position, case.spans, case.lkv, case.window, case.max_span)
    mask = None
    if case.masked:
        mask = torch.rand(case.batch, case.lkv + 5, generator=gen) > 0.25
        mask[0, 5: case.lkv // 3] = False  # a long hole inside spans
        mask[-1, case.lkv - 12: case.lkv - 6] = False  # a hole inside the last windows
    return q, k, v, qstart, qend, cache_position, mask


def run_tc(case: TileCase, geo: LaunchGeometry, config=TINY):
    """The forward into NaN-poisoned buffers, so that any unwritten element shows."""
    n = geo.qstart.shape[-1]
    out = torch.full((case.batch, case.hq, case.lq, n, case.dim), float("nan"), dtype=case.dtype)
    lse = torch.full((case.batch, case.hq, case.lq, n), float("nan"))
    return span_forward_tc(geo, config, out=(out, lse))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.dtype}-rep{c.hq // c.hkv}-W{c.window}-D{c.dim}")
def test_matches_reference(case: TileCase, gen: torch.Generator):
    inputs = make_inputs(case, gen)
    geo = LaunchGeometry.prepare(*inputs, case.window)
    out, lse = run_tc(case, geo)
    ref_out, ref_lse = span_forward_reference(
        *(t.double() for t in inputs[:3]), *inputs[3:], case.window, return_lse=True
    )
    check_against_reference(case, out, lse, ref_out, ref_lse)


HEAD_DIM_CASES = [  # every group size with a head dim of model-sized tiles (96: padded to 128), both power paths
    TileCase(torch.float32, 2, 2, 2, 12, 70, 64, 3, 4, 0.55, True, 30, True),
    TileCase(torch.bfloat16, 1, 4, 2, 12, 70, 96, 3, 4, None, True, 30, False),
    TileCase(torch.float16, 2, 4, 1, 10, 64, 128, 2, 4, 0.55, False, 30, True),
    TileCase(torch.float32, 1, 16, 1, 6, 64, 256, 2, 4, None, True, 20, True),
]


@pytest.mark.parametrize("case", HEAD_DIM_CASES, ids=lambda c: f"{c.dtype}-rep{c.hq // c.hkv}-D{c.dim}")
def test_head_dims_and_group_sizes_in_the_middle_of_a_static_cache(case: TileCase, gen: torch.Generator):
    """rep 1 / 2 / 4 / 16 with D 64 / 96 / 128 / 256, B 1 and 2, with and without a mask with holes, in-order
    and random positions: the chunk ends 9 keys before the end of a static cache whose unwritten tail holds
    NaN, which no output may show."""
    q, k, v, _, _, cache_position, mask = make_inputs(case, gen)
    cache_position = (cache_position - 9).clamp(min=0)
    tail = int(cache_position.max()) + 1
    k[:, :, tail:], v[:, :, tail:] = float("nan"), float("nan")
    qstart, qend = random_spans(gen, case.batch, case.hq, cache_position, case.spans, case.lkv, case.window,
                                case.max_span)
    inputs = (q, k, v, qstart, qend, cache_position, mask)
    out, lse = run_tc(case, LaunchGeometry.prepare(*inputs, case.window))
    ref_out, ref_lse = span_forward_reference(*(t.double() for t in inputs[:3]), *inputs[3:], case.window,
                                              return_lse=True)
    check_against_reference(case, out, lse, ref_out, ref_lse)  # NaN never passes


def test_nan_rules(gen: torch.Generator):
    """NaN in unattended keys (static-cache tail, masked keys) stays out; NaN in Q or an attended key shows."""
    case = TileCase(torch.bfloat16, 2, 4, 2, 16, 96, 32, 2, 4, None, True, 20, True)
    q, k, v, qstart, qend, cache_position, mask = make_inputs(case, gen)
    cache_position = cache_position - 20  # keys 76.. are an unfilled cache tail
    qstart, qend = random_spans(gen, case.batch, case.hq, cache_position, case.spans, case.lkv, case.window, 20)
    k, v = k.clone(), v.clone()
    k[:, :, 76:] = float("nan")
    v[:, :, 76:] = float("inf")
    masked_out = (~mask[:, : case.lkv]).nonzero()
    k[masked_out[:, 0], :, masked_out[:, 1]] = float("nan")
    v[masked_out[:, 0], :, masked_out[:, 1]] = float("nan")
    q = q.clone()
    q[1, 3, 7] = float("nan")
    geo = LaunchGeometry.prepare(q, k, v, qstart, qend, cache_position, mask, case.window)
    out, lse = run_tc(case, geo)
    assert torch.isnan(out[1, 3, 7]).all() and torch.isnan(lse[1, 3, 7]).all()
    clean_q = q.clone()
    clean_q[1, 3, 7] = 0.0
    ref_out, ref_lse = span_forward_reference(
        clean_q.double(), k.double().nan_to_num(0, 0, 0), v.double().nan_to_num(0, 0, 0),
        qstart, qend, cache_position, mask, case.window, return_lse=True,
    )
    keep = torch.ones(out.shape[:3], dtype=torch.bool)
    keep[1, 3, 7] = False
    check_against_reference(case, out[keep], lse[keep], ref_out[keep], ref_lse[keep])
    # A NaN in a window key that every row of the last query attends reaches those rows.
    k[0, 0, int(cache_position[-1])] = float("nan")
    geo = LaunchGeometry.prepare(q, k, v, qstart, qend, cache_position, mask, case.window)
    if mask[0, int(cache_position[-1])]:
        assert torch.isnan(run_tc(case, geo)[0][0, 0, -1]).all()


def test_rows_with_no_key_give_zeros_and_inf(gen: torch.Generator):
    case = TileCase(torch.float32, 2, 2, 1, 10, 50, 16, 2, 3, None, True, 10, True)
    q, k, v, qstart, qend, cache_position, mask = make_inputs(case, gen)
    mask[1] = False  # batch row 1 attends nothing at all
    geo = LaunchGeometry.prepare(q, k, v, qstart, qend, cache_position, mask, case.window)
    out, lse = run_tc(case, geo)
    assert (out[1] == 0).all() and torch.isinf(lse[1]).all() and (lse[1] > 0).all()


def test_default_config_runs(gen: torch.Generator):
    """The sm_90 defaults (128-row tiles) on a shape smaller than one tile."""
    case = TileCase(torch.float32, 1, 2, 1, 5, 40, 16, 2, 2, None, False, 10, True)
    inputs = make_inputs(case, gen)
    geo = LaunchGeometry.prepare(*inputs, case.window)
    out, lse = run_tc(case, geo, TC_FORWARD_DEFAULTS)
    ref_out, ref_lse = span_forward_reference(*(t.double() for t in inputs[:3]), *inputs[3:], case.window, return_lse=True)
    check_against_reference(case, out, lse, ref_out, ref_lse)


@pytest.mark.parametrize(
    "change", [{"span_block_m": 8}, {"window_warps": 3}, {"span_stages": True}, {"window_block_n": None}]
)
def test_bad_config_raises(change, gen: torch.Generator):
    case = TileCase(torch.float32, 1, 2, 1, 4, 20, 16, 1, 2, None, False, 4, True)
    geo = LaunchGeometry.prepare(*make_inputs(case, gen), case.window)
    config = {**TINY, **change}
    if change.get("window_block_n", 0) is None:
        del config["window_block_n"]
    with pytest.raises(ValueError, match=next(iter(change))):
        span_forward_tc(geo, config)


@pytest.mark.parametrize("tma", [0, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_whole_key_blocks_through_descriptors(tma: int, dtype: torch.dtype, gen: torch.Generator, monkeypatch):
    """No mask, B 2, two KV groups, D 40 (descriptor blocks padded past D), W 63 over 16-row tiles
    and long spans, so both kernels have key blocks that every row of a tile attends: loaded through
    the TMA descriptors (``tma`` 1) or, with the descriptors withheld, by pointers; both equal the
    reference."""
    from superlinear_ops.ops.span_attention import tile_forward as span_tc_forward
    from superlinear_ops.ops.span_attention import window_forward as window_attention

    case = TileCase(dtype, 2, 4, 2, 40, 260, 40, 3, 7, None, False, 160, True)
    inputs = make_inputs(case, gen)
    geo = LaunchGeometry.prepare(*inputs, case.window)
    plan = span_tile_plan(geo, 16)
    lo, hi = plan.lo.view(plan.groups, -1, 16).max(dim=2).values, plan.hi.view(plan.groups, -1, 16).min(dim=2).values
    assert (hi - lo >= 32).any(), "some span tile has a whole 16-key block that all its rows attend"
    spies = spied_forward_kernels(monkeypatch)
    if not tma:
        for module in (window_attention, span_tc_forward):
            monkeypatch.setattr(module, "row_descriptors", lambda *_: None)
    out, lse = run_tc(case, geo)
    assert [spy.tma for spy in spies.values()] == [[bool(tma)], [bool(tma)]]
    assert spies["span_tile_kernel"].edge_tma == [bool(tma)], "W 63 >= 16-key blocks: the edge blocks through TMA too"
    ref_out, ref_lse = span_forward_reference(*(t.double() for t in inputs[:3]), *inputs[3:], case.window, return_lse=True)
    check_against_reference(case, out, lse, ref_out, ref_lse)


def test_plan_runs_beside_the_window_kernel(gen: torch.Generator, monkeypatch):
    """The stream order a GPU relies on: the side stream forks before the window kernel is queued,
    the span-tile plan is built inside it (after the window launch), and the join, given exactly
    the plan's tensors, comes before the span-tile kernel reads them. Off CUDA the side stream runs
    in place, so the result must still be the reference's."""
    from superlinear_ops.ops import side_stream
    from superlinear_ops.ops.span_attention import tile_forward as span_tc_forward
    from superlinear_ops.ops.span_attention import window_forward as window_attention

    log: list = []

    class RecordingSide(side_stream.SideStream):
        def __init__(self, device):
            log.append("fork")
            super().__init__(device)

        def __enter__(self):
            log.append("side")
            return super().__enter__()

        def __exit__(self, *exc):
            log.append("main")
            return super().__exit__(*exc)

        def join(self, *made):
            log.append(("join", made))
            super().join(*made)

    def recorded_plan(*args):
        tiles = span_tile_plan(*args)
        log.append(("plan", tiles))
        return tiles

    monkeypatch.setattr(span_tc_forward, "SideStream", RecordingSide)
    monkeypatch.setattr(span_tc_forward, "span_tile_plan", recorded_plan)
    monkeypatch.setattr(window_attention, "window_attention_kernel",
                        LaunchSpy(window_attention.window_attention_kernel, log, "window"))
    monkeypatch.setattr(span_tc_forward, "span_tile_kernel", LaunchSpy(span_tc_forward.span_tile_kernel, log, "span"))
    case = TileCase(torch.float32, 2, 4, 2, 20, 120, 20, 2, 6, None, False, 60, True)
    inputs = make_inputs(case, gen)
    assert case.window > 0
    out, lse = run_tc(case, LaunchGeometry.prepare(*inputs, case.window))
    assert [e if isinstance(e, str) else e[0] for e in log] == ["fork", "window", "side", "plan", "main", "join", "span"]
    tiles, made = log[3][1], log[5][1]
    assert len(made) == 3 and all(a is b for a, b in zip(made, (tiles.order, tiles.lo, tiles.hi)))
    ref_out, ref_lse = span_forward_reference(*(t.double() for t in inputs[:3]), *inputs[3:], case.window, return_lse=True)
    check_against_reference(case, out, lse, ref_out, ref_lse)


def test_edge_blocks_never_read_an_unwritten_cache_tail(gen: torch.Generator, monkeypatch):
    """W 3 is shorter than a 16-key block: a span tile's last block, which starts at its first span
    key, reaches past its queries' positions into the cache tail (NaN here: never written), so it
    must come by pointer loads (keys past the tile's last span key read as 0), not through TMA; the
    whole blocks still do. Every output stays finite and equals the reference's."""
    from superlinear_ops.ops.span_attention import tile_forward as span_tc_forward

    case = TileCase(torch.float32, 1, 2, 1, 8, 64, 16, 3, 1, None, False, 4, True)
    assert case.window == 3
    q, k, v, *_ = make_inputs(case, gen)
    cache_position = torch.arange(33, 41)  # keys 41.. are the unwritten tail
    k, v = k.clone(), v.clone()
    k[:, :, 41:], v[:, :, 41:] = float("nan"), float("nan")
    end = (cache_position - case.window).view(1, 1, -1, 1).expand(1, 2, 8, 3)
    qend = end - torch.tensor([0, 1, 2]).view(1, 1, 1, 3)
    qstart = qend - 3  # 4-key spans: the last tile's first key is >= 26, so its block reaches key 41
    geo = LaunchGeometry.prepare(q, k, v, qstart, qend, cache_position, None, case.window)
    assert int(span_tile_plan(geo, 16).lo[:, -16:].min()) + 15 >= 41
    spy = LaunchSpy(span_tc_forward.span_tile_kernel)
    monkeypatch.setattr(span_tc_forward, "span_tile_kernel", spy)
    out, lse = run_tc(case, geo)
    ref_out, ref_lse = span_forward_reference(q.double(), k.double().nan_to_num(0), v.double().nan_to_num(0), qstart, qend,
                                              cache_position, None, case.window, return_lse=True)
    check_against_reference(case, out, lse, ref_out, ref_lse)  # NaN never passes
    assert (spy.tma, spy.edge_tma) == ([True], [False]), "whole blocks through TMA, edge blocks by pointers"


def test_descriptors_only_where_the_inputs_allow(gen: torch.Generator):
    """K/V expanded over the batch (stride 0) or a row stride off 16 bytes fall back to pointer
    loads (no descriptors), and the results stay the reference's; a mask keeps the forward's
    descriptors but not the backward's (``key_value_descriptors``)."""
    from superlinear_ops.ops.span_attention.window_forward import key_value_descriptors, row_descriptors

    case = TileCase(torch.float32, 2, 4, 2, 20, 120, 20, 2, 6, None, False, 60, True)
    q, k, v, qstart, qend, cache_position, _ = make_inputs(case, gen)
    mask = torch.ones(case.batch, case.lkv, dtype=torch.bool)
    masked = LaunchGeometry.prepare(q, k, v, qstart, qend, cache_position, mask, case.window)
    assert row_descriptors(k, v, 16) and key_value_descriptors(masked, 16) is None
    expanded = k[:1].expand(case.batch, -1, -1, -1)
    odd_rows = torch.randn(case.batch, case.hkv, case.lkv, case.dim + 1, generator=gen)[..., : case.dim]  # 84-byte rows
    for keys, values in ((expanded, expanded), (odd_rows, odd_rows)):
        geo = LaunchGeometry.prepare(q, keys, values, qstart, qend, cache_position, None, case.window)
        assert row_descriptors(keys, values, 16) is None and key_value_descriptors(geo, 16) is None
        out, lse = run_tc(case, geo)
        ref_out, ref_lse = span_forward_reference(q.double(), keys.double(), values.double(), qstart, qend, cache_position,
                                                  None, case.window, return_lse=True)
        check_against_reference(case, out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("poison", ["none", "nan", "inf"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_masked_key_blocks_through_descriptors(poison: str, dtype: torch.dtype, gen: torch.Generator, monkeypatch):
    """Under a mask with holes (B 2, different rows; a long hole inside spans, one in the last
    windows: no tile lies in an allowed suffix, so the second of each kernel's two launches takes
    them all) the span tiles still load their whole blocks and their edge blocks through TMA (the
    window kernel's masked tiles take pointer loads); the keys the mask hides get zero weights. With NaN or infinite K/V rows behind the
    mask (``poison``), the tiles that meet them run again on pointer loads: every output stays the
    reference's, which reads hidden keys as nothing."""

    case = TileCase(dtype, 2, 4, 2, 40, 260, 40, 3, 7, None, True, 160, True)
    q, k, v, qstart, qend, cache_position, mask = make_inputs(case, gen)
    hidden = ~mask[:, : case.lkv]
    assert hidden.any(dim=1).all() and not torch.equal(mask[0], mask[1])
    if poison != "none":
        k, v = k.clone(), v.clone()
        rows = hidden.nonzero()
        k[rows[:, 0], :, rows[:, 1]] = float(poison)
        v[rows[:, 0], :, rows[:, 1]] = float(poison)
    spies = spied_forward_kernels(monkeypatch)
    out, lse = run_tc(case, LaunchGeometry.prepare(q, k, v, qstart, qend, cache_position, mask, case.window))
    assert [spy.tma for spy in spies.values()] == [[True, False], [True, True]], "masked window tiles by pointers"
    assert spies["span_tile_kernel"].edge_tma == [True, True]
    ref_out, ref_lse = span_forward_reference(
        q.double(), k.double().nan_to_num(0, 0, 0), v.double().nan_to_num(0, 0, 0), qstart, qend, cache_position, mask,
        case.window, return_lse=True,
    )
    check_against_reference(case, out, lse, ref_out, ref_lse)  # NaN never passes


def test_allowed_suffix_start():
    """The first key of each row's allowed keys where they run unbroken to the last key, else Lkv."""
    from superlinear_ops.ops.span_attention.window_forward import allowed_suffix_start

    keys = 40
    rows = torch.ones(6, keys + 3, dtype=torch.int32)  # an integer mask, wider than the keys
    rows[1, :7] = 0  # left padding
    rows[2, :7] = 0
    rows[2, 20] = 0  # and a hole after it
    rows[3] = 0  # nothing allowed
    rows[4, : keys - 1] = 0  # only the last key
    rows[5, keys:] = 0  # hidden past the keys: not read
    q, k = torch.zeros(6, 2, 1, 16), torch.zeros(6, 1, keys, 16)
    span = torch.zeros(6, 2, 1, 1, dtype=torch.int64)
    geo = LaunchGeometry.prepare(q, k, k, span, span, torch.tensor([keys - 1]), rows, 8)
    assert allowed_suffix_start(geo).tolist() == [0, 7, keys, keys, keys - 1, 0]


@pytest.mark.parametrize("padding", [(0, 0), (30, 70), (100, 5)])
def test_tiles_split_at_the_allowed_suffix(padding: tuple[int, int], gen: torch.Generator, monkeypatch):
    """Left padding (B 2, ``padding`` hidden keys per row, NaN and infinite K/V behind it; none: a
    mask of ones): each kernel runs twice, over the tiles whose keys all lie in their row's allowed
    suffix without the mask and over the others with it, and every row is written once, equal to
    the reference's (the outputs are poisoned first)."""
    from superlinear_ops.ops.span_attention import window_forward as window_attention

    case = TileCase(torch.float32, 2, 4, 2, 60, 260, 24, 3, 7, None, False, 160, True)
    q, k, v, qstart, qend, cache_position, _ = make_inputs(case, gen)
    mask = torch.ones(case.batch, case.lkv, dtype=torch.bool)
    k, v = k.clone(), v.clone()
    for row, hidden in enumerate(padding):
        mask[row, :hidden] = False
        k[row, :, :hidden], v[row, :, :hidden] = float("nan"), float("inf")
    spies = spied_forward_kernels(monkeypatch)
    geo = LaunchGeometry.prepare(q, k, v, qstart, qend, cache_position, mask, case.window)
    assert window_attention.allowed_suffix_start(geo).tolist() == list(padding)
    out, lse = run_tc(case, geo)
    split = [window_attention.SUFFIX_TILES.value, window_attention.MASKED_TILES.value]
    assert [spy.tiles for spy in spies.values()] == [split, split]
    ref_out, ref_lse = span_forward_reference(
        q.double(), k.double().nan_to_num(0, 0, 0), v.double().nan_to_num(0, 0, 0), qstart, qend, cache_position, mask,
        case.window, return_lse=True,
    )
    check_against_reference(case, out, lse, ref_out, ref_lse)  # NaN never passes


@pytest.mark.parametrize("case", [c for c in SPAN_CASES if c.dtype != "fp64"], ids=lambda c: c.name)
def test_shared_span_cases(case: SpanCase, gen: torch.Generator):
    """The suite's span cases (strided and expanded layouts, rep up to 16) with 16-row tiles."""
    x = make_span_inputs(case, gen)
    check_span_properties(case, x)
    geo = LaunchGeometry.prepare(x.q, x.k, x.v, x.qstart, x.qend, x.cache_position, x.mask, x.window)
    with poisoned_allocations():
        out, lse = span_forward_tc(geo, TINY)
    expected, expected_lse = x.oracle_forward()
    check_against_reference(case, out, lse, expected, expected_lse, DTYPES[case.dtype])


@pytest.mark.parametrize("start_block", [1, 16])
def test_span_tile_plan_order(start_block: int, gen: torch.Generator):
    """Each group's plan is a permutation; its bounds are the tensor ops' (``clamped_span_bounds``)
    of the sorted triples, with every clamp binding somewhere (starts before key 0, ends inside the
    query's window, unused slots); empty spans come last and starts are sorted by block, then ends;
    ties keep triple order (a stable sort)."""
    case = TileCase(torch.float32, 2, 4, 2, 30, 200, 16, 3, 4, None, False, 60, False)
    q, k, v, qstart, qend, cache_position, _ = make_inputs(case, gen)
    cache_position[-3:] = torch.tensor([case.lkv, case.lkv + 3, case.lkv + 50])  # positions past the last key,
    qstart[..., -3:, 0], qend[..., -3:, 0] = case.lkv - 100, case.lkv - 1  # whose spans must end by Lkv - 1 - W
    used = qend >= 0
    pos = cache_position.clamp(max=case.lkv - 1).view(1, 1, -1, 1)
    into_window = used & (torch.rand(qend.shape, generator=gen) < 0.3)
    qend = torch.where(into_window, torch.minimum(qend + case.window, pos), qend)
    qstart = torch.where(used & (torch.rand(qstart.shape, generator=gen) < 0.2), -1, qstart)
    assert (qend > pos - case.window).any() and ((qstart < 0) & used).any() and (~used).any(), "every clamp binds"
    geo = LaunchGeometry.prepare(q, k, v, qstart, qend, cache_position, None, case.window)
    plan = span_tile_plan(geo, start_block)
    lo, hi = (bound.view(plan.groups, -1) for bound in clamped_span_bounds(geo))
    assert (plan.order.dtype, plan.lo.dtype, plan.hi.dtype) == (torch.int64, torch.int32, torch.int32), "plan dtypes"
    for g in range(plan.groups):
        order = plan.order[g]
        torch.testing.assert_close(order.sort().values, torch.arange(plan.triples), rtol=0, atol=0, msg="a permutation")
        torch.testing.assert_close(plan.lo[g], lo[g, order], rtol=0, atol=0, msg="sorted starts")
        torch.testing.assert_close(plan.hi[g], hi[g, order], rtol=0, atol=0, msg="sorted ends")
        empty = plan.hi[g] < plan.lo[g]
        n_full = int((~empty).sum())
        assert not empty[:n_full].any() and 0 < n_full < plan.triples, "empty spans last"
        key = (plan.lo[g, :n_full].long() // start_block) * 1000 + (plan.hi[g, :n_full] if start_block > 1 else 0)
        assert (key[1:] >= key[:-1]).all(), "sorted by start block, then end"
        tie = key[1:] == key[:-1]
        assert tie.any() and (order[1:n_full][tie] > order[: n_full - 1][tie]).all(), "ties keep triple order"
        assert (order[n_full + 1:] > order[n_full:-1]).all(), "the empty ones in triple order too"
    # int32 positions reach the kernels unclamped (LaunchGeometry.prepare clamps int64 ones): those
    # past the last key must read as Lkv - 1 there too, or a span would reach into the window.
    int32_geo = LaunchGeometry.prepare(q, k, v, qstart, qend, cache_position.to(torch.int32), None, case.window)
    assert (int32_geo.cache_position >= case.lkv).sum() >= 3, "int32 positions past the last key reach the plan"
    int32_plan = span_tile_plan(int32_geo, start_block)
    for name in ("order", "lo", "hi"):
        assert torch.equal(getattr(int32_plan, name), getattr(plan, name)), f"int32 positions: the int64 plan's {name}"
    # Past about 185K keys the packed (start block, end) key needs int64: the same order.
    long_k = geo.k[:, :, :1].expand(-1, -1, 200_000, -1)
    long_geo = LaunchGeometry.prepare(geo.q, long_k, long_k, geo.qstart, geo.qend, geo.cache_position, None, geo.window)
    assert torch.equal(span_tile_plan(long_geo, start_block).order, plan.order)
    with pytest.raises(ValueError, match="start_block"):
        span_tile_plan(geo, 0)


def test_nan_key_stays_in_the_rows_that_attend_it(gen: torch.Generator):
    """A NaN key inside one row's span (streamed without per-row masks) never reaches a row of the
    same tile whose span is empty: that row gets its window alone."""
    case = TileCase(torch.float32, 1, 1, 1, 4, 128, 16, 2, 3, None, False, 1, True)  # W = 15
    q, k, v, _, _, cache_position, _ = make_inputs(case, gen)
    qstart = torch.full((1, 1, 4, 2), -1)
    qend = torch.full((1, 1, 4, 2), -1)
    qstart[0, 0, 0, 0], qend[0, 0, 0, 0] = 10, 80  # the only span: five 16-key blocks
    k = k.clone()
    k[0, 0, 40] = float("nan")
    geo = LaunchGeometry.prepare(q, k, v, qstart, qend, cache_position, None, case.window)
    out, lse = run_tc(case, geo)
    assert torch.isnan(out[0, 0, 0, 0]).all()
    ref_out, ref_lse = span_forward_reference(
        q.double(), k.double().nan_to_num(0), v.double(), qstart, qend, cache_position, None, case.window, return_lse=True
    )
    check_against_reference(case, out[0, 0, 1:], lse[0, 0, 1:], ref_out[0, 0, 1:], ref_lse[0, 0, 1:])
    check_against_reference(case, out[0, 0, 0, 1:], lse[0, 0, 0, 1:], ref_out[0, 0, 0, 1:], ref_lse[0, 0, 0, 1:])
