"""The whole layer's test cases and checks, shared by the layer and search-shape tests: small chunks
of every kind (powers, masks, ties, group sizes) run by the independent oracle, and checks of the anchors,
the tilings and the properties its traces must hold."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import oracle
import torch
from helpers import GRADIENT_SPREAD, assert_close, laid_out, poisoned_allocations

from superlinear_ops import geometry
from superlinear_ops.launch import KernelConfig
from superlinear_ops.ops.gate import EMPTY_SCORE
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
