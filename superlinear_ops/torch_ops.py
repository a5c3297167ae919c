"""The span ops as torch.library custom ops, each running the dispatcher's choice.

``superlinear_ops::span_forward``, ``::span_backward``, ``::staged_decode`` and the whole layer's
``::layer_search``, ``::layer_spans``, ``::layer_gate_scores`` and ``::layer_gate`` (the layer composes them with
``span_forward`` and its differentiable gate scores, ``ops.layer.composition``) have fake (meta)
implementations and autograd registration, so ``torch.compile(fullgraph=True)`` traces models
that call them and ``torch.library.opcheck`` passes. Inputs arrive validated by ``api``.

Callers go through ``run``: eagerly it calls an op's implementation directly, with no autograd to
record, or through a ``torch.autograd.Function`` built from the same autograd formula when there
is, so that a first call imports none of torch.compile's machinery (a custom op's first call
imports dynamo and sympy, which takes seconds) and no eager call pays the custom-op wrapper's host time
(a sizeable share of an eager short training step's).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from . import dispatch, geometry
from .launch import LaunchGeometry
from .ops.layer.composition import LayerSteps
from .ops.layer.spans import anchor_spans
from .ops.layer_search.reference import padded
from .problem import GATE, GATE_BACKWARD, GATE_SCORES, GATE_SCORES_BACKWARD, SPAN_BACKWARD, SPAN_FORWARD, STAGED_DECODE, Problem
from .registry import REGISTRY
from .settings import SpanSettings

NAMESPACE = "superlinear_ops"
_IMPLEMENTATIONS: dict = {}  # custom op -> the function it wraps
_EAGER_AUTOGRAD: dict = {}  # custom op -> a torch.autograd.Function of its implementation and formula
_TRANSFORMABLE_AUTOGRAD: dict = {}  # the same with a separate setup_context, as torch.func (grad, vmap) requires


def _custom_op(name: str):
    """``torch.library.custom_op`` in this package's namespace, remembering the implementation for ``run``."""
    def register(fn):
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", fn, mutates_args=())
        _IMPLEMENTATIONS[op] = fn
        return op
    return register


def run(op, *args):
    """``op(*args)``: the custom op under torch.compile; eagerly its implementation, called directly
    (same result), through its ``torch.autograd.Function`` when autograd must record it (grad mode on
    and an input requiring grad; under torch.func's transforms the Function with a separate
    ``setup_context``, which they require)."""
    if torch.compiler.is_compiling():
        return op(*args)
    if torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args):
        functions = _TRANSFORMABLE_AUTOGRAD if torch._C._are_functorch_transforms_active() else _EAGER_AUTOGRAD
        return functions[op].apply(*args) if op in functions else op(*args)
    return _IMPLEMENTATIONS[op](*args)


def _call_op(op, *args):
    return op(*args)


def _register_autograd(op, formula, setup_context) -> None:
    """The autograd formula ``formula(call, ctx, *grads)`` of ``op``, which calls other ops through
    ``call``: registered for the custom op with the custom ops themselves (what torch.compile and
    opcheck trace) and, for ``run``'s eager ``torch.autograd.Function``, with ``run``."""
    torch.library.register_autograd(op, functools.partial(formula, _call_op), setup_context=setup_context)
    implementation = _IMPLEMENTATIONS[op]

    def forward(ctx, *args):
        output = implementation(*args)
        setup_context(ctx, args, output)
        return output

    # Plain eager calls: forward(ctx, ...) with the context set up inside it, since a separate
    # setup_context makes every apply() bind its arguments to the forward's signature (inspect, several
    # times slower per apply); torch.func's transforms require the separate one.
    name, backward = f"Eager_{implementation.__name__}", staticmethod(functools.partial(formula, run))
    _EAGER_AUTOGRAD[op] = type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": backward})
    _TRANSFORMABLE_AUTOGRAD[op] = type(name, (torch.autograd.Function,), {
        "forward": staticmethod(implementation), "setup_context": staticmethod(setup_context), "backward": backward,
    })


def _power_params(search_power: float | None, inv_search_power_int: int | None) -> geometry.PowerParams:
    return geometry.power_params(search_power=search_power, inv_search_power_int=inv_search_power_int)


def _span_call(op, q, k, v, qstart, qend, cache_position, attention_mask, sw_index, search_power, inv_power, block_k):
    params = _power_params(search_power, inv_power)
    problem = Problem.for_span(op, q, k, qstart.shape[-1], attention_mask is not None, sw_index, params.label)
    choice = dispatch.select(problem, block_k or None)
    window = geometry.window_length(sw_index, params)
    geo = LaunchGeometry.prepare(q, k, v, qstart, qend, cache_position, attention_mask, window)
    return choice, geo


