"""Public API: autograd, backends, validation (one test per bad-input class), drop-in signatures."""

from __future__ import annotations

import inspect
import pathlib
import re

import pytest
import torch
from conftest import assert_close, random_spans

import superlinear_ops
from superlinear_ops import (
    decode_span_attention_staged_gqa,
    fused_span_attention,
    fused_span_attention_gqa,
    geometry,
)
from superlinear_ops import dispatch
from superlinear_ops.problem import Problem
from superlinear_ops.reference import span_forward_reference

B, HQ, HKV, LQ, LKV, D, NSPANS, SW = 1, 4, 2, 3, 60, 16, 2, 2  # W = 8


def span_inputs(gen: torch.Generator, dtype=torch.float32):
    q = torch.randn(B, HQ, LQ, D, generator=gen, dtype=dtype)
    k = torch.randn(B, HKV, LKV, D, generator=gen, dtype=dtype)
    v = torch.randn(B, HKV, LKV, D, generator=gen, dtype=dtype)
    cache_position = torch.tensor([20, 45, 59])
    window = geometry.window_len_from_sw_index(SW)
    qstart, qend = random_spans(gen, B, HQ, cache_position, NSPANS, LKV, window, 25, unused_fraction=0.0)
    mask = torch.rand(B, LKV, generator=gen) > 0.2
    return q, k, v, qstart, qend, cache_position, mask


def test_autograd_through_the_api_matches_reference(gen: torch.Generator) -> None:
    q, k, v, qstart, qend, cache_position, mask = span_inputs(gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fused_span_attention_gqa(*leaves, qstart, qend, cache_position, mask, SW, block_k=16)
    grad = torch.randn(out.shape, generator=gen)
    out.backward(grad)
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    expected = span_forward_reference(*refs, qstart, qend, cache_position, mask, 8)
    expected.backward(grad.double())
    assert_close(out, expected, torch.float32)
    for got, ref in zip(leaves, refs):
        assert_close(got.grad, ref.grad, torch.float32)


def test_reference_autograd_passes_gradcheck(gen: torch.Generator) -> None:
    q, k, v, qstart, qend, cache_position, mask = span_inputs(gen, torch.float64)
    leaves = tuple(t[..., :4].clone().requires_grad_() for t in (q, k, v))

    def f(a, b, c):
        return span_forward_reference(a, b, c, qstart, qend, cache_position, mask, 8)

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-5)


def test_cpu_without_interpreter_runs_reference(monkeypatch, gen: torch.Generator) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, qstart, qend, cache_position, mask = span_inputs(gen)
    problem = Problem.for_span("span_forward", q, k, NSPANS, True, SW, "int2")
    explanation = dispatch.explain(problem)
    assert explanation.choice.variant.name == "reference"
    assert "TRITON_INTERPRET" in dict(explanation.variants)["per_query_span"][0]
    out = fused_span_attention(q, k, v, qstart, qend, cache_position, mask, SW)
    expected = span_forward_reference(q.double(), k.double(), v.double(), qstart, qend, cache_position, mask, 8)
    assert_close(out, expected, torch.float32)


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
        "head dim too large": (replace(Q2=lambda a: torch.zeros(B, HQ, LQ, 300), K=torch.zeros(B, HKV, LKV, 300), V=torch.zeros(B, HKV, LKV, 300)), ValueError, "head dim"),
        "Hq not a multiple of Hkv": (replace(K=lambda a: a["K"][:, :1].expand(B, 3, LKV, D), V=lambda a: a["V"][:, :1].expand(B, 3, LKV, D)), ValueError, "multiple"),
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
    qend[0, 0, 2, 0] = 58  # inside the window of the query at position 59
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
    names = [
        "fused_span_attention", "fused_span_attention_gqa", "span_attention", "span_attention_gqa",
        "decode_span_attention_staged", "decode_span_attention_staged_gqa", "decode_span_attention",
        "decode_span_attention_gqa", "compute_qend_from_qanchor", "window_len_from_sw_index",
        "max_stripe_index_for_token_pos",
    ]
    for name in names:
        assert callable(getattr(superlinear_ops, name)), name
    params = list(inspect.signature(fused_span_attention_gqa).parameters)
    assert params[:13] == [
        "Q2", "K", "V", "qstart", "qend", "cache_position", "attention_mask", "sw_index", "block_k",
        "span_len_factor", "span_power", "search_power", "inv_search_power_int",
    ]
    decode = inspect.signature(decode_span_attention_staged_gqa).parameters
    assert list(decode)[:16] == [
        "Q1", "Q2", "K", "V", "cache_position", "attention_mask", "sw_index", "topk", "enable_gqa",
        "block_k", "backward_factor", "forward_factor", "span_power", "search_power",
        "inv_search_power_int", "force_mode",
    ]
    assert decode["block_k"].default is None and decode["topk"].default == 3
    assert decode["backward_factor"].default == 2.0 and decode["inv_search_power_int"].default == 2


def test_forward_and_decode_paths_never_synchronise() -> None:
    root = pathlib.Path(superlinear_ops.__file__).parent
    files = [root / name for name in ("decode/staged.py", "torch_ops.py", "dispatch.py", "variants.py", "problem.py")]
    files += sorted((root / "kernels").glob("*.py"))
    pattern = re.compile(r"\.item\(\)|synchronize\(|\.tolist\(\)|\.cpu\(\)")
    offenders = [f"{f.name}:{i}" for f in files for i, line in enumerate(f.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []
