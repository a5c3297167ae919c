"""torch.library ops: opcheck, torch.compile(fullgraph=True), and warm-up."""

from __future__ import annotations

import torch

import superlinear_ops
from superlinear_ops import geometry
from superlinear_ops import torch_ops as library
from superlinear_ops.problem import Problem

B, HQ, HKV, LQ, LKV, D, K = 1, 4, 2, 3, 48, 16, 2


def inputs(gen: torch.Generator):
    q = torch.randn(B, HQ, LQ, D, generator=gen)
    k = torch.randn(B, HKV, LKV, D, generator=gen)
    v = torch.randn(B, HKV, LKV, D, generator=gen)
    cache_position = torch.tensor([20, 30, 47])
    qstart = torch.tensor([0, 5]).expand(B, HQ, LQ, K).contiguous()
    qend = torch.tensor([3, 9]).expand(B, HQ, LQ, K).contiguous()
    mask = torch.rand(B, LKV, generator=gen) > 0.1
    return q, k, v, qstart, qend, cache_position, mask


def test_opcheck_span_ops(gen: torch.Generator) -> None:
    q, k, v, qstart, qend, cp, mask = inputs(gen)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), qstart, qend, cp, mask, 2, None, 2, 16)
    torch.library.opcheck(library.span_forward, args)
    out, lse = library.span_forward(*args)
    grad = torch.randn(out.shape, generator=gen)
    torch.library.opcheck(library.span_backward, (*(t.detach() for t in args[:3]), *args[3:], out.detach(), lse, grad))


def test_opcheck_staged_decode(gen: torch.Generator) -> None:
    _, k, v, _, _, cp, mask = inputs(gen)
    q1, q2 = torch.randn(B, HQ, 1, D, generator=gen), torch.randn(B, HQ, 1, D, generator=gen)
    torch.library.opcheck(library.staged_decode, (q1, q2, k, v, cp, mask, 2, 3, 2.0, 1.0, 0.5, None, 2, 16))


class SpanBlock(torch.nn.Module):
    def forward(self, q, k, v, qstart, qend, cache_position, mask):
        out = superlinear_ops.fused_span_attention_gqa(q, k, v, qstart, qend, cache_position, mask, 2)
        return out.mean(dim=3)


def test_torch_compile_fullgraph_forward_and_backward(gen: torch.Generator) -> None:
    q, k, v, qstart, qend, cp, mask = inputs(gen)
    eager_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    eager = SpanBlock()(*eager_leaves, qstart, qend, cp, mask)
    compiled = torch.compile(SpanBlock(), fullgraph=True, backend="aot_eager")(*compiled_leaves, qstart, qend, cp, mask)
    torch.testing.assert_close(compiled, eager)
    eager.sum().backward()
    compiled.sum().backward()
    for a, b in zip(compiled_leaves, eager_leaves):
        torch.testing.assert_close(a.grad, b.grad)


def test_torch_compile_fullgraph_decode(gen: torch.Generator) -> None:
    _, k, v, _, _, cp, mask = inputs(gen)
    q1, q2 = torch.randn(B, HQ, 1, D, generator=gen), torch.randn(B, HQ, 1, D, generator=gen)

    def step(q1, q2, k, v, cp, mask):
        return superlinear_ops.decode_span_attention_staged_gqa(q1, q2, k, v, cp, mask, 2, forward_factor=1.0)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q1, q2, k, v, cp, mask), step(q1, q2, k, v, cp, mask))


def test_opcheck_layer_search(gen: torch.Generator) -> None:
    q, k, _, _, _, _, mask = inputs(gen)
    cp = torch.tensor([30, 40, 47])  # t > W = 15: stripes exist
    torch.library.opcheck(library.layer_search, (q, k, cp, mask, 3, 2, 2.0, 1.0, 0.5, None, 2))


def test_torch_compile_fullgraph_whole_layer_forward_and_backward(gen: torch.Generator) -> None:
    q, k, v, _, _, _, mask = inputs(gen)
    q1 = torch.randn(q.shape, generator=gen)
    cp = torch.tensor([30, 40, 47])

    def layer(q1, q2, k, v):
        return superlinear_ops.superlinear_attention(q1, q2, k, v, cp, mask, 3, 2, forward_factor=1.0)

    eager_leaves = [t.clone().requires_grad_() for t in (q1, q, k, v)]
    compiled_leaves = [t.clone().requires_grad_() for t in (q1, q, k, v)]
    eager = layer(*eager_leaves)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(*compiled_leaves)
    torch.testing.assert_close(compiled, eager)
    eager.square().sum().backward()
    compiled.square().sum().backward()
    for a, b in zip(compiled_leaves, eager_leaves):
        assert a.grad.abs().sum() > 0
        torch.testing.assert_close(a.grad, b.grad)


def test_warmup_runs_each_problem_and_builds_decode_tables() -> None:
    device = superlinear_ops.problem.device_identity(torch.device("cpu"))
    problems = [
        Problem("span_backward", "float32", 16, 4, 2, 2, 3, 64, 1, True, 2, "int2", device),
        Problem("staged_decode", "float32", 16, 4, 2, 3, 1, 96, 1, False, 2, "float0.55", device, (3.0, 1.0, 0.55)),
    ]
    assert superlinear_ops.warmup(problems, "cpu") == 2
    params = geometry.PowerParams.from_label("float0.55")
    assert ("stripes", 96, 2, params, "cpu") in geometry._TABLES
    assert ("span_len", 3.0, 0.55, 96, "cpu") in geometry._TABLES


def test_nothing_is_built_after_warmup(gen: torch.Generator) -> None:
    """warmup's promise: after it, real calls of the warmed problems resolve no choice, build no
    geometry or decode table and (on a GPU) compile no Triton kernel."""
    from superlinear_ops import dispatch
    from superlinear_ops.ops.staged_decode import tables as decode_tables

    device = superlinear_ops.problem.device_identity(torch.device("cpu"))
    problems = [
        Problem("span_backward", "float32", D, HQ, HKV, K, LQ, 80, B, True, 3, "int3", device),
        Problem("staged_decode", "float32", D, HQ, HKV, 2, 1, 112, B, True, 3, "float0.6", device, (2.5, 0.5, 0.45)),
    ]
    superlinear_ops.warmup(problems, "cpu")
    before = (dispatch.DISPATCHER.resolutions, len(geometry._TABLES), decode_tables.decode_tables.cache_info().misses)
    q = torch.randn(B, HQ, LQ, D, generator=gen, requires_grad=True)
    k, v = torch.randn(B, HKV, 80, D, generator=gen), torch.randn(B, HKV, 80, D, generator=gen)
    spans = torch.tensor([0, 9]).expand(B, HQ, LQ, K).contiguous()
    mask = torch.rand(B, 80, generator=gen) > 0.1
    superlinear_ops.fused_span_attention_gqa(q, k, v, spans, spans, torch.tensor([40, 60, 79]), mask, 3,
                                             inv_search_power_int=3).sum().backward()
    k, v = torch.randn(B, HKV, 112, D, generator=gen), torch.randn(B, HKV, 112, D, generator=gen)
    q1, q2 = torch.randn(B, HQ, 1, D, generator=gen), torch.randn(B, HQ, 1, D, generator=gen)
    superlinear_ops.decode_span_attention_staged_gqa(
        q1, q2, k, v, torch.tensor([100]), torch.rand(B, 112, generator=gen) > 0.1, 3, 2, backward_factor=2.5,
        forward_factor=0.5, span_power=0.45, search_power=0.6, inv_search_power_int=None,
    )
    after = (dispatch.DISPATCHER.resolutions, len(geometry._TABLES), decode_tables.decode_tables.cache_info().misses)
    assert after == before, "a choice or a table was built after warm-up"


