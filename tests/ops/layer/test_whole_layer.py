"""The whole attention layer (semantics section 4: search, spans, span + window attention, gate) against the
independent float64 oracle: both registered search variants through the public composition, the
dispatched ``superlinear_attention``, the original-signature aliases and the input checks.

Search inputs are exact: Q1 in multiples of 1/8 and K in multiples of 1/4 (small), so every search
score is exact in fp32 and float64 alike, the anchors are deterministic and equal scores are real
ties (duplicate key rows). Each case asserts that it really has the properties it is meant to test.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import oracle
import pytest
import torch
from helpers import GRADIENT_SPREAD, TRITON_SEARCHES, SearchSpies, assert_close, laid_out, poisoned_allocations

from superlinear_ops import geometry, layer_api, torch_ops
from superlinear_ops.launch import KernelConfig
from superlinear_ops.ops.gate import EMPTY_SCORE
from superlinear_ops.ops.layer.composition import attention_layer
from superlinear_ops.ops.layer_search.reference import Found
from superlinear_ops.problem import Problem
from superlinear_ops.registry import REGISTRY
from superlinear_ops.settings import SpanSettings

INT2 = oracle.Power.of(inv_search_power_int=2)
FLOAT55 = oracle.Power.of(search_power=0.55)
INDEX_POISON = 1 << 40  # what an unwritten anchor slot holds (never a key, never -1)


@dataclass(frozen=True)
class LayerCase:
    name: str
    expect: tuple[str, ...]  # properties the case must really have (see check_properties)
    batch: int = 1
    hq: int = 2
    hkv: int = 1
    lq: int = 16
    lkv: int = 48
    start: int = 32  # cache_position = start .. start + lq - 1
    dim: int = 16
    sw_index: int = 1
    power: oracle.Power = INT2
    topk: int = 3
    bf: float = 2.0
    ff: float = 0.0
    sp: float = 0.5
    mask: str = "none"  # none | left-pad (B rows padded differently, int mask) | static (bool, tail and a hole masked)
    #                     | padded-holes (left-pad with holes past each row's padding, int mask)
    ties: bool = False  # key rows drawn from a pool of 3 (equal scores at many stripes)
    scattered: bool = False  # int32 positions in random order, a repeat, one past the last key; Q transposed, K/V strided
    dtype: torch.dtype = torch.float32

    @property
    def params(self) -> oracle.DecodeParams:
        return oracle.DecodeParams(self.sw_index, self.topk, self.bf, self.ff, self.sp, self.power)


CASES = [
    # rep 2, int2 W 3, chunk 44..63 over a cached prefix, topk 3, ties at the top-k boundary
    LayerCase("ties-mid-chunk", ("tie", "mid"), lq=20, lkv=64, start=44, ties=True),
    # rep 4, int2 W 8, training-like 0..35: t <= W rows inside the chunk, 1-3 stripes for topk 4, a stripe at key 0, ff > 0
    LayerCase("window-boundary", ("short", "fewer", "key0"), hq=4, lq=36, lkv=36, start=0, sw_index=2, topk=4, ff=0.5),
    # MHA, B 2 with different left padding, float power 0.55 (W 6), topk 2, ff 1, spans from t - s
    LayerCase("left-padding", ("padding", "masked-stripe", "short"), batch=2, hq=2, hkv=2, lq=40, lkv=40, start=0,
              sw_index=2, power=FLOAT55, topk=2, bf=3.0, ff=1.0, sp=0.55, mask="left-pad"),
    # static cache: 96 keys, prefix of 60 filled (tail masked, one hole), chunk 48..59, topk 2, ties
    LayerCase("static-cache-masked", ("static", "mid", "masked-stripe", "tie"), lq=12, lkv=96, start=48, topk=2,
              mask="static", ties=True),
    # static cache without a mask, no window (sw_index 0, float power), topk 1, ff > 0, rep 2 over 2 KV heads
    LayerCase("static-no-window", ("static", "mid", "no-window"), hq=4, hkv=2, lq=16, lkv=64, start=20, sw_index=0,
              power=FLOAT55, topk=1, ff=0.7),
    # any cache_position (int32, unordered, repeated, past Lkv - 1: clamped), model-like layouts, ties, ff > 0
    LayerCase("scattered-positions", ("scattered", "tie"), hq=4, hkv=2, lq=20, lkv=48, sw_index=2, power=FLOAT55, ff=0.5,
              ties=True, scattered=True),
    # B 2 with different left padding and holes, a chunk mid-cache, topk 5 > the valid stripes of most queries, ties
    LayerCase("padded-holes-fewer", ("fewer", "holes", "masked-stripe", "mid"), batch=2, hq=4, hkv=2, lq=12,
              lkv=64, start=30, sw_index=2, topk=5, bf=3.0, ff=1.0, mask="padded-holes", ties=True),
    # bf16, rep 2, float power W 6, ties, topk 3
    LayerCase("bf16-ties", ("tie", "mid"), hq=4, hkv=2, lq=16, lkv=48, start=32, sw_index=2, power=FLOAT55,
              ties=True, dtype=torch.bfloat16),
]
PADS = (3, 11)  # left padding of the two batch rows (left-pad and padded-holes masks)
HOLES = (14, 17, 22, 26)  # keys hidden past the padding (padded-holes mask): under stripes of chunk queries


@dataclass(frozen=True)
class LayerInputs:
    q1: torch.Tensor
    q2: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cache_position: torch.Tensor
    mask: torch.Tensor | None
    grad_out: torch.Tensor
    layouts: tuple[str, ...] = ("contiguous",) * 4  # how the op sees (Q1, Q2, K, V): helpers.laid_out

    def arranged(self, q1, q2, k, v) -> list[torch.Tensor]:
        """(Q1, Q2, K, V) in this input's memory layouts (differentiable views/copies)."""
        return [laid_out(t, layout) for t, layout in zip((q1, q2, k, v), self.layouts)]


def make_inputs(case: LayerCase, gen: torch.Generator) -> LayerInputs:
    b, hq, hkv, d = case.batch, case.hq, case.hkv, case.dim
    q1 = (torch.randn(b, hq, case.lq, d, generator=gen) * 2).round() / 8
    k = (torch.randn(b, hkv, case.lkv, d, generator=gen) * 4).round() / 4
    if case.ties:
        pool = (torch.randn(3, d, generator=gen) * 4).round() / 4
        pick = torch.randint(0, 3, (b, hkv, case.lkv), generator=gen)
        dup = torch.rand(b, hkv, case.lkv, generator=gen) < 0.6
        k = torch.where(dup[..., None], pool[pick], k)
    q2 = torch.randn(b, hq, case.lq, d, generator=gen)
    v = torch.randn(b, hkv, case.lkv, d, generator=gen)
    grad_out = torch.randn(b, hq, case.lq, d, generator=gen)
    mask = None
    if case.mask in ("left-pad", "padded-holes"):
        mask = torch.ones(b, case.lkv + 3, dtype=torch.int64)
        for row, pad in enumerate(PADS):
            mask[row, :pad] = 0
        if case.mask == "padded-holes":
            mask[:, list(HOLES)] = 0
    elif case.mask == "static":
        mask = torch.ones(b, case.lkv, dtype=torch.bool)
        mask[:, case.start + case.lq:] = False
        mask[:, 15] = False  # a hole under some stripes
    cache_position = torch.arange(case.start, case.start + case.lq)
    q1, q2, k, v = (t.to(case.dtype) for t in (q1, q2, k, v))
    if case.scattered:
        cache_position = torch.randint(0, case.lkv, (case.lq,), generator=gen, dtype=torch.int32)
        cache_position[:3] = torch.tensor([case.lkv + 5, 30, 30])
    layouts = ("transposed", "transposed", "strided", "strided") if case.scattered else ("contiguous",) * 4
    return LayerInputs(q1, q2, k, v, cache_position, mask, grad_out.to(case.dtype), layouts)


def oracle_run(case: LayerCase, x: LayerInputs):
    """(out, (dQ1, dQ2, dK, dV), traces) in float64."""
    leaves = [t.detach().double().requires_grad_() for t in (x.q1, x.q2, x.k, x.v)]
    out, traces = oracle.attention_layer(*leaves, x.cache_position, x.mask, case.params)
    return out.detach(), torch.autograd.grad(out, leaves, x.grad_out.double()), traces


