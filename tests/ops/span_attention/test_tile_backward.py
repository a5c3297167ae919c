"""Tensor-core span backward (Triton interpreter) against the float64 reference gradients."""

from __future__ import annotations

import pytest
import torch
from helpers import LaunchSpy, poisoned_allocations
from tile_cases import TileCase, random_spans

from superlinear_ops.launch import LaunchGeometry
from superlinear_ops.ops.span_attention.reference import span_backward_reference, span_forward_reference
from superlinear_ops.ops.span_attention.tile_backward import span_backward_tc
from superlinear_ops.ops.span_attention.variants import TC_BACKWARD_DEFAULTS as SPAN_TC_BACKWARD_DEFAULTS
from superlinear_ops.ops.span_attention.window_backward import window_tables

SMALL = {**SPAN_TC_BACKWARD_DEFAULTS, "window_block_m": 16, "window_block_n": 16,
         "span_block_m": 16, "span_block_n": 16}
# Elementwise |got - want| <= tol * (|want| + rms(want)) and ||got - want|| <= tol / 8 * ||want||.
# 16-bit gradients see the rounded forward output through delta = dO.O (cancellation in dP - delta);
# the norm bound still fails a 1% error in every dtype.
GRAD_TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 4e-2}
MIXED = {**SMALL, "window_block_m": 32, "span_block_m": 32}  # tiles of 32 rows, key blocks of 16


CASES = [
    # fp32, rep 2, B 2, float path (W 10), mask with holes, D 24, spans up to 45 keys crossing blocks
    TileCase(torch.float32, 2, 4, 2, 24, 90, 24, 3, 3, 0.55, True, 45, False, config=SMALL),
    # bf16, MHA, integer path (W 8), no mask, training positions, 32-row tiles over 16-key blocks
    TileCase(torch.bfloat16, 1, 2, 2, 40, 40, 32, 2, 2, None, False, 30, True, config=MIXED),
    # fp16, rep 4, one span, W 24 over 16-key blocks, mask, many rows with t <= W
    TileCase(torch.float16, 1, 4, 1, 20, 64, 16, 1, 4, None, True, 40, False, config=SMALL),
    # fp32, rep 4, D 40, three spans, no window (sw_index 0), training positions
    TileCase(torch.float32, 1, 4, 1, 48, 48, 40, 3, 0, None, True, 20, True, config=MIXED),
    # bf16, rep 2, B 2, D 96, float path, mask, training positions; dK/dV over the heads in 2 parts
    # (atomic adds), span tiles sorted by (start // 16, end)
    TileCase(torch.bfloat16, 2, 4, 2, 24, 60, 96, 3, 3, 0.55, True, 30, True,
             config={**MIXED, "window_head_split": 2, "span_sort_block": 16}),
    # fp16, rep 4, D 128, integer path, random positions; one part per head (split 16 > rep), spans by start
    TileCase(torch.float16, 1, 4, 1, 20, 50, 128, 2, 2, None, False, 25, False,
             config={**SMALL, "window_head_split": 16, "span_sort_block": 1}),
]