@_custom_op("span_forward")
def span_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qstart: Tensor,
    qend: Tensor,
    cache_position: Tensor,
    attention_mask: Tensor | None,
    sw_index: int,
    search_power: float | None,
    inv_search_power_int: int | None,
    block_k: int,
) -> tuple[Tensor, Tensor]:
    """Per-span outputs [B, Hq, Lq, K, D] and log2-domain log-sum-exp [B, Hq, Lq, K] (block_k 0: choose)."""
    choice, geo = _span_call(
        SPAN_FORWARD, q, k, v, qstart, qend, cache_position, attention_mask, sw_index, search_power,
        inv_search_power_int, block_k,
    )
    return choice.variant.launch(geo, choice.config)


@span_forward.register_fake
def _span_forward_fake(q, k, v, qstart, qend, cache_position, attention_mask, sw_index, search_power, inv_search_power_int, block_k):
    batch, heads, queries, dim = q.shape
    spans = qstart.shape[-1]
    return q.new_empty(batch, heads, queries, spans, dim), q.new_empty(batch, heads, queries, spans, dtype=torch.float32)


@_custom_op("span_backward")
def span_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qstart: Tensor,
    qend: Tensor,
    cache_position: Tensor,
    attention_mask: Tensor | None,
    sw_index: int,
    search_power: float | None,
    inv_search_power_int: int | None,
    block_k: int,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dQ, dK, dV) of ``span_forward`` for ``grad_out``, by the dispatcher's backward variant."""
    choice, geo = _span_call(
        SPAN_BACKWARD, q, k, v, qstart, qend, cache_position, attention_mask, sw_index, search_power,
        inv_search_power_int, block_k,
    )
    return choice.variant.launch(geo, choice.config, out, lse, grad_out)


