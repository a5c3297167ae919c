"""The whole attention layer (semantics section 4: search, spans, span + window attention, gate) against the
independent float64 oracle: both registered search variants through the public composition, the
dispatched ``superlinear_attention``, the original-signature aliases and the input checks.

Search inputs are exact: Q1 in multiples of 1/8 and K in multiples of 1/4 (small), so every search
score is exact in fp32 and float64 alike, the anchors are deterministic and equal scores are real
ties (duplicate key rows). Each case asserts that it really has the properties it is meant to test.
"""

from __future__ import annotations

import dataclasses

import oracle
import pytest
import torch
from helpers import TRITON_SEARCHES, SearchSpies, assert_close, poisoned_allocations
from layer_cases import (
    CASES,
    FLOAT55,
    TILES,
    LayerCase,
    LayerInputs,
    api_kwargs,
    check_anchors,
    check_properties,
    check_result,
    check_tilings,
    launch_search,
    leaves_of,
    make_inputs,
    oracle_run,
    settings_of,
)

from superlinear_ops import layer_api, torch_ops
from superlinear_ops.ops.gate import EMPTY_SCORE
from superlinear_ops.ops.layer.composition import attention_layer
from superlinear_ops.registry import REGISTRY

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
