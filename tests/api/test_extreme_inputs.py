"""Extreme inputs: huge windows, non-finite values in keys and rows nobody uses (or
one row uses), gradients that must not go missing, and clear errors for the rest.

Every case compares with the independent float64 oracle (tests/oracle.py) on clean inputs, on the
reference path (float64) and on the Triton kernels (float32 under the interpreter, see conftest).
What a poisoned row or key does is docs/semantics.md, section 2; ``test_poisoned_*`` check exactly
that on every registered span variant.
"""

from __future__ import annotations

import math

import oracle
import pytest
import torch

from superlinear_ops import decode_span_attention_staged_gqa, fused_span_attention_gqa, layer_api, superlinear_attention
from superlinear_ops.launch import LaunchGeometry
from superlinear_ops.problem import SPAN_BACKWARD, SPAN_FORWARD, Problem
from superlinear_ops.registry import REGISTRY

INT2 = oracle.Power.of(inv_search_power_int=2)
PATHS = [torch.float32, torch.float64]  # the Triton kernels (interpreter) and the reference path
PATH_IDS = ["kernels", "reference"]


def _leaves(dtype: torch.dtype, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().to(dtype).requires_grad_() for t in tensors]


def _grad(t: torch.Tensor) -> torch.Tensor:
    """t's gradient in float64 (zeros where backward never reached t: the oracle skips unused Q1 rows)."""
    return (t.grad if t.grad is not None else torch.zeros_like(t)).double()


def _layer_inputs(seed: int, *, lq: int = 12, lkv: int = 40, dim: int = 16):
    gen = torch.Generator().manual_seed(seed)
    q1, q2 = (torch.randn(1, 2, lq, dim, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 1, lkv, dim, generator=gen) for _ in range(2))
    return q1, q2, k, v, gen


def _layer_grads(dtype, q1, q2, k, v, cp, mask, grad, **settings):
    leaves = _leaves(dtype, q1, q2, k, v)
    out = superlinear_attention(*leaves, cp, mask, **settings)
    out.backward(grad.to(dtype))
    return [out.detach().double()] + [_grad(t) for t in leaves]


def _oracle_layer(q1, q2, k, v, cp, mask, grad, params: oracle.DecodeParams):
    leaves = _leaves(torch.float64, q1, q2, k, v)
    out, _ = oracle.attention_layer(*leaves, cp, mask, params)
    out.backward(grad.double())
    return [out.detach()] + [_grad(t) for t in leaves]


def _assert_all_close(got, want, names=("O", "dQ1", "dQ2", "dK", "dV"), what=""):
    for name, g, w in zip(names, got, want):
        assert not g.isnan().any(), f"{what}{name} has NaN"
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=f"{what}{name}")


# --- windows of 2**31 keys and more -------------------------------------------------------------

HUGE_WINDOWS = [
    ("sw_index 46340 (W = 2**31 + 4631)", dict(sw_index=46340), oracle.Power.of(inv_search_power_int=2)),
    ("sw_index 2**31 - 2", dict(sw_index=2**31 - 2), oracle.Power.of(inv_search_power_int=2)),
    ("search power 0.02, sw_index 1 (W = 2**50 - 1)", dict(sw_index=1, search_power=0.02, inv_search_power_int=None),
     oracle.Power.of(search_power=0.02)),
]