def make_inputs(case: TileCase, gen: torch.Generator, share_spans: bool = True):
    shape_q = (case.batch, case.hq, case.lq, case.dim)
    shape_kv = (case.batch, case.hkv, case.lkv, case.dim)
    q = torch.randn(shape_q, generator=gen).to(case.dtype)
    k, v = (torch.randn(shape_kv, generator=gen).to(case.dtype) for _ in range(2))
    if case.consecutive:
        cache_position = torch.arange(case.lkv - case.lq, case.lkv)
    else:  # random, unsorted, from inside the first window to past the last key (clamped)
        cache_position = torch.randint(0, case.lkv + 4, (case.lq,), generator=gen)
        cache_position[0] = min(3, case.lkv - 1)
    qstart, qend = random_spans(gen, case.batch, case.hq, cache_position, case.spans, case.lkv, case.window,
                                case.max_span)
    if share_spans and case.hq > 1:  # head 1 copies head 0: triples that share key blocks exactly
        qstart[:, 1], qend[:, 1] = qstart[:, 0], qend[:, 0]
    mask = None
    if case.masked:
        mask = torch.rand(case.batch, case.lkv + 3, generator=gen) > 0.25
        mask[0, case.lkv // 4: case.lkv // 2] = False  # a long hole
    return q, k, v, qstart, qend, cache_position, mask


def forward(case: TileCase, q, k, v, qstart, qend, cache_position, mask):
    """(out in the input dtype, lse2 fp32) from the float64 reference forward."""
    out, lse = span_forward_reference(q.double(), k.double(), v.double(), qstart, qend, cache_position, mask,
                                      case.window, return_lse=True)
    return out.to(case.dtype), lse.float()


def assert_grad_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Compare a gradient with its float64 reference (GRAD_TOL); NaN never passes."""
    assert not torch.isnan(got).any(), f"{what}: NaN"
    err, tol = (got.double() - want).abs(), GRAD_TOL[dtype]
    bound = tol * (want.abs() + want.pow(2).mean().sqrt())
    worst = (err / bound).argmax()
    assert bool((err <= bound).all()), f"{what}: error {err.flatten()[worst]:.3g} at flat index {worst}"
    rel = (err.norm() / want.norm()).item()
    assert rel <= tol / 8, f"{what}: relative error in norm {rel:.3g} > {tol / 8:.3g}"


def backward(geo: LaunchGeometry, config, out, lse, grad_out):
    """The backward with every float buffer it allocates by torch.empty starting as NaN."""
    with poisoned_allocations():
        return span_backward_tc(geo, config, out, lse, grad_out)


def check_gradients(case: TileCase, inputs, gen: torch.Generator, geo_q=None) -> tuple[torch.Tensor, ...]:
    q, k, v, qstart, qend, cache_position, mask = inputs
    out, lse = forward(case, *inputs)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    geo = LaunchGeometry.prepare(q if geo_q is None else geo_q, k, v, qstart, qend, cache_position, mask,
                                 case.window)
    grads = backward(geo, case.config, out, lse, grad_out.to(case.dtype))
    expected = span_backward_reference(q.double(), k.double(), v.double(), qstart, qend, cache_position,
                                       mask, case.window, grad_out)
    for name, got, want, like in zip("QKV", grads, expected, (q, k, v)):
        assert got.dtype == case.dtype and got.shape == like.shape, name
        assert_grad_close(got, want, case.dtype, f"d{name}")
    return grads


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.dtype}-rep{c.hq // c.hkv}-K{c.spans}-W{c.window}")
def test_backward_matches_reference(case: TileCase, gen: torch.Generator) -> None:
    check_gradients(case, make_inputs(case, gen), gen)


@pytest.mark.parametrize("heads, split, sort_block", [(16, 1, 64), (16, 4, 16), (16, 16, 1), (10, 4, 64)])
def test_head_parts_and_span_sorts_match_reference(heads: int, split: int, sort_block: int, gen: torch.Generator) -> None:
    """B 2, D 64, left padding, random positions: the window dK/dV kernel over a group of 16 heads
    in one part, in 4 parts and one part per head, and 10 heads in uneven parts (3, 3, 3, 1); span
    tiles sorted by (start // 64, end), (start // 16, end) and by start."""
    case = TileCase(torch.float32, 2, heads, 1, 24, 56, 64, 3, 2, None, True, 30, False,
                    config={**MIXED, "window_head_split": split, "span_sort_block": sort_block})
    q, k, v, qstart, qend, cache_position, mask = make_inputs(case, gen)
    mask = torch.ones_like(mask)
    mask[0, :5], mask[1, :9] = False, False  # left padding, a different length per batch row
    check_gradients(case, (q, k, v, qstart, qend, cache_position, mask), gen)


def test_spans_in_distinct_key_blocks_and_non_contiguous_q(gen: torch.Generator) -> None:
    case = CASES[0]
    q, *rest = make_inputs(case, gen, share_spans=False)
    wide = torch.randn(case.batch, case.lq, case.hq, 2 * case.dim, generator=gen).to(case.dtype)
    strided = wide[..., : case.dim].transpose(1, 2)  # [B, Hq, Lq, D], unit stride on D only
    strided.copy_(q)
    assert not strided.is_contiguous()
    check_gradients(case, (q, *rest), gen, geo_q=strided)


@pytest.mark.parametrize("tma", [0, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("consecutive", [True, False], ids=["consecutive", "unsorted"])
def test_window_kernels_whole_tiles_through_descriptors(tma: int, dtype: torch.dtype, consecutive: bool,
                                                        gen: torch.Generator, monkeypatch) -> None:
    """No mask, B 2, two KV groups, D 40, W 63 over 16-query tiles, positions in order or unsorted (the
    query rows then lie in another order than the queries): the dQ kernel's whole key blocks and the
    dK/dV kernel's query tiles (q and dO* in sorted order) come through TMA descriptors (``tma`` 1)
    or, withheld, by pointers; both match the reference."""
    from superlinear_ops.ops.span_attention import window_backward as window_tc_backward

    case = TileCase(dtype, 2, 4, 2, 40, 200, 40, 3, 7, None, False, 60, consecutive, config=SMALL)
    dq_spy = LaunchSpy(window_tc_backward.window_dq_kernel)
    dkdv_spy = LaunchSpy(window_tc_backward.window_dkdv_kernel, tma_flag="ROWS_TMA")
    monkeypatch.setattr(window_tc_backward, "window_dq_kernel", dq_spy)
    monkeypatch.setattr(window_tc_backward, "window_dkdv_kernel", dkdv_spy)
    if not tma:
        monkeypatch.setattr(window_tc_backward, "key_value_descriptors", lambda *_: None)
        monkeypatch.setattr(window_tc_backward, "row_descriptors", lambda *_: None)
    check_gradients(case, make_inputs(case, gen), gen)
    assert dq_spy.tma == [bool(tma)] and dkdv_spy.tma == [bool(tma)]


FULL_TILE_CASES = {  # W 63 over 16-key blocks: most query tiles of a key block (and key blocks of a
    # query tile) lie inside every row's window and run without per-row masks
    # consecutive positions from 78 (14 mod 16: a tile starts one key before a block's last key), bf16
    "consecutive-78": TileCase(torch.bfloat16, 1, 2, 1, 64, 142, 32, 1, 7, None, False, 20, True, config=SMALL),
    # from 80 (a 32-row tile's last window starts one key past a block's first), mask with holes, fp16
    "consecutive-80-mask": TileCase(torch.float16, 1, 2, 1, 96, 176, 32, 2, 7, None, True, 20, True, config=MIXED),
    # random positions (the kernels sort them) with repeats, B 2, mask, fp32
    "random-mask": TileCase(torch.float32, 2, 2, 1, 96, 120, 32, 2, 7, None, True, 20, False, config=SMALL),
    # rep 16, D 64, float path (W 53), left padding (below), 32-row tiles, dK/dV in 4 parts
    "rep16-float-left-padding": TileCase(torch.float32, 1, 16, 1, 48, 110, 64, 2, 8, 0.55, True, 20, True,
                                         config={**MIXED, "window_head_split": 4}),
    # rep 4, D 96 (padded to 128), B 2, bf16, no mask: the dQ kernel's inner blocks through TMA
    "rep4-d96-b2": TileCase(torch.bfloat16, 2, 8, 2, 48, 100, 96, 3, 7, None, False, 20, True, config=SMALL),
}


@pytest.mark.parametrize("name", list(FULL_TILE_CASES))
def test_window_backward_full_tiles_and_inner_blocks(name: str, gen: torch.Generator) -> None:
    """The window kernels' unmasked tiles (dK/dV) and inner key blocks (dQ) beside their edge ones."""
    case = FULL_TILE_CASES[name]
    q, k, v, qstart, qend, cache_position, mask = make_inputs(case, gen)
    if "left-padding" in name:
        mask = torch.ones_like(mask)
        mask[:, :7] = False
    check_gradients(case, (q, k, v, qstart, qend, cache_position, mask), gen)

def test_masked_keys_beside_very_negative_scores_pass_no_gradient(gen: torch.Generator) -> None:
    """Every attended score near -208 (a log2 log-sum-exp near -300): a masked-out key, read as 0,
    scores 0 and its probability exp2(0 - c) overflows fp32, so each kernel must drop it by the mask
    itself, not by a weight that the overflow turns into NaN. Mask with holes, fp16, D 32,
    consecutive rows; the large component is exact in fp16 (Q's -1176, K's 1), so only the kernels round."""
    case = FULL_TILE_CASES["consecutive-80-mask"]
    q, k, v, qstart, qend, cache_position, mask = make_inputs(case, gen)
    q[..., 0], k[..., 0] = -1176.0, 1.0  # 1176 / sqrt(32) = 208
    assert (~mask).any(), "the mask has holes"
    check_gradients(case, (q, k, v, qstart, qend, cache_position, mask), gen)


def test_unattended_nan_keys_never_reach_a_gradient(gen: torch.Generator) -> None:
    """Static-cache tail past every position and masked-out keys hold NaN: gradients stay exact."""
    case = TileCase(torch.float32, 1, 4, 2, 24, 100, 24, 3, 3, 0.55, True, 30, False, config=SMALL)
    q, k, v, qstart, qend, cache_position, mask = make_inputs(case, gen)
    cache_position = cache_position.clamp(max=70)  # keys 71.. are the uninitialised tail
    qstart, qend = random_spans(gen, 1, 4, cache_position, 3, case.lkv, case.window, case.max_span)
    dead = torch.zeros(case.lkv, dtype=torch.bool)
    dead[71:] = True
    dead |= ~mask[0, : case.lkv]
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, :, dead] = float("nan")
    v_nan[:, :, dead] = float("nan")
    out, lse = forward(case, q, k, v, qstart, qend, cache_position, mask)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    geo = LaunchGeometry.prepare(q, k_nan, v_nan, qstart, qend, cache_position, mask, case.window)
    grads = backward(geo, case.config, out, lse, grad_out.float())
    expected = span_backward_reference(q.double(), k.double(), v.double(), qstart, qend, cache_position, mask,
                                       case.window, grad_out)
    for name, got, want in zip("QKV", grads, expected):
        assert_grad_close(got, want, case.dtype, f"d{name}")
    assert torch.equal(grads[1][:, :, dead], torch.zeros_like(grads[1][:, :, dead]))


TABLE_CASES = {  # name: (queries, keys, window, dK/dV tile rows, dQ tile rows / key block keys)
    # unsorted positions with repeats and past the last key, tiles not dividing Lq, several key blocks per tile
    "random": (70, 90, 12, 16, 8),
    # no window: every tile's range is empty (hi < lo), no key block is touched
    "no-window": (40, 64, 0, 16, 16),
    # more queries and key blocks than one program of the tables kernel holds (TABLE_BLOCK 1024)
    "two-programs": (1500, 1100, 40, 32, 1),
    # one query
    "one-query": (1, 30, 5, 32, 16),
    # a power-of-two count of dK/dV tiles (4): the binary search's last halving matters
    "four-tiles": (64, 80, 9, 16, 4),
    # more key blocks (1100) than programs sized by the queries alone would cover
    "key-blocks-past-queries": (10, 1100, 3, 16, 1),
}


@pytest.mark.parametrize("name", list(TABLE_CASES))
def test_window_tables_match_their_definition(name: str, gen: torch.Generator) -> None:
    """One launch's tables against the definitions, by broadcast comparisons: positions clamped and
    sorted stably, each tile's key range, and per key block the tiles before it (hi < its first key)
    and up to it (lo <= its last key)."""
    lq, lkv, window, dkdv_rows, dq_rows = TABLE_CASES[name]
    dtype = torch.int64 if name == "random" else torch.int32  # both index dtypes the kernels take
    cache_position = torch.randint(0, lkv + 5, (lq,), generator=gen, dtype=dtype)
    with poisoned_allocations(integer=-(2**31)):
        tables = window_tables(cache_position, lkv, window, dkdv_rows, dq_rows)
    clamped = cache_position.long().clamp(max=lkv - 1)
    perm = tables.perm.long()
    assert tables.perm.dtype == torch.int32 and sorted(perm.tolist()) == list(range(lq)), "perm: a permutation"
    assert tables.rank.dtype == torch.int32 and torch.equal(tables.rank.long()[perm], torch.arange(lq)), "rank: perm's inverse"
    assert torch.equal(tables.pos.long(), clamped[perm]), "pos: the clamped positions in perm's order"
    ties = tables.pos[1:] == tables.pos[:-1]
    assert bool((tables.pos[1:] >= tables.pos[:-1]).all()) and bool((perm[1:][ties] > perm[:-1][ties]).all()), "stable sort"

    def ranges(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        first_row = torch.arange(0, lq, rows)
        lo = (tables.pos.long()[first_row] - window + 1).clamp(min=0)
        last_row = (first_row + rows - 1).clamp(max=lq - 1)
        return lo, tables.pos.long()[last_row] if window > 0 else lo - 1

    dq_lo, dq_hi = ranges(dq_rows)
    assert torch.equal(tables.dq_lo.long(), dq_lo) and torch.equal(tables.dq_hi.long(), dq_hi), "dQ tile ranges"
    lo, hi = ranges(dkdv_rows)
    block_first = torch.arange(0, lkv, dq_rows)
    first = (hi[None, :] < block_first[:, None]).sum(dim=1)
    last = (lo[None, :] <= block_first[:, None] + dq_rows - 1).sum(dim=1) - 1
    assert torch.equal(tables.first.long(), first), "first tile per key block"
    assert torch.equal(tables.last.long(), last), "last tile per key block"
    if window > 0:  # every tile that touches a block lies in its run [first, last]
        touches = (lo[None, :] <= block_first[:, None] + dq_rows - 1) & (hi[None, :] >= block_first[:, None])
        tile = torch.arange(lo.numel())[None, :]
        assert bool((~touches | ((tile >= first[:, None]) & (tile <= last[:, None]))).all()), "touching tiles in the run"


BAD_VALUES = {  # tunable -> (bad value, what the message says)
    "span_block_m": ((24, "power of two"), (8, "must be in \\[16, 256\\]")),
    "window_block_n": ((24, "power of two"), (8, "must be in \\[16, 256\\]")),
    "window_head_split": ((0, "positive int"), (True, "positive int"), (3, "power of two")),
    "span_sort_block": ((0, "positive int"), (True, "positive int"), (3, "power of two")),
}


@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_bad_config_names_the_key(name: str) -> None:
    case = CASES[0]
    inputs = make_inputs(case, torch.Generator().manual_seed(0))
    out, lse = forward(case, *inputs)
    geo = LaunchGeometry.prepare(*inputs, case.window)
    for bad, message in BAD_VALUES[name]:
        with pytest.raises(ValueError, match=f"{name}.*{message}"):
            span_backward_tc(geo, {**SMALL, name: bad}, out, lse, out)
    with pytest.raises(ValueError, match=name):
        span_backward_tc(geo, {key: val for key, val in SMALL.items() if key != name}, out, lse, out)


@pytest.mark.parametrize("tma", [0, 1])
@pytest.mark.parametrize("batch_row, head", [(0, 2), (1, 0)], ids=["next-group", "next-batch-row"])
def test_non_finite_output_gradient_stays_in_its_head(tma: int, batch_row: int, head: int, gen: torch.Generator,
                                                      monkeypatch) -> None:
    """NaN in every dO entry of one (batch row, head) whose sorted rows follow another KV group's or
    batch row's (B 2, rep 2, Lq 40 over 16-row dK/dV tiles: the tiles of the head before end 8 rows
    into this one). Gradients that the head does not feed equal the reference's, and the head's own
    show the NaN, through TMA descriptors (``tma`` 1) and through pointer loads alike."""
    from superlinear_ops.ops.span_attention import window_backward as window_tc_backward

    case = TileCase(torch.float32, 2, 4, 2, 40, 100, 32, 2, 7, None, False, 20, True, config=SMALL)
    q, k, v, qstart, qend, cache_position, mask = make_inputs(case, gen)
    dkdv_spy = LaunchSpy(window_tc_backward.window_dkdv_kernel, tma_flag="ROWS_TMA")
    monkeypatch.setattr(window_tc_backward, "window_dkdv_kernel", dkdv_spy)
    if not tma:
        monkeypatch.setattr(window_tc_backward, "row_descriptors", lambda *_: None)
    out, lse = forward(case, q, k, v, qstart, qend, cache_position, mask)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grad_out[batch_row, head] = float("nan")
    geo = LaunchGeometry.prepare(q, k, v, qstart, qend, cache_position, mask, case.window)
    grads = backward(geo, case.config, out, lse, grad_out.float())
    expected = span_backward_reference(q.double(), k.double(), v.double(), qstart, qend, cache_position, mask,
                                       case.window, grad_out)
    assert dkdv_spy.tma == [bool(tma)]
    group = head // (case.hq // case.hkv)
    fed = {"Q": (batch_row, head), "K": (batch_row, group), "V": (batch_row, group)}
    for name, got, want in zip("QKV", grads, expected):
        inside = torch.zeros(got.shape[:2], dtype=torch.bool)
        inside[fed[name]] = True
        assert torch.isnan(got[inside]).any(), f"d{name}: the NaN of dO does not show where it feeds"
        assert_grad_close(got[~inside], want[~inside], case.dtype, f"d{name} outside the NaN head")
