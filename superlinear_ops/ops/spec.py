"""The op spec: everything the tuner, ``bench``, ``verify``, warm-up and the CLI know of one op.

Each op declares one ``OpSpec`` subclass in its own module of this package and is registered with
the registry (``REGISTRY.add_op``) before its variants; nothing outside the specs and the registry
branches on an op's name. A spec gives, for its op:
- what its problems look like: ``searching`` (span lengths come from the search's factors),
  ``single_query`` (one query per call), and ``check`` for further rules;
- the other ops a candidate runs with (``parts``: the forward behind a backward, the span attention
  and the gate inside the layer), which the bench resolves once to explicit configurations, and
  those a workload tunes with it (``companions``: the layer's gate ops);
- ``canonical``: a problem as its op's, with the fields the op does not see fixed;
- its inputs for tuning and checking (``inputs``, ``variations``), one launch signature for all its
  variants (``run``), its tolerance against the float64 reference, its cost model (``traffic``:
  bytes and FLOPs for the lower bound), its dense-attention comparator (``dense``) and its warm-up.
The base class describes a span forward; the other ops override what differs.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from .. import geometry
from ..launch import KernelConfig, LaunchGeometry
from ..problem import Problem
from .inputs import Inputs, random_inputs
from .span_attention.reference import attended_counts

if TYPE_CHECKING:
    from ..registry import Variant
    from ..tuner.workload import Case

TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 4e-2}  # max |error| / max(1, max |expected|)

# The configuration each part of a candidate's run takes: part name -> (variant, configuration).
Parts = dict[str, tuple["Variant", KernelConfig]]
# The public API as warm-up calls it (the package itself: ``superlinear_ops``), handed down by
# ``precompile`` so that no op spec imports the layers above it.
PublicOps = ModuleType
# make_call(expand) -> a call of dense SDPA; ``expand`` repeats K/V to every query head.
DenseCall = Callable[[bool], Callable[[], object]]


@dataclass(frozen=True)
class DenseCalls:
    """Dense attention on a problem's inputs: what is timed and one call per timed input (the time
    is the mean over them), replayed from a CUDA graph when ``graph``; ``flops``, the FLOPs of the
    largest call (0 where they are negligible), says whether timing it is worth the wait."""

    kind: str
    calls: tuple[DenseCall, ...]
    graph: bool = False
    flops: float = 0.0


def dense_flops(q: torch.Tensor, keys: int, causal: bool) -> float:
    """FLOPs of one dense attention forward of ``q`` [B, Hq, Lq, D] over ``keys`` keys: 4 D per
    (query head, key) pair, half the pairs when causal."""
    batch, heads, queries, head_dim = q.shape
    return 4.0 * head_dim * batch * heads * queries * keys * (0.5 if causal else 1.0)


def span_length(factors: tuple[float, float, float], t: int) -> int:
    """Keys one span covers at t tokens (backward + forward part)."""
    bf, ff, sp = factors
    return geometry.ceil_scaled_power(bf, t, sp) + geometry.ceil_scaled_power(ff, t, sp) + 1


def grouped_heads(x: Inputs, expand: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) of inputs ``x``, repeated to every query head when ``expand``."""
    rep = x.q.shape[1] // x.k.shape[1]
    return (x.k.repeat_interleave(rep, dim=1), x.v.repeat_interleave(rep, dim=1)) if expand else (x.k, x.v)


def zero_inputs(problem: Problem, device: torch.device) -> Inputs:
    """Zero inputs of the problem's real shape (warm-up), every span slot empty."""
    zeros = dict(device=device, dtype=problem.torch_dtype)
    b, hq, hkv, lq, lkv, d = (problem.batch, problem.q_heads, problem.kv_heads, problem.queries, problem.keys,
                              problem.head_dim)
    spans = torch.full((b, hq, lq, problem.spans), -1, dtype=torch.int64, device=device)
    return Inputs(
        q=torch.zeros(b, hq, lq, d, **zeros), k=torch.zeros(b, hkv, lkv, d, **zeros),
        v=torch.zeros(b, hkv, lkv, d, **zeros), qstart=spans, qend=spans,
        cache_position=torch.arange(lkv - lq, lkv, device=device),
        mask=torch.ones(b, lkv, dtype=torch.bool, device=device) if problem.masked else None,
        q1=torch.zeros(b, hq, lq, d, **zeros),
    )


def call_searching(function: Callable, problem: Problem, device: torch.device) -> object:
    """``function``, a public searching op (one decode step, or the whole layer), once on zero inputs of
    ``problem``'s shape: what their warm-up runs."""
    x = zero_inputs(problem, device)
    bf, ff, sp = problem.factors
    return function(x.q, x.q, x.k, x.v, x.cache_position, x.mask, problem.sw_index, problem.spans,
                    backward_factor=bf, forward_factor=ff, span_power=sp, **problem.params.arguments)


class OpSpec:
    """One op (see the module docstring); the base class is the span forward's behaviour."""

    name: ClassVar[str]
    searching: ClassVar[bool] = False  # span lengths from the factors (backward, forward, span power)
    single_query: ClassVar[bool] = False  # one query per call
    graph_timed: ClassVar[bool] = False  # timed by replaying a CUDA graph (launch-bound ops)
    near_ties: ClassVar[bool] = False  # at real size a few rows may differ by an fp32 near-tie
    tolerance_scale: ClassVar[float] = 1.0  # gradients sum more terms than outputs

    def check(self, problem: Problem) -> None:
        """Raise ValueError naming the field when ``problem`` breaks a rule of this op."""

    def canonical(self, problem: Problem) -> Problem:
        """``problem`` as this op's problem: fields the op does not see fixed (a hand-written or
        workload problem then has the key its calls look up)."""
        return problem._replace(op=self.name)

    def parts(self, problem: Problem) -> dict[str, Problem]:
        """The other ops a candidate of ``problem`` runs with, by part name (resolved once, explicitly)."""
        return {}

    def companions(self, problem: Problem) -> dict[str, Problem]:
        """The problems of other ops a workload tunes along with ``problem`` (by part name)."""
        return {}

    def inputs(self, case: Case, device: torch.device, gen: torch.Generator, queries: int, keys: int) -> Inputs:
        """Random inputs of ``case`` at ``queries`` x ``keys``."""
        return random_inputs(case.problem, case.span_factors, device, gen, queries, keys)

    def variations(self, case: Case, x: Inputs, gen: torch.Generator, timed: bool) -> list[Inputs]:
        """Further inputs like ``x`` the case is checked on (``timed``: timed on); its time is the mean."""
        return []

    def run(self, variant: Variant, config: KernelConfig, problem: Problem, x: Inputs, parts: Parts) -> tuple[torch.Tensor, ...]:
        """One call of ``variant`` with ``config`` on ``x``; its outputs."""
        geo = LaunchGeometry.prepare(x.q, x.k, x.v, x.qstart, x.qend, x.cache_position, x.mask, problem.window)
        return (variant.launch(geo, config)[0],)

    def tolerance(self, problem: Problem) -> float:
        """Accepted relative error against the float64 reference."""
        return TOLERANCE[problem.dtype] * self.tolerance_scale

    def traffic(self, case: Case, timed: Sequence[Inputs]) -> tuple[float, float]:
        """(bytes every implementation must move, FLOPs it must compute) for one call, the mean over the
        inputs it is timed on: Q, K and V read once and the span outputs written; 4 D FLOPs per key
        each (b, h, q, span) attends."""
        p = case.problem
        elem = torch.empty(0, dtype=p.torch_dtype).element_size()
        flops = statistics.fmean(4.0 * p.head_dim * float(attended_counts(
            x.qstart, x.qend, x.cache_position, x.mask, x.k.shape[2], p.window).sum()) for x in timed)
        out = p.batch * p.q_heads * p.queries * p.spans * p.head_dim
        return (p.batch * (p.q_heads * p.queries + 2 * p.kv_heads * p.keys) * p.head_dim + out) * elem, flops

    def dense(self, case: Case, x: Inputs) -> DenseCalls:
        """Dense SDPA over the same inputs (causal when every key is a query's)."""
        causal = case.problem.queries == case.problem.keys

        def forward_call(expand: bool):
            k, v = grouped_heads(x, expand)
            return lambda: F.scaled_dot_product_attention(x.q, k, v, is_causal=causal, enable_gqa=not expand)

        return DenseCalls("causal" if causal else "no causal mask", (forward_call,),
                          flops=dense_flops(x.q, x.k.shape[2], causal))

    def warmup(self, problem: Problem, device: torch.device, public: PublicOps) -> None:
        """Run the public op once on zero inputs of ``problem``'s shape (the dispatcher's choice)."""
        self.public_call(problem, zero_inputs(problem, device), public, requires_grad=False)

    def public_call(self, problem: Problem, x: Inputs, public: PublicOps, requires_grad: bool) -> torch.Tensor:
        """The public span op on ``x`` (Q requiring grad when ``requires_grad``)."""
        q = x.q.requires_grad_(requires_grad)
        return public.fused_span_attention_gqa(q, x.k, x.v, x.qstart, x.qend, x.cache_position, x.mask, problem.sw_index,
                                            **problem.params.arguments)