@pytest.mark.parametrize("dtype", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("name,settings,power", HUGE_WINDOWS, ids=[c[0] for c in HUGE_WINDOWS])
def test_huge_window_layer_gives_the_oracle_gradients(name, settings, power, dtype) -> None:
    """A window longer than the keys covers every earlier key: the layer's output and all four
    gradients equal the oracle's (they were all zeros or 0.84 off when W wrapped to int32)."""
    q1, q2, k, v, gen = _layer_inputs(1)
    cp = torch.arange(28, 40)
    grad = torch.randn(q2.shape, generator=gen)
    params = oracle.DecodeParams(settings["sw_index"], 3, 2.0, 0.0, 0.5, power)
    assert params.window >= 2**31
    want = _oracle_layer(q1, q2, k, v, cp, None, grad, params)
    got = _layer_grads(dtype, q1, q2, k, v, cp, None, grad, topk=3, **settings)
    _assert_all_close(got, want, what=f"{name}: ")


@pytest.mark.parametrize("sw_index", [46339, 46340, 2**31 - 2])
def test_huge_window_span_op_every_variant(sw_index: int) -> None:
    """fused_span_attention_gqa with used span slots and W at or past 2**31 (46340 crashed the
    tensor-core forward): every forward and backward variant equals the oracle."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 4, 16, generator=gen)
    k, v = (torch.randn(1, 1, 24, 16, generator=gen) for _ in range(2))
    qstart = torch.randint(0, 6, (1, 2, 4, 2), generator=gen)
    qend = qstart + 4
    cp = torch.arange(20, 24)
    window = oracle.window_length(sw_index, INT2)
    grad = torch.randn(1, 2, 4, 2, 16, generator=gen)
    want_out, _ = oracle.span_forward(q, k, v, qstart, qend, cp, None, window)
    want = oracle.span_gradients(q, k, v, qstart, qend, cp, None, window, grad)
    out = fused_span_attention_gqa(q, k, v, qstart, qend, cp, None, sw_index=sw_index)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-4, atol=1e-5)
    problem = Problem.for_span(SPAN_FORWARD, q, k, 2, False, sw_index, "int2")
    for forward in _applicable(SPAN_FORWARD, problem):
        geo = LaunchGeometry.prepare(q, k, v, qstart, qend, cp, None, window)
        assert geo.window == k.shape[2], f"W {geo.window} not clamped to the {k.shape[2]} keys before the kernels"
        o, lse = forward.launch(geo, forward.default(problem))
        torch.testing.assert_close(o.double(), want_out, rtol=1e-4, atol=1e-5, msg=forward.qualified_name)
        for backward in _applicable(SPAN_BACKWARD, problem._replace(op=SPAN_BACKWARD)):
            grads = backward.launch(geo, backward.default(problem._replace(op=SPAN_BACKWARD)), o, lse, grad)
            _assert_all_close([g.double() for g in grads], want, ("dQ", "dK", "dV"),
                              f"{forward.qualified_name} + {backward.qualified_name}: ")


def _applicable(op: str, problem: Problem) -> list:
    return [v for v in REGISTRY.variants(op) if not v.not_supported_reasons(problem)]


def test_kernel_integers_are_made_to_fit_int32_in_one_place() -> None:
    """LaunchGeometry.prepare clamps the window to the keys and int64 span bounds and positions to
    [-1, Lkv] (exact: a start past the keys is an empty span, positions act as Lkv - 1)."""
    q, k = torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 10, 8)
    qstart = torch.tensor([2**40, -(2**40)]).view(1, 1, 1, 2)
    qend = torch.tensor([2**41, -(2**35)]).view(1, 1, 1, 2)
    geo = LaunchGeometry.prepare(q, k, k, qstart, qend, torch.tensor([2**33]), None, 2**45)
    assert geo.window == 10
    assert geo.qstart.flatten().tolist() == [10, -1] and geo.qend.flatten().tolist() == [10, -1]
    assert geo.cache_position.tolist() == [9] and geo.cache_position.dtype == torch.int32


# --- non-finite values nobody uses ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", PATHS, ids=PATH_IDS)
def test_nan_at_a_masked_key_zero_never_reaches_a_gradient(dtype) -> None:
    """Left padding (keys 0..2 masked), NaN in K[0] and V[0], queries with empty span slots: the
    output and every gradient equal the oracle's on clean inputs (dQ1 was NaN: an empty slot's anchor
    -1 read key 0)."""
    q1, q2, k, v, gen = _layer_inputs(3, lq=8, lkv=14)
    cp = torch.arange(6, 14)
    mask = torch.ones(1, 14, dtype=torch.bool)
    mask[0, :3] = False
    grad = torch.randn(q2.shape, generator=gen)
    params = oracle.DecodeParams(1, 3, 2.0, 0.0, 0.5, INT2)  # W = 3
    want = _oracle_layer(q1, q2, k, v, cp, mask, grad, params)
    bad_k, bad_v = k.clone(), v.clone()
    bad_k[0, :, 0], bad_v[0, :, 0] = math.nan, math.nan
    got = _layer_grads(dtype, q1, q2, bad_k, bad_v, cp, mask, grad, sw_index=1, topk=3)
    _, traces = oracle.attention_layer(q1, q2, k, v, cp, mask, params)
    assert any(len(t.chosen) < params.topk for t in traces.values())  # empty span slots exist
    _assert_all_close(got, want)
    assert torch.equal(got[3][0, :, :3], torch.zeros_like(got[3][0, :, :3]))  # masked keys: no gradient


@pytest.mark.parametrize("dtype", PATHS, ids=PATH_IDS)
def test_nan_in_a_q1_row_nobody_uses_never_reaches_a_gradient(dtype) -> None:
    """NaN in Q1 of a query with t <= W (no stripe, Q1 unused): the output and every gradient equal
    the oracle's on clean inputs, and that row's dQ1 is 0 (dK[0] was NaN)."""
    q1, q2, k, v, gen = _layer_inputs(4)
    cp = torch.arange(0, 12)  # W = 8: queries 0..7 have t <= W
    grad = torch.randn(q2.shape, generator=gen)
    params = oracle.DecodeParams(2, 2, 2.0, 1.0, 0.5, INT2)
    want = _oracle_layer(q1, q2, k, v, cp, None, grad, params)
    bad_q1 = q1.clone()
    bad_q1[0, 1, 3] = math.nan
    got = _layer_grads(dtype, bad_q1, q2, k, v, cp, None, grad, sw_index=2, topk=2, forward_factor=1.0)
    _assert_all_close(got, want)
    assert torch.equal(got[1][0, 1, 3], torch.zeros(16, dtype=torch.float64))


# --- poisoned rows and keys (docs/semantics.md, section 2) ----------------------------------------


def _span_case(seed: int):
    """Hq 2 over Hkv 1, 6 queries at 30..35 over 40 keys, W = 8, two spans each in [0, 20]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, 6, 16, generator=gen)
    k, v = (torch.randn(1, 1, 40, 16, generator=gen) for _ in range(2))
    qstart = torch.randint(0, 10, (1, 2, 6, 2), generator=gen)
    qend = qstart + torch.randint(0, 10, (1, 2, 6, 2), generator=gen)
    grad = torch.randn(1, 2, 6, 2, 16, generator=gen)
    return q, k, v, qstart, qend, torch.arange(30, 36), 8, grad