FIRST_CALLS = """
import sys, torch, superlinear_ops
gen = torch.Generator().manual_seed(3)
q1, q2 = (torch.randn(1, 4, 48, 16, generator=gen) for _ in range(2))
k, v = (torch.randn(1, 2, 48, 16, generator=gen) for _ in range(2))
superlinear_ops.superlinear_attention(q1, q2, k, v, torch.arange(48), None, 3, 2)
superlinear_ops.decode_span_attention_staged_gqa(q1[:, :, -1:], q2[:, :, -1:], k, v, torch.tensor([47]), None, 3, 2)
print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
"""


def test_eager_calls_without_gradients_import_no_compile_machinery() -> None:
    """A fresh process's first layer and decode calls (nothing to differentiate) run the ops'
    implementations directly: torch.compile's machinery (dynamo, sympy; about 1.5 s) stays unloaded."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FIRST_CALLS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = done.stdout.strip().splitlines()[-1]
    assert loaded == "[]", f"the first eager calls imported {loaded}"


def test_direct_calls_equal_the_custom_ops(gen: torch.Generator) -> None:
    """``torch_ops.run`` without gradients (the implementation) and with them (the eager autograd
    Function) give the same layer output."""
    q1, q2 = (torch.randn(1, 4, 40, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 2, 40, 16, generator=gen) for _ in range(2))
    direct = superlinear_ops.superlinear_attention(q1, q2, k, v, torch.arange(40), None, 3, 2)
    recorded = superlinear_ops.superlinear_attention(q1, q2.requires_grad_(), k, v, torch.arange(40), None, 3, 2)
    assert recorded.grad_fn is not None and direct.grad_fn is None
    torch.testing.assert_close(direct, recorded.detach(), rtol=0, atol=0)


def test_torch_func_grad_equals_autograd(gen: torch.Generator) -> None:
    """torch.func.grad through the layer (its eager Functions with a separate setup_context, which the
    transforms require) gives autograd's gradients of Q2 and K exactly."""
    q1, q2 = (torch.randn(1, 4, 40, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 2, 40, 16, generator=gen) for _ in range(2))

    def loss(q2_, k_):
        return superlinear_ops.superlinear_attention(q1, q2_, k_, v, torch.arange(40), None, 3, 2).sum()

    try:
        got = torch.func.grad(loss, argnums=(0, 1))(q2, k)
    except RuntimeError as err:
        raise AssertionError(f"torch.func.grad through the layer failed: {err}") from None
    leaves = (q2.clone().requires_grad_(), k.clone().requires_grad_())
    want = torch.autograd.grad(loss(*leaves), leaves)
    for name, a, b in zip(("dQ2", "dK"), got, want):
        assert not torch.isnan(a).any() and b.abs().max() > 0, f"{name}: NaN or a trivial gradient"
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_eager_autograd_equals_the_custom_ops_without_their_wrapper(gen: torch.Generator, monkeypatch) -> None:
    """An eager call that autograd records runs the op's ``torch.autograd.Function`` (no custom-op
    wrapper), whose forward and gradients equal the custom op's exactly, and its backward calls
    the backward op's implementation directly."""
    q, k, v, qstart, qend, cp, mask = inputs(gen)
    leaves = [[t.clone().requires_grad_() for t in (q, k, v)] for _ in range(2)]
    args = (qstart, qend, cp, mask, 2, None, 2, 16)
    eager, _ = library.run(library.span_forward, *leaves[0], *args)
    custom, _ = library.span_forward(*leaves[1], *args)
    assert type(eager.grad_fn).__name__ == "Eager_span_forwardBackward"
    assert "Eager" not in type(custom.grad_fn).__name__
    grad = torch.randn(eager.shape, generator=gen)
    calls = []
    real = library._IMPLEMENTATIONS[library.span_backward]
    monkeypatch.setitem(library._IMPLEMENTATIONS, library.span_backward, lambda *a: calls.append(1) or real(*a))
    eager_grads = torch.autograd.grad(eager, leaves[0], grad)
    assert calls == [1], f"the eager backward called span_backward's implementation {len(calls)} times, not once"
    torch.testing.assert_close(eager, custom, rtol=0, atol=0)
    for a, b in zip(eager_grads, torch.autograd.grad(custom, leaves[1], grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
