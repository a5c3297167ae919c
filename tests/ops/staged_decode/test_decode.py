"""Staged decode through the public API (GQA and MHA entry points and their aliases, force_mode,
the float64 reference path) and decode edge cases, against the independent oracle. Every
registered variant is compared with the oracle directly in tests/ops/test_variants.py."""

from __future__ import annotations

from dataclasses import replace

import oracle
import pytest
import torch
from cases import DECODE_CASES, FLOAT55, DecodeCase, make_decode_inputs
from helpers import DecodeInputs, assert_close, launch_variant

import superlinear_ops
from superlinear_ops.registry import REGISTRY


def api_kwargs(x: DecodeInputs) -> dict:
    p = x.params
    return dict(sw_index=p.sw_index, topk=p.topk, backward_factor=p.backward_factor, forward_factor=p.forward_factor,
                span_power=p.span_power, **p.power.kwargs())


def positional(x: DecodeInputs) -> tuple:
    return x.q1, x.q2, x.k, x.v, x.cache_position, x.mask


GQA_CASE = DecodeCase("bf16", 4, power=FLOAT55, sw_index=6)
MHA_CASE = DecodeCase("fp16", 1, hkv=2, power=FLOAT55, sw_index=6, forward_factor=0.5)


@pytest.mark.parametrize("entry", ["decode_span_attention_staged_gqa", "decode_span_attention_gqa"])
def test_gqa_entry_points_match_oracle(entry: str, gen: torch.Generator) -> None:
    x = make_decode_inputs(GQA_CASE, gen)
    got = getattr(superlinear_ops, entry)(*positional(x), **api_kwargs(x))
    assert_close(got, x.oracle()[0], torch.bfloat16, GQA_CASE.lkv, entry)


@pytest.mark.parametrize("entry", ["decode_span_attention_staged", "decode_span_attention"])
def test_mha_entry_points_match_oracle(entry: str, gen: torch.Generator) -> None:
    """The MHA signature, positional as the original's (non-default powers and factors)."""
    x = make_decode_inputs(MHA_CASE, gen)
    p = x.params
    got = getattr(superlinear_ops, entry)(
        *positional(x), p.sw_index, p.topk, p.backward_factor, p.forward_factor, span_power=p.span_power,
        **p.power.kwargs(),
    )
    assert_close(got, x.oracle()[0], torch.float16, MHA_CASE.lkv, entry)


def test_force_mode_sdpa_is_plain_attention_and_differs_from_staged(gen: torch.Generator) -> None:
    case = DecodeCase("fp32", 2, mask="static", lkv=256, pos=180)
    x = make_decode_inputs(case, gen)
    plain = superlinear_ops.decode_span_attention_staged_gqa(*positional(x), **api_kwargs(x), force_mode="sdpa")
    pos = case.pos
    allowed = x.mask[:, : pos + 1]
    expected = torch.zeros(plain.shape, dtype=torch.float64)
    for b in range(case.batch):
        keys = torch.nonzero(allowed[b]).flatten()
        for h in range(plain.shape[1]):
            g = h // case.rep
            weights = torch.softmax(x.k[b, g, keys].double() @ x.q2[b, h, 0].double() / case.dim**0.5, 0)
            expected[b, h, 0] = weights @ x.v[b, g, keys].double()
    assert_close(plain, expected, torch.float32, pos + 1, "sdpa")
    staged = superlinear_ops.decode_span_attention_staged_gqa(*positional(x), **api_kwargs(x), force_mode="span")
    assert_close(staged, x.oracle()[0], torch.float32, case.lkv, "span")
    assert (staged - plain).abs().max() > 1e-2, "t > W: the staged result must differ from plain attention"