def _every_variant_pair(q, k, v, qstart, qend, cp, window, grad):
    """{(forward, backward): (out, dQ, dK, dV)} for every applicable forward and backward variant."""
    problem = Problem.for_span(SPAN_FORWARD, q, k, qstart.shape[-1], False, 2, "int2")
    results = {}
    for forward in _applicable(SPAN_FORWARD, problem):
        geo = LaunchGeometry.prepare(q, k, v, qstart, qend, cp, None, window)
        out, lse = forward.launch(geo, forward.default(problem))
        back_problem = problem._replace(op=SPAN_BACKWARD)
        for backward in _applicable(SPAN_BACKWARD, back_problem):
            grads = backward.launch(geo, backward.default(back_problem), out, lse, grad)
            results[forward.qualified_name, backward.qualified_name] = (out, *grads)
    assert len(results) >= 6  # tensor-core, per-query and reference forwards, each backward layout
    return results


@pytest.mark.parametrize("where", ["query row", "attended span key", "attended window key"])
def test_poisoned_rows_pass_no_gradient_on_every_variant(where: str) -> None:
    """NaN in one Q row, or in a K row that some spans attend: those (row, span) outputs are NaN, the
    others exact; the gradients are the oracle's with the poisoned outputs' gradients set to 0 and
    the NaN entries read as 0, on every forward + backward pair (the tensor-core backward spread NaN
    over all 40 keys of the group)."""
    q, k, v, qstart, qend, cp, window, grad = _span_case(5)
    clean_q, clean_k = q.clone(), k.clone()
    bad_q, bad_k = q.clone(), k.clone()
    if where == "query row":
        bad_q[0, 1, 2, 5] = math.nan
        clean_q[0, 1, 2, 5] = 0.0
        poisoned = torch.zeros(1, 2, 6, 2, dtype=torch.bool)
        poisoned[0, 1, 2] = True
    else:
        key = int(qstart[0, 0, 0, 0]) if where == "attended span key" else 33
        bad_k[0, 0, key, 7] = math.nan
        clean_k[0, 0, key, 7] = 0.0
        poisoned = torch.zeros(1, 2, 6, 2, dtype=torch.bool)
        for h in range(2):
            for i in range(6):
                for j in range(2):
                    keys = oracle.attended_keys(int(qstart[0, h, i, j]), int(qend[0, h, i, j]), 30 + i, 40, window,
                                                lambda x: True)
                    poisoned[0, h, i, j] = key in keys
        assert 0 < int(poisoned.sum()) < poisoned.numel()
    want_out, _ = oracle.span_forward(clean_q, clean_k, v, qstart, qend, cp, None, window)
    want = oracle.span_gradients(clean_q, clean_k, v, qstart, qend, cp, None, window,
                                 grad.masked_fill(poisoned[..., None], 0.0))
    for (forward, backward), (out, *grads) in _every_variant_pair(bad_q, bad_k, v, qstart, qend, cp, window, grad).items():
        what = f"{forward} + {backward}: "
        assert out[poisoned].isnan().all(), what + "a poisoned output must be NaN"
        torch.testing.assert_close(out[~poisoned].double(), want_out[~poisoned], rtol=1e-4, atol=1e-5, msg=what + "O")
        _assert_all_close([g.double() for g in grads], want, ("dQ", "dK", "dV"), what)