def check_properties(case: LayerCase, x: LayerInputs, traces: dict) -> None:
    """Assert that the case really exercises what it claims to."""
    topk, window = case.topk, case.params.window
    live = [tr for tr in traces.values() if not tr.short_prefix]
    assert live or case.expect == ("short",), f"{case.name}: every query is a short prefix"
    for prop in case.expect:
        if prop == "tie":  # equal scores across the top-k boundary: the larger-i rule decides the anchor set
            assert any(len(tr.candidates) > topk and tr.candidates[topk - 1][0] == tr.candidates[topk][0] for tr in live), prop
        elif prop == "fewer":
            assert any(0 < len(tr.candidates) < topk for tr in live), prop
        elif prop == "short":  # the chunk spans the window boundary
            assert any(tr.short_prefix for tr in traces.values()) and live, prop
        elif prop == "mid":
            assert int(x.cache_position[0]) > 0, prop
        elif prop == "static":
            assert case.lkv > int(x.cache_position[-1]) + 1, prop
        elif prop == "key0":
            assert any(0 in tr.anchors for tr in live), prop
        elif prop == "scattered":
            cp = x.cache_position
            assert cp.dtype == torch.int32 and len(set(cp.tolist())) < case.lq and int(cp.max()) >= case.lkv, prop
            q1, _, k, _ = x.arranged(x.q1, x.q2, x.k, x.v)
            assert bool((cp[1:] < cp[:-1]).any()) and not q1.is_contiguous() and k.stride(-1) == 2, prop
        elif prop == "no-window":
            assert window == 0, prop
        elif prop == "masked-stripe":  # some stripe lands on a masked key (and is skipped)
            allowed = x.mask != 0
            offsets = oracle.stripe_offsets(case.lkv, case.sw_index, case.power)
            assert any(not allowed[b, tr.t - o] for (b, _, _), tr in traces.items() if not tr.short_prefix
                       for o in offsets if 0 <= tr.t - o), prop
        elif prop == "holes":  # B rows padded differently, and keys hidden past each row's first allowed key
            firsts = {b: tr.first_allowed for (b, _, _), tr in traces.items()}
            assert case.batch == 2 and len(set(firsts.values())) == 2, prop
            assert all(not bool(x.mask[b, firsts[b]:].all()) for b in firsts), prop
        elif prop == "padding":  # rows start at different keys, and some span start depends on t - s (not t)
            firsts = {tr.first_allowed for tr in traces.values()}
            assert case.batch == 2 and len(firsts) == 2 and max(firsts) > 0, prop
            assert any(start > tr.first_allowed and start != a - oracle.ceil_scaled(case.bf, tr.t, case.sp)
                       for tr in live for a, start, _ in tr.chosen), prop
        else:
            raise AssertionError(f"unknown property {prop}")


@contextlib.contextmanager
def poisoned_indices():
    """torch.empty gives integer tensors filled with INDEX_POISON (their dtype's largest value where
    it does not fit) inside the block (floats: NaN)."""
    with poisoned_allocations():
        inner = torch.empty

        def empty(*args, **kwargs):
            t = inner(*args, **kwargs)
            if t.is_floating_point() or t.dtype == torch.bool:
                return t
            return t.fill_(min(INDEX_POISON, torch.iinfo(t.dtype).max))

        torch.empty = empty
        try:
            yield
        finally:
            torch.empty = inner


def api_kwargs(case: LayerCase) -> dict:
    return dict(sw_index=case.sw_index, topk=case.topk, backward_factor=case.bf, forward_factor=case.ff,
                span_power=case.sp, **case.power.kwargs())


def settings_of(case: LayerCase) -> SpanSettings:
    params = geometry.power_params(**case.power.kwargs())
    return SpanSettings(case.sw_index, case.topk, case.bf, case.ff, case.sp, params).for_keys(case.lkv)