@span_backward.register_fake
def _span_backward_fake(q, k, v, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_SAVED_ARGS = ("sw_index", "search_power", "inv_search_power_int", "block_k")


def _setup_span_context(ctx, inputs, output) -> None:
    q, k, v, qstart, qend, cache_position, attention_mask, *scalars = inputs
    out, lse = output
    ctx.scalars = dict(zip(_SAVED_ARGS, scalars))
    ctx.has_mask = attention_mask is not None
    mask = attention_mask if attention_mask is not None else q.new_empty(0)
    ctx.save_for_backward(q, k, v, qstart, qend, cache_position, mask, out, lse)
    ctx.mark_non_differentiable(lse)


def _span_forward_backward(call, ctx, grad_out, grad_lse):
    q, k, v, qstart, qend, cache_position, mask, out, lse = ctx.saved_tensors
    s = ctx.scalars
    dq, dk, dv = call(
        span_backward, q, k, v, qstart, qend, cache_position, mask if ctx.has_mask else None, s["sw_index"],
        s["search_power"], s["inv_search_power_int"], s["block_k"], out, lse, grad_out.contiguous(),
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None


_register_autograd(span_forward, _span_forward_backward, _setup_span_context)


@_custom_op("staged_decode")
def staged_decode(
    q1: Tensor,
    q2: Tensor,
    k: Tensor,
    v: Tensor,
    cache_position: Tensor,
    attention_mask: Tensor | None,
    sw_index: int,
    topk: int,
    backward_factor: float,
    forward_factor: float,
    span_power: float,
    search_power: float | None,
    inv_search_power_int: int | None,
    block_k: int,
) -> Tensor:
    """Staged decode [B, Hq, 1, D] by the dispatcher's decode variant (block_k 0: choose); no backward
    (``staged_decode_differentiable`` serves calls that need one). Only the last cache position
    matters; every variant treats a negative one (which only ``validate=True`` rejects) as 0, so that
    it can never index outside the geometry tables.
    """
    settings = SpanSettings.from_op_arguments(sw_index, topk, backward_factor, forward_factor, span_power, search_power,
                                              inv_search_power_int)
    choice = dispatch.select(_decode_problem(q2, k, attention_mask, settings), block_k or None)
    return choice.variant.launch(q1, q2, k, v, cache_position, attention_mask, settings, choice.config)


def _decode_problem(q2: Tensor, k: Tensor, attention_mask: Tensor | None, settings: SpanSettings) -> Problem:
    factors = (settings.backward_factor, settings.forward_factor, settings.span_power)
    return Problem.for_decode(q2, k, settings.topk, attention_mask is not None, settings.sw_index,
                              settings.params.label, factors)


def staged_decode_differentiable(
    q1: Tensor,
    q2: Tensor,
    k: Tensor,
    v: Tensor,
    cache_position: Tensor,
    attention_mask: Tensor | None,
    settings: SpanSettings,
) -> Tensor:
    """Staged decode [B, Hq, 1, D] by the op's reference variant (torch ops on any device),
    differentiable in Q1 (through the gate), Q2, K and V: the decode kernels have no backward, so a
    call that needs a gradient runs this instead of returning a detached result."""
    variant = REGISTRY.reference(STAGED_DECODE)
    problem = _decode_problem(q2, k, attention_mask, settings)
    return variant.launch(q1, q2, k, v, cache_position, attention_mask, settings, variant.default(problem))


@staged_decode.register_fake
def _staged_decode_fake(q1, q2, *args):
    return torch.empty_like(q2)


@_custom_op("layer_search")
def layer_search(
    q1: Tensor,
    k: Tensor,
    cache_position: Tensor,
    attention_mask: Tensor | None,
    sw_index: int,
    topk: int,
    backward_factor: float,
    forward_factor: float,
    span_power: float,
    search_power: float | None,
    inv_search_power_int: int | None,
) -> tuple[Tensor, Tensor]:
    """The whole layer's anchors [B, Hq, Lq, topk] (int64, -1: empty slot) and their scores (the
    forward's gate scores, ``ops.layer_search.reference.Found``) by the dispatcher's search variant (searched for
    at most as many slots as there are stripes; the rest stay empty)."""
    settings = SpanSettings.from_op_arguments(sw_index, topk, backward_factor, forward_factor, span_power, search_power,
                                              inv_search_power_int)
    factors = (backward_factor, forward_factor, span_power)
    problem = Problem.for_layer(q1, k, topk, attention_mask is not None, sw_index, settings.params.label, factors)
    choice = dispatch.select(problem)
    settings = settings.for_keys(k.shape[2])
    return tuple(padded(choice.variant.launch(q1, k, cache_position, attention_mask, settings, choice.config), topk))


def _outputs_without_gradient(ctx, inputs, output) -> None:
    ctx.mark_non_differentiable(*output)
    ctx.inputs = len(inputs)


def _no_gradient(call, ctx, *grads):
    """Never called: the outputs are non-differentiable."""
    return (None,) * ctx.inputs


# The search's anchors and scores take no gradient: training differentiates the gate scores that
# ``layer_gate_scores`` recomputes from the anchors.
_register_autograd(layer_search, _no_gradient, _outputs_without_gradient)


@layer_search.register_fake
def _layer_search_fake(q1, k, cache_position, attention_mask, sw_index, topk, *args):
    dtype = torch.float64 if q1.dtype == torch.float64 else torch.float32
    return q1.new_empty(*q1.shape[:3], topk, dtype=torch.int64), q1.new_empty(*q1.shape[:3], topk, dtype=dtype)


def _chosen(op: str, *call: Tensor) -> tuple:
    """The dispatcher's (variant, configuration) for the problem of ``op``'s call on ``call``
    (memoised per key: no host synchronisation, safe during CUDA graph capture)."""
    selected = dispatch.select(REGISTRY.spec(op).problem_of(*call))
    return selected.variant, selected.config


@_custom_op("layer_spans")
def layer_spans(
    anchors: Tensor,
    cache_position: Tensor,
    attention_mask: Tensor | None,
    key_length: int,
    sw_index: int,
    backward_factor: float,
    forward_factor: float,
    span_power: float,
    search_power: float | None,
    inv_search_power_int: int | None,
) -> tuple[Tensor, Tensor]:
    """(qstart, qend) [B, Hq, Lq, topk] int32 of the layer's anchors (-1 where the anchor is -1)."""
    settings = SpanSettings.from_op_arguments(sw_index, anchors.shape[-1], backward_factor, forward_factor, span_power,
                                              search_power, inv_search_power_int)
    return anchor_spans(anchors, cache_position, key_length, attention_mask, settings)


@layer_spans.register_fake
def _layer_spans_fake(anchors, *args):
    return torch.empty_like(anchors, dtype=torch.int32), torch.empty_like(anchors, dtype=torch.int32)


@_custom_op("layer_gate")
def layer_gate(scores: Tensor, span_out: Tensor, dtype: torch.dtype) -> Tensor:
    """O = sum_j softmax(scores)_j O_j [B, Hq, Lq, D] in ``dtype`` for scores [B, Hq, Lq, topk] and span
    outputs [B, Hq, Lq, topk, D]."""
    variant, config = _chosen(GATE, scores, span_out)
    return variant.launch(scores, span_out, dtype, config)


@layer_gate.register_fake
def _layer_gate_fake(scores, span_out, dtype):
    return span_out.new_empty(*span_out.shape[:3], span_out.shape[4], dtype=dtype)


@_custom_op("layer_gate_backward")
def layer_gate_backward(scores: Tensor, span_out: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    """(d scores, d span outputs) of ``layer_gate`` for ``grad`` [B, Hq, Lq, D]: dO_j = g_j grad and
    dv_j = g_j (s_j - sum_k g_k s_k) with s_j = grad . O_j."""
    variant, config = _chosen(GATE_BACKWARD, scores, span_out)
    return variant.launch(scores, span_out, grad, config)


@layer_gate_backward.register_fake
def _layer_gate_backward_fake(scores, span_out, grad):
    return torch.empty_like(scores), torch.empty_like(span_out)



@_custom_op("layer_gate_scores")
def layer_gate_scores(q1: Tensor, k: Tensor, anchors: Tensor) -> Tensor:
    """Gate scores v_j = Q1[b, h, q] . K[b, kv(h), anchor_j] [B, Hq, Lq, topk], fp32 (float64 for float64
    inputs), EMPTY_SCORE where the anchor is -1."""
    variant, config = _chosen(GATE_SCORES, q1, k, anchors)
    return variant.launch(q1, k, anchors, config)


@layer_gate_scores.register_fake
def _layer_gate_scores_fake(q1, k, anchors):
    return anchors.new_empty(anchors.shape, dtype=torch.float64 if q1.dtype == torch.float64 else torch.float32)


@_custom_op("layer_gate_scores_backward")
def layer_gate_scores_backward(q1: Tensor, k: Tensor, anchors: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    """(dQ1, dK) of ``layer_gate_scores`` for ``grad`` [B, Hq, Lq, topk]: dQ1 = sum_j dv_j K[anchor_j] and
    dK[anchor_j] += dv_j Q1 (many slots share a row); empty slots pass no gradient."""
    variant, config = _chosen(GATE_SCORES_BACKWARD, q1, k, anchors)
    return variant.launch(q1, k, anchors, grad, config)


@layer_gate_scores_backward.register_fake
def _layer_gate_scores_backward_fake(q1, k, anchors, grad):
    return torch.empty_like(q1), torch.empty_like(k)


def _save_tensor_inputs(ctx, inputs, output) -> None:
    ctx.save_for_backward(*(x for x in inputs if isinstance(x, Tensor)))


def _backward_by(backward_op):
    """An autograd formula for an op whose last input takes no gradient and whose ``backward_op``
    takes the op's tensor inputs and the output's gradient."""

    def backward(call, ctx, grad):
        return (*call(backward_op, *ctx.saved_tensors, grad), None)

    return backward


for _op, _backward in ((layer_gate, layer_gate_backward), (layer_gate_scores, layer_gate_scores_backward)):
    _register_autograd(_op, _backward_by(_backward), _save_tensor_inputs)


def _no_context(ctx, inputs, output) -> None:
    """Nothing to save: the double-backward formula below only raises."""


def _no_double_backward(call, ctx, *grads):
    raise RuntimeError(
        "superlinear_ops: double backward (differentiating the gradients of span attention, e.g. "
        "torch.autograd.grad(..., create_graph=True) then backward) is not supported; compute the "
        "gradients without create_graph=True"
    )


# The backward ops are differentiable only in name: differentiating them raises one clear error.
for _op in (span_backward, layer_gate_backward, layer_gate_scores_backward):
    _register_autograd(_op, _no_double_backward, _no_context)


def _spans_step(anchors: Tensor, cache_position: Tensor, key_length: int, attention_mask: Tensor | None,
                settings: SpanSettings) -> tuple[Tensor, Tensor]:
    power = settings.params.arguments
    return run(layer_spans, anchors, cache_position, attention_mask, key_length, settings.sw_index, settings.backward_factor,
               settings.forward_factor, settings.span_power, power["search_power"], power["inv_search_power_int"])


# The whole layer's steps after the search as these custom ops (``ops.layer.composition``).
LAYER_STEPS = LayerSteps(
    spans=_spans_step,
    gate_scores=lambda q1, k, anchors: run(layer_gate_scores, q1, k, anchors),
    gate=lambda scores, span_out, dtype: run(layer_gate, scores, span_out, dtype),
)