def test_nonfinite_attended_value_shows_in_the_output_and_dv_is_exact() -> None:
    """Inf in an attended V row: the outputs of the spans attending it are not finite (with the
    tensor-core forward also others of their tile); dV, which never reads V, is exact on every pair."""
    q, k, v, qstart, qend, cp, window, grad = _span_case(6)
    key = 33  # in the window of the queries at 33..35
    bad_v = v.clone()
    bad_v[0, 0, key, 2] = math.inf
    want = oracle.span_gradients(q, k, v, qstart, qend, cp, None, window, grad)
    for (forward, backward), (out, _, _, d_v) in _every_variant_pair(q, k, bad_v, qstart, qend, cp, window, grad).items():
        assert not torch.isfinite(out[0, :, 3:]).all(dim=-1).any(), forward
        torch.testing.assert_close(d_v.double(), want[2], rtol=1e-4, atol=1e-5, msg=f"{forward} + {backward}: dV")


# --- gradients that must not go missing -----------------------------------------------------------

DECODE = dict(sw_index=2, topk=2, backward_factor=2.0, forward_factor=1.0, span_power=0.5)


@pytest.mark.parametrize("dtype", PATHS, ids=PATH_IDS)
def test_decode_is_differentiable_on_every_path(dtype) -> None:
    """decode_span_attention_staged_gqa with inputs that require grad returns a differentiable output
    whose gradients equal the oracle's (the Triton path returned a detached output)."""
    gen = torch.Generator().manual_seed(7)
    q1, q2 = (torch.randn(1, 2, 1, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 1, 48, 16, generator=gen) for _ in range(2))
    cp, grad = torch.tensor([40]), torch.randn(1, 2, 1, 16, generator=gen)
    leaves = _leaves(torch.float64, q1, q2, k, v)
    want, _ = oracle.staged_decode(*leaves, cp, None, oracle.DecodeParams(2, 2, 2.0, 1.0, 0.5, INT2))
    want.backward(grad.double())
    got_leaves = _leaves(dtype, q1, q2, k, v)
    out = decode_span_attention_staged_gqa(*got_leaves, cp, None, **DECODE)
    assert out.requires_grad, "decode returned a detached output for inputs that require grad"
    try:
        out.backward(grad.to(dtype))
    except RuntimeError as err:  # e.g. a custom op without a backward
        raise AssertionError(f"decode's output cannot be differentiated: {err}") from None
    torch.testing.assert_close(out.detach().double(), want.detach(), rtol=1e-4, atol=1e-5)
    for name, got, expected in zip(("dQ1", "dQ2", "dK", "dV"), got_leaves, leaves):
        assert got.grad is not None and bool(got.grad.abs().sum() > 0), name
        torch.testing.assert_close(got.grad.double(), expected.grad, rtol=1e-4, atol=1e-5, msg=name)
    with torch.no_grad():  # no gradient asked for: the kernels, same numbers
        fast = decode_span_attention_staged_gqa(*got_leaves, cp, None, **DECODE)
    torch.testing.assert_close(fast.double(), want.detach(), rtol=1e-4, atol=1e-5)