def problem_of(case: LayerCase, x: LayerInputs) -> Problem:
    label = geometry.power_params(**case.power.kwargs()).label
    return Problem.for_layer(x.q1, x.k, case.topk, x.mask is not None, case.sw_index, label, (case.bf, case.ff, case.sp))


def launch_search(variant, case: LayerCase, x: LayerInputs, config: KernelConfig | None = None) -> Found:
    """The variant's anchors and scores (unwritten slots would hold INDEX_POISON and NaN)."""
    problem = problem_of(case, x)
    assert not variant.not_supported_reasons(problem), variant.not_supported_reasons(problem)
    config = variant.default(problem) if config is None else config
    with poisoned_indices():
        q1, _, k, _ = x.arranged(x.q1, x.q2, x.k, x.v)
        return variant.launch(q1, k, x.cache_position, x.mask, settings_of(case), config)


def check_anchors(found: Found, traces: dict, case: LayerCase, what: str) -> None:
    """The anchor SETS equal the oracle's (slot order is unspecified); empty slots are -1. Slot by
    slot, each score is the oracle's float64 Q1 . K[anchor] (EMPTY_SCORE exactly for an empty slot)."""
    anchors, scores = found
    slots = settings_of(case).topk
    assert anchors.dtype == torch.int64 and anchors.shape == (case.batch, case.hq, case.lq, slots), f"{what}: {anchors.shape}"
    assert scores.shape == anchors.shape and scores.dtype == (torch.float64 if case.dtype == torch.float64 else torch.float32)
    assert bool(((anchors >= -1) & (anchors < case.lkv)).all()), f"{what}: anchors out of range (unwritten slot?)"
    rows, score_rows = anchors.tolist(), scores.double().tolist()
    for (b, h, q), tr in traces.items():
        got = rows[b][h][q]
        assert sorted(a for a in got if a >= 0) == tr.anchors and got.count(-1) == slots - len(tr.chosen), (
            f"{what}: (b={b}, h={h}, q={q}, t={tr.t}): anchors {sorted(got)} != oracle {tr.anchors} "
            f"(stripes best first as (score, i, key): {tr.candidates[: case.topk + 2]})"
        )
        exact = {key: score for score, _, key in tr.candidates}
        scale = max(1e-30, sum(score * score for score in exact.values()) / max(1, len(exact))) ** 0.5
        for anchor, score in zip(got, score_rows[b][h][q]):
            want = exact[anchor] if anchor >= 0 else EMPTY_SCORE
            assert abs(score - want) <= 1e-4 * (abs(want) + scale), (
                f"{what}: (b={b}, h={h}, q={q}): score {score} of anchor {anchor} != oracle {want}")


def check_result(case: LayerCase, out, grads, expected, expected_grads, what: str) -> None:
    assert out.dtype == case.dtype
    assert_close(out, expected, case.dtype, case.lkv, f"{what} out")
    for name, got, want in zip(("dQ1", "dQ2", "dK", "dV"), grads, expected_grads):
        assert got.dtype == case.dtype
        if not want.any():  # e.g. dQ1 with one slot (the gate is 1) or only short prefixes
            assert torch.equal(got, torch.zeros_like(got)), f"{what} {name}: must be zero"
            continue
        assert_close(got, want, case.dtype, case.lkv, f"{what} {name}", spread=GRADIENT_SPREAD)


def leaves_of(x: LayerInputs) -> list[torch.Tensor]:
    """Contiguous leaves (the gradients are taken against them); pass ``x.arranged(*leaves)`` to the op."""
    return [t.detach().clone().requires_grad_() for t in (x.q1, x.q2, x.k, x.v)]


LAYER_VARIANTS = REGISTRY.variants("attention_layer")
CASE_IDS = [c.name for c in CASES]