def test_short_prefix_all_modes_equal_plain_attention(gen: torch.Generator) -> None:
    case = next(c for c in DECODE_CASES if c.kind == "short-prefix")
    x = make_decode_inputs(case, gen)
    expected, traces = x.oracle()
    assert all(tr.short_prefix for tr in traces.values())
    for mode in (None, "span", "sdpa"):
        got = superlinear_ops.decode_span_attention_staged_gqa(*positional(x), **api_kwargs(x), force_mode=mode)
        assert_close(got, expected, torch.float32, case.pos + 1, f"force_mode={mode}")


def test_float64_runs_the_reference_path_exactly(gen: torch.Generator) -> None:
    case = next(c for c in DECODE_CASES if c.dtype == "fp64")
    x = make_decode_inputs(case, gen)
    got = superlinear_ops.decode_span_attention_staged_gqa(*positional(x), **api_kwargs(x))
    assert got.dtype == torch.float64
    # Search scores and the gate are fp32 by definition (semantics section 3); the rest is float64.
    assert_close(got, x.oracle()[0], torch.float32, case.lkv, "float64 path")


TRITON_DECODE = [v for v in REGISTRY.variants("staged_decode") if v.space]
GROUPED = [REGISTRY.get("staged_decode", name) for name in ("grouped", "stripe_spans", "group_spans", "one_launch", "split_merge")]  # tensor-core decodes


@pytest.mark.parametrize("variant", TRITON_DECODE, ids=[v.name for v in TRITON_DECODE])
def test_negative_decode_position_is_position_zero(variant, gen: torch.Generator) -> None:
    """Without validation a negative position is treated as 0: no out-of-bounds table read."""
    x = make_decode_inputs(DecodeCase("fp32", 2, mask="none"), gen)
    got, _ = launch_variant(variant, replace(x, cache_position=torch.tensor([-7])))
    expected, _ = launch_variant(variant, replace(x, cache_position=torch.tensor([0])))
    assert torch.isfinite(got).all() and torch.equal(got, expected)
    with pytest.raises(ValueError, match="cache_position"):
        superlinear_ops.decode_span_attention_staged_gqa(*positional(replace(x, cache_position=torch.tensor([-7]))),
                                                         **api_kwargs(x), validate=True)


@pytest.mark.parametrize("variant", TRITON_DECODE, ids=[v.name for v in TRITON_DECODE])
def test_tied_search_scores_choose_the_nearest_stripes(variant, gen: torch.Generator) -> None:
    """Four stripe keys equal (and the best for every head), one among the nearest 64 stripes and
    three past them (another search block of the grouped kernels): the nearest three win, as the
    oracle's stable sort over stripes nearest first decides (a kernel that keeps a farther one
    attends another span)."""
    case = DecodeCase("fp32", 2, mask="none", hkv=2, lkv=6000, pos=5990)
    x = make_decode_inputs(case, gen)
    t, window_start = case.pos + 1, case.pos - case.params.window + 1
    locs = [t - o for o in oracle.stripe_offsets(case.lkv, case.sw_index, case.params.power) if 0 <= t - o < window_start]
    assert len(locs) >= 70
    direction = torch.randn(case.dim, generator=gen).abs()
    x.q1.copy_(direction.expand_as(x.q1))
    tied = [locs[1], locs[65], locs[67], locs[69]]  # the farthest must lose
    x.k[:, :, tied] = 3 * direction
    expected, traces = x.oracle()
    assert all({a for _, a, _, _ in trace.chosen} == set(sorted(tied)[-3:]) for trace in traces.values())
    got, _ = launch_variant(variant, x)
    assert_close(got, expected, torch.float32, case.lkv, variant.name)


@pytest.mark.parametrize("variant", GROUPED, ids=[v.name for v in GROUPED])
@pytest.mark.parametrize("mask", ["holes", "static"])
@pytest.mark.parametrize("head", [16, None])
def test_grouped_first_allowed_key_over_several_mask_slices(variant, mask: str, head: int | None, gen: torch.Generator,
                                                            monkeypatch) -> None:
    """The grouped variant finds each row's first allowed key from per-slice minima (slices dealt
    over the KV groups), stripe_spans by reading slice after slice until one holds it; small slices
    make several, the first of them wholly masked (past its first ``head`` = 16 keys, which it reads
    beside its tables; with the default head the first allowed keys lie in it). Row 0's forward
    length is one key longer from its first allowed key than from the key after it."""
    from superlinear_ops.ops.staged_decode import group_stage as decode_grouped

    monkeypatch.setattr(decode_grouped, "MASK_SLICE", 16)
    if head is not None:
        monkeypatch.setattr(decode_grouped, "MASK_HEAD", head)
    x = make_decode_inputs(DecodeCase("fp32", 2, mask=mask, lkv=256, pos=180, hkv=2), gen)
    x.mask[:, :50] = False
    x.mask[0, 50:80] = False  # rows start at different slices (row 0: t - first = 101 = 10 ** 2 + 1)
    got, _ = launch_variant(variant, x)
    assert_close(got, x.oracle()[0], torch.float32, 256, variant.name)


CHUNKED_SPANS = [v for v in GROUPED if v.name not in ("one_launch", "split_merge")]  # their splits: test_split_keys.py


@pytest.mark.parametrize("variant", CHUNKED_SPANS, ids=[v.name for v in CHUNKED_SPANS])
@pytest.mark.parametrize(("chunk", "mask"), [(128, "holes"), (100, "sparse holes"), (100, "none")])
def test_grouped_decode_runs_long_spans_in_several_chunks(variant, chunk: int, mask: str, gen: torch.Generator) -> None:
    """Spans of about 260 keys in chunks of 128 keys, or 100 (not a power of two, nor a multiple of the
    32-key blocks: the last block of a chunk ends inside the next one), three or more programs per span
    with several blocks each, two rows with different masks (or none): every chunk's partial is stored
    where its head's merge reads it. With 2% holes many chunks hold theirs only past their first keys,
    where the mask entries are read a block ahead of the loads they decide. stripe_spans chunks every
    stripe's span the same way, and its merge finds the chosen stripes' chunks among them."""
    case = DecodeCase("fp32", 2, hkv=2, lkv=2048, pos=2000, power=FLOAT55, sw_index=6, mask=mask.split()[-1])
    x = make_decode_inputs(case, gen)
    if mask == "sparse holes":
        x.mask.copy_(torch.rand(x.mask.shape, generator=gen) >= 0.02)
    expected, traces = x.oracle()
    assert max(end - start + 1 for trace in traces.values() for _, _, start, end in trace.chosen) > 2 * 128
    got, config = launch_variant(variant, x, block_k=32, changes={"chunk": chunk})
    assert config.chunk == chunk, f"the launch ran chunk {config.chunk}, not {chunk}"
    assert_close(got, expected, torch.float32, case.lkv, variant.name)



@pytest.mark.parametrize("variant", GROUPED, ids=[v.name for v in GROUPED])
@pytest.mark.parametrize("block_k", [16, 64])
def test_grouped_decode_ignores_nan_in_keys_nobody_attends(variant, block_k: int, gen: torch.Generator) -> None:
    """Without a mask the span blocks come through TMA whole: the keys a last block reads past its span
    (before the window, and with 64-key blocks past the position too) must not reach the output, even
    as NaN. K and V are NaN at every key that no chosen span, window or stripe covers and after the position
    (stripe_spans attends the spans nobody chooses too: their NaN partials must never be merged)."""
    case = DecodeCase("fp32", 2, "none", forward_factor=0.0, batch=1, lkv=300, pos=290, sw_index=5)
    x = make_decode_inputs(case, gen)
    expected, traces = x.oracle()
    window = x.params.window
    assert 16 < window < 64, f"the window ({window}) must lie between the two block widths"
    covered = set(range(case.pos - window + 1, case.pos + 1))
    covered |= {case.pos + 1 - o for o in oracle.stripe_offsets(case.lkv, case.sw_index, case.power)}
    for trace in traces.values():
        for _, _, start, end in trace.chosen:
            covered |= set(range(start, end + 1))
    unused = [i for i in range(case.lkv) if i not in covered]
    assert len(unused) >= 32, f"only {len(unused)} unattended keys to poison"
    x.k[:, :, unused] = float("nan")
    x.v[:, :, unused] = float("nan")
    got, _ = launch_variant(variant, x, block_k=block_k)
    assert_close(got, expected, torch.float32, case.lkv, variant.name)


@pytest.mark.parametrize("variant", GROUPED, ids=[v.name for v in GROUPED])
def test_grouped_decode_reads_each_query_with_its_own_strides(variant, gen: torch.Generator) -> None:
    """Q1 contiguous and Q2 a slice of rows twice as wide, in a batch of two: the search reads Q1 with
    Q1's strides and the window and span programs Q2 with Q2's (mixed up, a program reads another
    head's or batch row's query)."""
    case = DecodeCase("fp32", 2, hkv=2)
    x = make_decode_inputs(case, gen)
    wide = torch.randn(*x.q2.shape[:-1], 2 * case.dim, generator=gen)
    wide[..., : case.dim] = x.q2
    x = replace(x, q1=x.q1.contiguous(), q2=wide[..., : case.dim])
    assert x.q2.stride()[:2] != x.q1.stride()[:2], "the queries share their strides"
    got, _ = launch_variant(variant, x)
    assert_close(got, x.oracle()[0], torch.float32, case.lkv, variant.name)


@pytest.mark.parametrize("variant", GROUPED, ids=[v.name for v in GROUPED])
def test_grouped_decode_without_a_window(variant, gen: torch.Generator) -> None:
    """sw_index 0 (W = 0): no window programs' keys, spans end at the position, and a slot without a
    span attends nothing (zeros before the gate)."""
    case = DecodeCase("fp32", 2, hkv=2, sw_index=0)
    x = make_decode_inputs(case, gen)
    assert x.params.window == 0
    expected, traces = x.oracle()
    assert any(trace.chosen for trace in traces.values()), "no span chosen"
    got, _ = launch_variant(variant, x)
    assert_close(got, expected, torch.float32, case.lkv, variant.name)


@pytest.mark.parametrize("programs_per_multiprocessor", [1, 10**6], ids=["walking", "one-chunk-each"])
@pytest.mark.parametrize("mask", ["holes", "none"])
def test_group_spans_programs_walk_their_chunks(programs_per_multiprocessor: int, mask: str, gen: torch.Generator,
                                                monkeypatch) -> None:
    """group_spans' programs each take every programs-th chunk of key positions: one program per KV
    group walking all 32 chunks of 64 keys (spans of about 260 keys meet 5 or 6 of them, most
    chunks none), or a program per chunk. Either way every span's partials land where its head's
    merge reads them, and the heads merge once all are written."""
    from superlinear_ops.ops.staged_decode import group_spans_kernels

    monkeypatch.setattr(group_spans_kernels, "PROGRAMS_PER_MULTIPROCESSOR", programs_per_multiprocessor)
    case = DecodeCase("fp32", 2, hkv=2, lkv=2048, pos=2000, power=FLOAT55, sw_index=6, mask=mask)
    x = make_decode_inputs(case, gen)
    got, _ = launch_variant(REGISTRY.get("staged_decode", "group_spans"), x, changes={"chunk": 64})
    assert_close(got, x.oracle()[0], torch.float32, case.lkv, f"group_spans, {programs_per_multiprocessor} per SM")


ROW_TILES = [REGISTRY.get("staged_decode", name) for name in ("group_spans", "one_launch", "split_merge")]


@pytest.mark.parametrize("variant", ROW_TILES, ids=[v.name for v in ROW_TILES])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("chunk", [128, 4096])
def test_row_tiles_keep_a_value_one_head_attends_out_of_the_others(variant, poison: float, chunk: int,
                                                                   gen: torch.Generator) -> None:
    """group_spans attends every (head, slot) span of a KV group over one chunk's keys together, and
    one_launch and split_merge the windows too, so a key one head attends meets the zero weights of the rows that do
    not in the same dot. A NaN or an infinity in such a key's value must reach only the heads that
    attend it (non-finite there, as in the oracle), whether the spans share a small chunk or all lie
    in one."""
    case = DecodeCase("fp32", 4, "none", hkv=1, batch=1, lkv=600, pos=590, power=FLOAT55, sw_index=6)
    x = make_decode_inputs(case, gen)
    _, traces = x.oracle()
    spans = {head: [(start, end) for _, _, start, end in trace.chosen] for (_, head), trace in traces.items()}
    attends = {head: {key for start, end in chosen for key in range(start, end + 1)} for head, chosen in spans.items()}
    shared = set().union(*attends.values())
    key = next(key for key in sorted(shared) if 0 < sum(key in keys for keys in attends.values()) < len(attends))
    x.v[0, 0, key] = poison
    expected, _ = x.oracle()
    hit = [head for head, keys in attends.items() if key in keys]
    missed = [head for head in attends if head not in hit]
    assert not torch.isfinite(expected[0, hit]).any() and torch.isfinite(expected[0, missed]).all()
    got, config = launch_variant(variant, x, block_k=32, changes={"chunk": chunk})
    assert config.chunk == chunk
    assert not torch.isfinite(got[0, hit]).any(), f"value {key} attended by heads {hit}: finite output"
    assert_close(got[0, missed], expected[0, missed], torch.float32, case.lkv, f"heads {missed} (key {key} unattended)")


@pytest.mark.parametrize("chunk", [0, -64, 128.0, True])
def test_grouped_decode_rejects_a_chunk_that_is_not_a_positive_int(chunk) -> None:
    """``chunk`` keys per span program: anything but a positive int raises a ValueError that names it."""
    from superlinear_ops.ops.staged_decode.grouped_kernels import grouped_decode_attention

    x = torch.zeros(1, 2, 1, 16)
    with pytest.raises(ValueError, match="chunk: expected a positive int"):
        grouped_decode_attention(x, x, x, x, torch.zeros(1, dtype=torch.int64), None, torch.zeros(1), torch.zeros(2),
                                 None, 4, 1, 8, chunk=chunk)

def test_oracle_gate_and_spans_follow_the_spec_by_hand() -> None:
    """One head worked by hand: W = 3 (int2, sw_index 1), t = 20, stripes i = 2..4 at 16, 11, 4."""
    power = oracle.Power.of(inv_search_power_int=2)
    params = oracle.DecodeParams(1, 2, 1.0, 0.0, 0.5, power)
    assert params.window == 3 and oracle.stripe_offsets(20, 1, power) == [4, 9, 16]
    k = torch.zeros(20, 2, dtype=torch.float64)
    k[16, 0], k[11, 0], k[4, 0] = 1.0, 3.0, 2.0
    v = torch.arange(40, dtype=torch.float64).view(20, 2)
    q1 = torch.tensor([1.0, 0.0], dtype=torch.float64)
    out, trace = oracle.decode_head(q1, torch.zeros(2, dtype=torch.float64), k, v, 19, lambda x: x != 11, params)
    # Stripe 11 is masked: anchors 4 (score 2) and 16 (score 1); back = ceil(1 * sqrt(20)) = 5.
    assert [(a, s, e) for _, a, s, e in trace.chosen] == [(4, 0, 4), (16, 11, 16)]
    gate = torch.softmax(torch.tensor([2.0, 1.0], dtype=torch.float64), 0)
    window = [17, 18, 19]
    first = v[[0, 1, 2, 3, 4] + window].mean(0)
    second = v[[12, 13, 14, 15, 16] + window].mean(0)  # 11 is masked
    torch.testing.assert_close(out, gate[0] * first + gate[1] * second)