EMPTY = {
    "layer Lq 0": lambda t: superlinear_attention(t[0][:, :, :0], t[1][:, :, :0], t[2], t[3], torch.arange(0), None),
    "layer B 0": lambda t: superlinear_attention(*(x[:0] for x in t), torch.arange(4), None),
    "span op Lq 0": lambda t: fused_span_attention_gqa(t[1][:, :, :0], t[2], t[3], torch.zeros(1, 2, 0, 3, dtype=torch.long),
                                                      torch.zeros(1, 2, 0, 3, dtype=torch.long), torch.arange(0)),
    "span op B 0": lambda t: fused_span_attention_gqa(t[1][:0], t[2][:0], t[3][:0], torch.zeros(0, 2, 4, 3, dtype=torch.long),
                                                     torch.zeros(0, 2, 4, 3, dtype=torch.long), torch.arange(4)),
    "decode B 0": lambda t: decode_span_attention_staged_gqa(*(x[:0, :, :1] if i < 2 else x[:0] for i, x in enumerate(t)),
                                                            torch.tensor([3]), None),
}


@pytest.mark.parametrize("dtype", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("name", list(EMPTY))
def test_empty_inputs_give_an_empty_result_connected_to_the_inputs(name: str, dtype) -> None:
    """B = 0 or Lq = 0 on every public op: an empty result whose backward runs and gives the inputs
    zero gradients (one rule everywhere; the span op refused Lq = 0 and the layer detached)."""
    leaves = [torch.randn(1, 2, 4, 8, dtype=dtype, requires_grad=True) for _ in range(2)]
    leaves += [torch.randn(1, 1, 6, 8, dtype=dtype, requires_grad=True) for _ in range(2)]
    out = EMPTY[name](leaves)
    assert out.numel() == 0, "the result must be empty"
    assert out.requires_grad and out.grad_fn is not None, "the empty result must be connected to the inputs"
    out.sum().backward()
    used = [t for t in leaves if t.grad is not None]
    assert used and all(torch.equal(t.grad, torch.zeros_like(t)) for t in used)


# --- exactness limits and clear errors ------------------------------------------------------------


def test_tiny_span_power_is_refused_where_span_lengths_cannot_be_exact() -> None:
    """span_power 1e-100 gave ceil(2 * d ** 1e-100) = 2 (exactly 3): such powers are refused, naming
    span_power; the smallest accepted one is exact (checked against the oracle's 80-digit ceiling)."""
    from superlinear_ops import geometry

    q1, q2, k, v, _ = _layer_inputs(8)
    for tiny in (1e-100, 1e-70, 0.0099):
        with pytest.raises(ValueError, match="span_power"):
            superlinear_attention(q1, q2, k, v, torch.arange(28, 40), None, sw_index=1, span_power=tiny)
    bases = list(range(0, 5000, 7))
    got = geometry.ceil_scaled_powers(2.0, bases, geometry.MIN_SPAN_POWER).tolist()
    assert got == [oracle.ceil_scaled(2.0, b, geometry.MIN_SPAN_POWER) if b else 0 for b in bases]


def test_huge_topk_is_clamped_to_the_stripes_before_anything_is_allocated() -> None:
    """topk 2**40 (the layer tried to allocate 562 TB, decode named 5.6e14 scores) and 10**7 (24.7 s
    on four keys): exact results at once, equal to topk = the number of stripes."""
    from superlinear_ops.settings import SpanSettings

    clamped = SpanSettings.checked(40, 1, 2**40, 2.0, 0.0, 0.5, None, 2).topk
    assert clamped == 5, f"topk 2**40 must be clamped to the 5 stripes of 40 keys (sw_index 1), got {clamped}"
    q1, q2, k, v, _ = _layer_inputs(9)
    cp = torch.arange(28, 40)
    want = superlinear_attention(q1, q2, k, v, cp, None, sw_index=1, topk=5)
    for topk in (2**40, 10**7):
        torch.testing.assert_close(superlinear_attention(q1, q2, k, v, cp, None, sw_index=1, topk=topk), want)
    args = (q1[:, :, :1], q2[:, :, :1], k, v, torch.tensor([39]), None)
    want = decode_span_attention_staged_gqa(*args, sw_index=1, topk=5)
    torch.testing.assert_close(decode_span_attention_staged_gqa(*args, sw_index=1, topk=2**40), want)


def test_double_backward_raises_one_clear_error() -> None:
    q1, q2, k, v, _ = _layer_inputs(10)
    leaves = _leaves(torch.float32, q1, q2, k, v)
    out = superlinear_attention(*leaves, torch.arange(28, 40), None, sw_index=1)
    grads = torch.autograd.grad(out.sum(), leaves, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward .* not supported"):
        sum(g.sum() for g in grads).backward()


@pytest.mark.parametrize("value,error", [(0, ValueError), (3.0, TypeError)])
@pytest.mark.parametrize("name", ["num_spans", "topk"])
def test_alias_errors_name_the_argument_the_caller_passed(name: str, value, error) -> None:
    q1, q2, k, v, _ = _layer_inputs(11)
    with pytest.raises(error, match=f"^{name} must be an int >= 1"):
        layer_api.fused_prefill_with_swtriton_bucketed_gqa(q1, q2, k, v, torch.arange(28, 40), **{name: value})


def test_key_cache_position_identity_is_accepted_and_anything_else_is_refused() -> None:
    """The original's non-GQA keyword-only arguments: tile hints ignored, key_cache_position the
    identity (per row or shared) gives the same result, anything else a ValueError that says so."""
    q1, q2, k, v, _ = _layer_inputs(12)
    cp = torch.arange(28, 40)
    want = layer_api.fused_prefill_with_swtriton(q1, q2, k, v, cp, None, 1, 3)
    hints = dict(sw_block_k=32, sw_block_m_dense=32, sw_num_warps=8, sw_num_stages=3, use_bf16_pv=False)
    for positions in (None, torch.arange(40), torch.arange(40)[None]):
        got = layer_api.fused_prefill_with_swtriton(q1, q2, k, v, cp, None, 1, 3, key_cache_position=positions, **hints)
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="key_cache_position other than the identity"):
        layer_api.fused_prefill_with_swtriton(q1, q2, k, v, cp, None, 1, 3, key_cache_position=torch.arange(40) + 5)
    with pytest.raises(ValueError, match="key_cache_position must be"):
        layer_api.fused_prefill_with_swtriton(q1, q2, k, v, cp, None, 1, 3, key_cache_position=torch.arange(39))