def test_every_search_variant_is_registered() -> None:
    assert {v.name for v in LAYER_VARIANTS} >= {*TRITON_SEARCHES, "reference"}


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("variant", LAYER_VARIANTS, ids=[v.name for v in LAYER_VARIANTS])
def test_variant_matches_oracle(variant, case: LayerCase, gen: torch.Generator, search_spy: SearchSpies) -> None:
    """One search variant (default tiles) through the public composition: anchors, output and all four
    gradients against the float64 oracle; every buffer allocated with torch.empty starts poisoned."""
    x = make_inputs(case, gen)
    expected, expected_grads, traces = oracle_run(case, x)
    check_properties(case, x, traces)
    if any(len(tr.chosen) > 1 for tr in traces.values()):
        assert expected_grads[0].abs().max() > 1e-2, "the gate must carry a gradient into Q1"
    found = launch_search(variant, case, x)
    triton_search = variant.name in TRITON_SEARCHES
    assert search_spy.launches == triton_search, "the variant's own search must run (not a fallback)"
    assert not triton_search or search_spy[variant.name].launches == 1, f"{variant.name}: its kernel must run"
    check_anchors(found, traces, case, variant.name)

    leaves = leaves_of(x)
    q1, q2, k, v = x.arranged(*leaves)
    settings = settings_of(case)

    def span_attention(qstart, qend):
        return torch_ops.span_forward(q2, k, v, qstart, qend, x.cache_position, x.mask, case.sw_index,
                                      *case.power.kwargs().values(), 0)[0]

    with poisoned_allocations():
        out = attention_layer(q1, k, found.anchors, x.cache_position, x.mask, settings, span_attention, q2.dtype,
                              torch_ops.LAYER_STEPS, search_scores=found.scores)
        grads = torch.autograd.grad(out, leaves, x.grad_out, allow_unused=True)
    assert all(g is not None for g in grads), "every input must reach the output through autograd (Q1 via the gate scores)"
    check_result(case, out, grads, expected, expected_grads, variant.name)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_superlinear_attention_matches_oracle(case: LayerCase, gen: torch.Generator, search_spy: SearchSpies) -> None:
    """The dispatched public op (the Triton search under the interpreter), output and gradients."""
    x = make_inputs(case, gen)
    expected, expected_grads, traces = oracle_run(case, x)
    check_properties(case, x, traces)
    leaves = leaves_of(x)
    with poisoned_allocations():
        out = layer_api.superlinear_attention(*x.arranged(*leaves), x.cache_position, x.mask, **api_kwargs(case), validate=True)
        grads = torch.autograd.grad(out, leaves, x.grad_out)
    assert search_spy.launches == 1, "the dispatcher must run the Triton search on CPU tensors under the interpreter"
    check_result(case, out, grads, expected, expected_grads, "superlinear_attention")


@pytest.mark.parametrize("case", CASES[::3], ids=CASE_IDS[::3])
def test_forward_without_gradient_takes_the_search_scores(case: LayerCase, gen: torch.Generator,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """With nothing to differentiate the public op's gate scores are the search's (the gate-score
    op must not run), and the output still matches the float64 oracle."""
    x = make_inputs(case, gen)
    expected, _, _ = oracle_run(case, x)

    def no_gate_scores(*args):
        raise AssertionError("the gate scores were recomputed although the search returned them")

    monkeypatch.setitem(torch_ops._IMPLEMENTATIONS, torch_ops.layer_gate_scores, no_gate_scores)
    with torch.no_grad(), poisoned_allocations():
        out = layer_api.superlinear_attention(*x.arranged(x.q1, x.q2, x.k, x.v), x.cache_position, x.mask,
                                              **api_kwargs(case))
    assert out.dtype == case.dtype
    assert_close(out, expected, case.dtype, case.lkv, "superlinear_attention without gradient")


TILES = {  # per Triton search: tilings over its default config (partial head and query blocks, extremes)
    "tiled_search": [dict(block_q=16, block_h=1), dict(block_q=32, block_h=2), dict(block_q=16, block_h=4)],
    "stripe_tiles": [dict(block_s=16, block_h=1, block_q=16), dict(block_s=128, block_h=2, block_q=8, num_warps=8),
                     dict(block_s=16, block_h=4, block_q=4), dict(block_s=32, block_h=1, block_q=16, num_warps=1)],
}


def check_tilings(name: str, case: LayerCase, x: LayerInputs, traces: dict, tilings: list[dict]) -> int:
    """Each tiling over the Triton search ``name``'s default config that compiles for this problem gives
    the oracle's anchor sets; returns how many ran."""
    variant = REGISTRY.get("attention_layer", name)
    problem = problem_of(case, x)
    default = variant.default(problem)
    tried = 0
    for tiles in tilings:
        config = default.replace(**tiles)
        assert variant.contains(config), config.text()
        if variant.compile_check(problem, config) is None:
            check_anchors(launch_search(variant, case, x, config), traces, case, f"{name} {config.text()}")
            tried += 1
    return tried


@pytest.mark.parametrize("case", [c for c in CASES if c.ties or c.hq // c.hkv == 4], ids=lambda c: c.name)
@pytest.mark.parametrize("name", sorted(TILES))
def test_search_tiles_give_the_oracle_anchor_sets(name: str, case: LayerCase, gen: torch.Generator,
                                                  search_spy: SearchSpies) -> None:
    """A Triton search with several tilings (partial head and query blocks) picks exactly the
    oracle's anchor sets, ties included."""
    x = make_inputs(case, gen)
    _, traces = oracle.attention_layer(x.q1, x.q2, x.k, x.v, x.cache_position, x.mask, case.params)
    check_properties(case, x, traces)
    tried = check_tilings(name, case, x, traces, TILES[name])
    assert search_spy[name].launches == tried >= 2


@pytest.mark.parametrize("topk", [1, 2, 3, 4])
def test_every_topk_picks_the_oracle_anchor_sets(topk: int, gen: torch.Generator) -> None:
    """Both search variants at topk 1..4 on tied keys (ties at the boundary for each topk)."""
    case = LayerCase("topk", ("tie",), hq=4, hkv=2, lq=24, lkv=64, start=40, topk=topk, ties=True)
    x = make_inputs(case, gen)
    _, traces = oracle.attention_layer(x.q1, x.q2, x.k, x.v, x.cache_position, x.mask, case.params)
    check_properties(case, x, traces)
    for variant in LAYER_VARIANTS:
        check_anchors(launch_search(variant, case, x), traces, case, variant.name)


def test_searches_read_strided_positions(gen: torch.Generator) -> None:
    """Every search variant takes cache_position as a strided view (every other entry of a wider
    tensor) and finds the oracle's anchors and scores."""
    case = CASES[0]
    x = make_inputs(case, gen)
    _, traces = oracle.attention_layer(x.q1, x.q2, x.k, x.v, x.cache_position, x.mask, case.params)
    strided = x.cache_position.repeat_interleave(2)[::2]
    assert strided.stride(0) == 2 and torch.equal(strided, x.cache_position)
    x = dataclasses.replace(x, cache_position=strided)
    for variant in LAYER_VARIANTS:
        check_anchors(launch_search(variant, case, x), traces, case, variant.name)


def test_short_prefix_chunk_is_causal_attention(gen: torch.Generator) -> None:
    """Every t <= W: O is plain causal attention over [0, pos] (checked against SDPA, independently
    of the oracle) and Q1 gets no gradient."""
    case = LayerCase("short", ("short",), hq=4, hkv=2, lq=14, lkv=20, start=0, sw_index=3)  # W 15
    x = make_inputs(case, gen)
    assert int(x.cache_position[-1]) + 1 <= case.params.window
    leaves = leaves_of(x)
    out = layer_api.superlinear_attention(*leaves, x.cache_position, x.mask, **api_kwargs(case))
    grads = torch.autograd.grad(out, leaves, x.grad_out)
    rep = case.hq // case.hkv
    k = x.k.double().repeat_interleave(rep, 1)[:, :, : case.lq]
    v = x.v.double().repeat_interleave(rep, 1)[:, :, : case.lq]
    expected = torch.nn.functional.scaled_dot_product_attention(x.q2.double(), k, v, is_causal=True)
    assert_close(out, expected, torch.float32, case.lq, "short prefix")
    assert torch.equal(grads[0], torch.zeros_like(grads[0])), "no stripe, no gate: dQ1 = 0"
    assert torch.equal(grads[2][:, :, case.lq:], torch.zeros_like(grads[2][:, :, case.lq:])), "keys past pos get no gradient"


def test_float64_matches_oracle(gen: torch.Generator, monkeypatch) -> None:
    """float64 inputs run the reference search and span ops: the oracle's numbers to float64 rounding.
    Their spans come from the tensor ops, never through ``layer_spans``'s GPU path (the references
    the tuner checks candidates against stay PyTorch)."""
    def gpu_path(*args):
        raise AssertionError("the float64 layer reached layer_spans's GPU path")

    monkeypatch.setattr(torch_ops, "anchor_spans", gpu_path)
    case = LayerCase("fp64", ("tie", "mid"), lq=12, lkv=48, start=36, ties=True, dtype=torch.float64)
    x = make_inputs(case, gen)
    expected, expected_grads, traces = oracle_run(case, x)
    check_properties(case, x, traces)
    leaves = leaves_of(x)
    out = layer_api.superlinear_attention(*leaves, x.cache_position, x.mask, **api_kwargs(case))
    grads = torch.autograd.grad(out, leaves, x.grad_out)
    check_result(case, out, grads, expected, expected_grads, "float64")


ALIAS_CASE = LayerCase("alias", (), hq=4, hkv=2, lq=12, lkv=40, start=28, sw_index=2, power=FLOAT55, topk=2, bf=3.0,
                       ff=1.0, sp=0.55, mask="static")


def test_original_signature_aliases_equal_superlinear_attention(gen: torch.Generator) -> None:
    """prefill / prefill_gqa / prefill_mha / fused_prefill_with_swtriton(_gqa, _bucketed_gqa): positional
    like the original (tile hints ignored), cache_pos= or cache_position=, num_spans or topk=."""
    case = ALIAS_CASE
    x = make_inputs(case, gen)
    args = (x.q1, x.q2, x.k, x.v)
    p = case.power.kwargs()
    want = layer_api.superlinear_attention(*args, x.cache_position, x.mask, **api_kwargs(case))
    other = layer_api.superlinear_attention(*args, x.cache_position, x.mask, **{**api_kwargs(case), "topk": 3})
    assert not torch.equal(want, other), "topk must matter for this case"
    tail = (case.bf, case.ff, case.sp, p["search_power"], p["inv_search_power_int"])
    calls = {
        "prefill": lambda: layer_api.prefill(*args, x.cache_position, x.mask, case.sw_index, case.topk, 64, 128, *tail),
        "prefill_mha": lambda: layer_api.prefill_mha(*args, x.cache_position, x.mask, case.sw_index, case.topk, 16, 32, *tail),
        "prefill topk=": lambda: layer_api.prefill(*args, x.cache_position, x.mask, case.sw_index, 7, 64, 128, *tail, topk=case.topk),
        "prefill_gqa": lambda: layer_api.prefill_gqa(*args, x.cache_position, x.mask, case.sw_index, case.topk, 64, 128, *tail),
        "gqa cache_pos=": lambda: layer_api.fused_prefill_with_swtriton_gqa(
            *args, cache_pos=x.cache_position, attention_mask=x.mask, sw_index=case.sw_index, num_spans=case.topk,
            backward_factor=case.bf, forward_factor=case.ff, span_power=case.sp, **p),
        "gqa cache_position=": lambda: layer_api.fused_prefill_with_swtriton_gqa(
            *args, attention_mask=x.mask, sw_index=case.sw_index, num_spans=case.topk, backward_factor=case.bf,
            forward_factor=case.ff, span_power=case.sp, **p, cache_position=x.cache_position),
        "gqa cache_position= wins": lambda: layer_api.fused_prefill_with_swtriton_gqa(
            *args, torch.zeros_like(x.cache_position), x.mask, case.sw_index, 1, 64, 128, *tail,
            cache_position=x.cache_position, topk=case.topk),
        "fused_prefill_with_swtriton": lambda: layer_api.fused_prefill_with_swtriton(
            *args, x.cache_position, x.mask, case.sw_index, case.topk, 64, 128, *tail),
        "bucketed_gqa": lambda: layer_api.fused_prefill_with_swtriton_bucketed_gqa(
            *args, x.cache_position, x.mask, case.sw_index, case.topk, 64, 128, *tail),
    }
    for name, call in calls.items():
        assert torch.equal(call(), want), name
    assert torch.equal(layer_api.fused_prefill_with_swtriton_gqa(*args, x.cache_position, x.mask, case.sw_index, 3, 64,
                                                                 128, *tail), other), "num_spans"
    with pytest.raises(TypeError, match="cache_pos"):
        layer_api.fused_prefill_with_swtriton_gqa(*args, attention_mask=x.mask)


def _bad(x: LayerInputs, **changes):
    kwargs = dict(Q1=x.q1, Q2=x.q2, K=x.k, V=x.v, cache_position=x.cache_position, attention_mask=x.mask)
    kwargs.update(changes)
    return kwargs


BAD_INPUTS = [
    ("Q1 shape", lambda x: _bad(x, Q1=x.q1[:, :, :-1]), ValueError, "Q1"),
    ("Q1 dtype", lambda x: _bad(x, Q1=x.q1.double()), TypeError, "Q1"),
    ("topk 0", lambda x: _bad(x, topk=0), ValueError, "topk"),
    ("topk float", lambda x: _bad(x, topk=2.0), TypeError, "topk"),
    ("cache_position length", lambda x: _bad(x, cache_position=x.cache_position[:-1]), ValueError, "cache_position"),
    ("cache_position float", lambda x: _bad(x, cache_position=x.cache_position.float()), TypeError, "cache_position"),
    ("float mask", lambda x: _bad(x, attention_mask=x.mask.float()), TypeError, "attention_mask"),
    ("short mask", lambda x: _bad(x, attention_mask=x.mask[:, :-1]), ValueError, "attention_mask"),
    ("V shape", lambda x: _bad(x, V=x.v[:, :, :-1]), ValueError, "V"),
    ("sw_index", lambda x: _bad(x, sw_index=-1), ValueError, "sw_index"),
    ("span_power", lambda x: _bad(x, span_power=1.5), ValueError, "span_power"),
    ("backward_factor", lambda x: _bad(x, backward_factor=-1.0), ValueError, "backward_factor"),
    ("forward_factor", lambda x: _bad(x, forward_factor=float("nan")), ValueError, "forward_factor"),
    ("both powers", lambda x: _bad(x, search_power=0.5, inv_search_power_int=2), ValueError, "search_power"),
    ("negative position", lambda x: _bad(x, cache_position=x.cache_position - 40, validate=True), ValueError, "cache_position"),
]


@pytest.mark.parametrize("build,error,name", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_raise_naming_the_argument(build, error, name: str, gen: torch.Generator) -> None:
    x = make_inputs(ALIAS_CASE, gen)
    with pytest.raises(error, match=name):
        layer_api.superlinear_attention(**build(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["triton", "pytorch"])
def test_gate_scores_op_matches_a_gather_and_gives_empty_slots_no_gradient(dtype) -> None:
    """The gate-score op alone, with an arbitrary upstream gradient (empty slots included): the
    float32 inputs run the Triton kernels (interpreter), float64 the PyTorch path."""
    from superlinear_ops.ops.gate import EMPTY_SCORE
    from superlinear_ops.torch_ops import layer_gate_scores as gate_scores

    gen = torch.Generator().manual_seed(11)
    q1 = torch.randn(2, 4, 5, 24, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, 9, 24, generator=gen, dtype=dtype, requires_grad=True)
    anchors = torch.randint(-1, 9, (2, 4, 5, 3), generator=gen)
    assert (anchors < 0).any() and (anchors >= 0).any()
    grad = torch.randn(anchors.shape, generator=gen, dtype=torch.float64)
    scores = gate_scores(q1, k, anchors)
    got = torch.autograd.grad(scores, (q1, k), grad.to(scores.dtype))
    q64, k64 = (t.detach().double().requires_grad_() for t in (q1, k))
    rows = k64[torch.arange(2)[:, None, None, None], (torch.arange(4) // 2)[None, :, None, None], anchors.clamp(min=0)]
    expected = torch.where(anchors >= 0, (rows * q64[..., None, :]).sum(-1), torch.full(anchors.shape, EMPTY_SCORE, dtype=torch.float64))
    want = torch.autograd.grad(expected, (q64, k64), grad)
    torch.testing.assert_close(scores.double(), expected, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)
