"""Public API: numeric checks of every entry point against the independent oracle, autograd,
backends, validation (one test per bad-input class), drop-in signatures, no host synchronisation."""

from __future__ import annotations

import inspect
import pathlib
import re

import oracle
import pytest
import torch
from cases import SpanCase, make_span_inputs
from helpers import GRADIENT_SPREAD, assert_close

import superlinear_ops
from superlinear_ops import decode_span_attention_staged_gqa, dispatch, fused_span_attention_gqa
from superlinear_ops.ops.span_attention.reference import span_forward_reference
from superlinear_ops.problem import Problem

GQA = SpanCase("fp32", 2, hkv=2)  # B 1, Hq 4, Hkv 2, Lq 3, Lkv 160, D 16, K 2, W 35
MHA = SpanCase("fp32", 1, hkv=2)
B, HQ, HKV, LQ, LKV, D, NSPANS, SW = 1, 4, 2, 3, 160, 16, 2, GQA.sw_index


def span_inputs(gen: torch.Generator, dtype=torch.float32, case: SpanCase = GQA):
    x = make_span_inputs(case, gen)
    cast = (t.to(dtype) for t in (x.q, x.k, x.v))
    return (*cast, x.qstart, x.qend, x.cache_position, x.mask)


@pytest.mark.parametrize("entry", ["fused_span_attention_gqa", "span_attention_gqa", "fused_span_attention", "span_attention"])
def test_every_span_entry_point_matches_the_oracle_with_gradients(entry: str, gen: torch.Generator) -> None:
    case = MHA if "gqa" not in entry else GQA
    q, k, v, qstart, qend, cache_position, mask = span_inputs(gen, case=case)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = getattr(superlinear_ops, entry)(*leaves, qstart, qend, cache_position, mask, case.sw_index)
    grad = torch.randn(out.shape, generator=gen)
    out.backward(grad)
    expected, _ = oracle.span_forward(q, k, v, qstart, qend, cache_position, mask, case.window)
    assert_close(out, expected, torch.float32, LKV, "out")
    grads = oracle.span_gradients(q, k, v, qstart, qend, cache_position, mask, case.window, grad)
    for name, leaf, want in zip("QKV", leaves, grads):
        assert_close(leaf.grad, want, torch.float32, LKV, f"d{name}", spread=GRADIENT_SPREAD)


def test_reference_autograd_passes_gradcheck(gen: torch.Generator) -> None:
    q, k, v, qstart, qend, cache_position, mask = span_inputs(gen, torch.float64)
    leaves = tuple(t[..., :4].clone().requires_grad_() for t in (q, k, v))

    def f(a, b, c):
        return span_forward_reference(a, b, c, qstart, qend, cache_position, mask, GQA.window)

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-5, fast_mode=True)


def test_cpu_without_interpreter_runs_reference(monkeypatch, gen: torch.Generator) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, qstart, qend, cache_position, mask = span_inputs(gen)
    problem = Problem.for_span("span_forward", q, k, NSPANS, True, SW, "int2")
    explanation = dispatch.explain(problem)
    assert explanation.choice.variant.name == "reference"
    assert "TRITON_INTERPRET" in dict(explanation.variants)["per_query_span"][0]
    out = superlinear_ops.fused_span_attention(q, k, v, qstart, qend, cache_position, mask, SW)
    expected, _ = oracle.span_forward(q, k, v, qstart, qend, cache_position, mask, GQA.window)
    assert_close(out, expected, torch.float32, LKV, "reference path")


def test_forced_block_k_gives_the_same_answer(gen: torch.Generator) -> None:
    inputs = span_inputs(gen)
    a = fused_span_attention_gqa(*inputs, SW, block_k=16)
    b = fused_span_attention_gqa(*inputs, SW, block_k=64)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


# One call per bad-input class: (mutation of the good arguments, expected error, words it names).
def _bad_span_calls():
    def replace(**changes):
        def make(args):
            return {**args, **{k: (v(args) if callable(v) else v) for k, v in changes.items()}}

        return make

    return {
        "Q2 not a tensor": (replace(Q2=[1.0]), TypeError, "Q2"),
        "Q2 wrong rank": (replace(Q2=lambda a: a["Q2"][0]), ValueError, "Q2"),
        "Q2 integer dtype": (replace(Q2=lambda a: a["Q2"].long()), TypeError, "Q2"),
        "K dtype differs": (replace(K=lambda a: a["K"].double()), TypeError, "K"),
        "V shape differs": (replace(V=lambda a: a["V"][:, :, :-1]), ValueError, "V"),
        "K on another device": (replace(K=lambda a: a["K"].to("meta")), ValueError, "K"),
        "batch differs": (replace(K=lambda a: torch.cat([a["K"], a["K"]]), V=lambda a: torch.cat([a["V"], a["V"]])), ValueError, "batch"),
        "head dim differs": (replace(K=lambda a: a["K"][..., :8], V=lambda a: a["V"][..., :8]), ValueError, "head dim"),
        "head dim too large": (
            replace(Q2=lambda a: torch.zeros(B, HQ, LQ, 300), K=torch.zeros(B, HKV, LKV, 300), V=torch.zeros(B, HKV, LKV, 300)),
            ValueError, "head dim",
        ),
        "Hq not a multiple of Hkv": (
            replace(K=lambda a: a["K"][:, :1].expand(B, 3, LKV, D), V=lambda a: a["V"][:, :1].expand(B, 3, LKV, D)),
            ValueError, "multiple",
        ),
        "qstart float": (replace(qstart=lambda a: a["qstart"].float()), TypeError, "qstart"),
        "qend wrong shape": (replace(qend=lambda a: a["qend"][..., :1]), ValueError, "qend"),
        "cache_position length": (replace(cache_position=torch.tensor([1, 2])), ValueError, "cache_position"),
        "cache_position float": (replace(cache_position=torch.tensor([1.0, 2.0, 3.0])), TypeError, "cache_position"),
        "mask too short": (replace(attention_mask=torch.ones(B, LKV - 1, dtype=torch.bool)), ValueError, "attention_mask"),
        "mask wrong rank": (replace(attention_mask=torch.ones(LKV, dtype=torch.bool)), ValueError, "attention_mask"),
        "block_k not a power of two": (replace(block_k=48), ValueError, "block_k"),
        "span_power out of range": (replace(span_power=1.5), ValueError, "span_power"),
        "span_len_factor zero": (replace(span_len_factor=0.0), ValueError, "span_len_factor"),
        "sw_index negative": (replace(sw_index=-1), ValueError, "sw_index"),
        "both power arguments": (replace(search_power=0.5), ValueError, "exactly one"),
    }


BAD_SPAN_CALLS = _bad_span_calls()


@pytest.mark.parametrize("name", list(BAD_SPAN_CALLS))
def test_bad_span_input_raises_naming_the_argument(name: str, gen: torch.Generator) -> None:
    q, k, v, qstart, qend, cache_position, mask = span_inputs(gen)
    good = dict(Q2=q, K=k, V=v, qstart=qstart, qend=qend, cache_position=cache_position, attention_mask=mask, sw_index=SW)
    mutate, error, words = BAD_SPAN_CALLS[name]
    with pytest.raises(error, match=words):
        fused_span_attention_gqa(**mutate(good))


def decode_args(gen: torch.Generator) -> dict:
    q1, q2 = (torch.randn(B, HQ, 1, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, HKV, LKV, D, generator=gen) for _ in range(2))
    return dict(Q1=q1, Q2=q2, K=k, V=v, cache_position=torch.tensor([LKV - 1]), sw_index=SW)


@pytest.mark.parametrize(
    "changes,error,words",
    [
        (dict(Q1=torch.randn(B, HQ, 2, D)), ValueError, "Q1"),
        (dict(Q2=torch.randn(B, HQ, 2, D), Q1=torch.randn(B, HQ, 2, D)), ValueError, "Lq = 1"),
        (dict(topk=0), ValueError, "topk"),
        (dict(force_mode="dense"), ValueError, "force_mode"),
        (dict(enable_gqa="yes"), TypeError, "enable_gqa"),
        (dict(backward_factor=float("inf")), ValueError, "backward_factor"),
        (dict(forward_factor=-1.0), ValueError, "forward_factor"),
        (dict(cache_position=torch.tensor([], dtype=torch.long)), ValueError, "cache_position"),
        (dict(inv_search_power_int=9), ValueError, "inv_search_power_int"),
    ],
)
def test_bad_decode_input_raises_naming_the_argument(changes, error, words, gen: torch.Generator) -> None:
    with pytest.raises(error, match=words):
        decode_span_attention_staged_gqa(**{**decode_args(gen), **changes})


def test_validate_flags_spans_that_overlap_the_window(monkeypatch, gen: torch.Generator) -> None:
    q, k, v, qstart, qend, cache_position, mask = span_inputs(gen)
    qend = qend.clone()
    qend[0, 0, 2, 0] = 150  # inside the window [125, 159] of the query past the last key
    with pytest.raises(ValueError, match="window"):
        fused_span_attention_gqa(q, k, v, qstart, qend, cache_position, mask, SW, validate=True)
    monkeypatch.setenv("SUPERLINEAR_OPS_VALIDATE", "1")
    with pytest.raises(ValueError, match="window"):
        fused_span_attention_gqa(q, k, v, qstart, qend, cache_position, mask, SW)
    bad_start = qstart.clone()
    bad_start[0, 0, 0, 0] = -5
    with pytest.raises(ValueError, match="qstart"):
        fused_span_attention_gqa(q, k, v, bad_start, qend, cache_position, mask, SW, validate=True)


def test_public_names_and_signatures_match_the_original() -> None:
    assert superlinear_ops.span_attention is superlinear_ops.fused_span_attention
    assert superlinear_ops.span_attention_gqa is superlinear_ops.fused_span_attention_gqa
    assert superlinear_ops.decode_span_attention is superlinear_ops.decode_span_attention_staged
    assert superlinear_ops.decode_span_attention_gqa is superlinear_ops.decode_span_attention_staged_gqa
    for name in ("compute_qend_from_qanchor", "window_len_from_sw_index", "max_stripe_index_for_token_pos"):
        assert callable(getattr(superlinear_ops, name)), name
    span_head = ["Q2", "K", "V", "qstart", "qend", "cache_position", "attention_mask", "sw_index", "block_k",
                 "span_len_factor"]
    gqa = inspect.signature(fused_span_attention_gqa).parameters
    assert list(gqa)[:13] == [*span_head, "span_power", "search_power", "inv_search_power_int"]
    mha = inspect.signature(superlinear_ops.fused_span_attention).parameters
    assert list(mha)[:10] == span_head
    assert [p.name for p in mha.values() if p.kind == p.POSITIONAL_OR_KEYWORD] == span_head
    decode = inspect.signature(decode_span_attention_staged_gqa).parameters
    assert list(decode)[:16] == [
        "Q1", "Q2", "K", "V", "cache_position", "attention_mask", "sw_index", "topk", "enable_gqa",
        "block_k", "backward_factor", "forward_factor", "span_power", "search_power",
        "inv_search_power_int", "force_mode",
    ]
    assert decode["block_k"].default is None and decode["topk"].default == 3
    assert decode["backward_factor"].default == 2.0 and decode["inv_search_power_int"].default == 2
    decode_mha = inspect.signature(superlinear_ops.decode_span_attention_staged).parameters
    assert [p.name for p in decode_mha.values() if p.kind == p.POSITIONAL_OR_KEYWORD] == [
        "Q1", "Q2", "K", "V", "cache_position", "attention_mask", "sw_index", "topk", "backward_factor",
        "forward_factor",
    ]
    assert decode_mha["sw_index"].default == 0 and decode_mha["forward_factor"].default == 0.0


HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


@pytest.fixture
def forbid_host_reads(monkeypatch):
    """Any tensor-to-host read (``.item()``, ``bool()``, ``int()``, ``.tolist()``, ``.cpu()`` ...)
    made from a superlinear_ops module raises while the fixture's ``armed`` flag is set."""
    root = str(pathlib.Path(superlinear_ops.__file__).parent)
    state = {"armed": False, "seen": []}

    def guard(name, original):
        def method(self, *args, **kwargs):
            caller = inspect.currentframe().f_back.f_code.co_filename
            if state["armed"] and caller.startswith(root):
                state["seen"].append(f"{name} from {caller}:{inspect.currentframe().f_back.f_lineno}")
                raise AssertionError(f"host read Tensor.{name} in {caller}")
            return original(self, *args, **kwargs)

        return method

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, guard(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: (_ for _ in ()).throw(AssertionError("synchronize")))
    return state


def test_ops_never_read_tensors_on_the_host(forbid_host_reads, gen: torch.Generator) -> None:
    """Forward, backward and every decode variant, after one warm-up call: no module of the package
    (geometry, tables, decode modules, kernels' launchers) reads a tensor value on the host."""
    from cases import DecodeCase, make_decode_inputs
    from helpers import launch_variant

    from superlinear_ops.registry import REGISTRY

    q, k, v, qstart, qend, cache_position, mask = span_inputs(gen)
    x = make_decode_inputs(DecodeCase("fp32", 2, lkv=96, pos=90), gen)

    def run_all():
        leaf = q.clone().requires_grad_()
        fused_span_attention_gqa(leaf, k, v, qstart, qend, cache_position, mask, SW).sum().backward()
        for variant in REGISTRY.variants("staged_decode"):
            launch_variant(variant, x)
        superlinear_ops.decode_span_attention_staged_gqa(x.q1, x.q2, x.k, x.v, x.cache_position, x.mask, 5)

    run_all()  # warm-up: tables and choices are built once per shape
    forbid_host_reads["armed"] = True
    run_all()
    assert forbid_host_reads["seen"] == []


def test_the_host_read_guard_catches_bool_and_int(forbid_host_reads) -> None:
    forbid_host_reads["armed"] = True
    from superlinear_ops import geometry

    code = compile("bool(t.any())\nint(t[0])", geometry.__file__, "exec")  # as if written in geometry.py
    with pytest.raises(AssertionError, match="__bool__"):
        exec(code, {"t": torch.ones(2)})  # noqa: S102


def test_no_module_calls_synchronize() -> None:
    root = pathlib.Path(superlinear_ops.__file__).parent
    pattern = re.compile(r"synchronize\(")
    allowed = {"precompile.py", "runner.py", "bench.py", "tune.py", "demo.py"}  # warm-up, timing: never inside an op
    offenders = [f"{f.relative_to(root)}:{i}" for f in sorted(root.rglob("*.py")) if f.name not in allowed
                 for i, line in enumerate(f.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []
