"""Running one candidate (variant + configuration) on one problem: inputs, correctness, timing.

Every candidate is checked before its time counts, each run on NaN-prefilled outputs (``nan_fill``)
and ``CHECK_RUNS`` times (some faults show only after several launches):
1. against the float64 PyTorch reference on check-size inputs (the problem's own head layout,
   dtype, span slots, mask and window, with Lq and Lkv capped so the dense reference fits); a
   backward candidate's gradients (dQ, dK, dV) are its outputs;
2. on the real-size inputs for NaN and against the baseline: the first candidate that passed step 1
   (the heuristic default, which every search measures first), or the one ``set_baseline`` names.
After timing, ``check(..., runs=1)`` runs once more (a candidate must still be right after many launches).
Timing: GPU medians from ``triton.testing.do_bench`` (which flushes L2 between repetitions), decode
timed by replaying a CUDA graph; under the CPU interpreter, the median of a few wall-clock runs. A
case timed on several inputs (a static cache's fills, a masked context's mask kinds) takes the mean.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

import torch

from .. import torch_ops
from ..decode.settings import DecodeSettings
from ..kernels.launch import KernelConfig, LaunchGeometry
from ..layer.attention import attention_layer
from ..problem import ATTENTION_LAYER, SPAN_BACKWARD, STAGED_DECODE, Problem
from ..registry import REGISTRY, Variant
from .faults import WRONG_NUMBERS, classify, is_sticky
from .nan_fill import nan_prefilled
from .workload import Case

CHECK_QUERIES = 64
CHECK_KEYS = 16384
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 4e-2}  # max |error| / max(1, max |expected|)
# Two correct searches that sum fp32 products in other orders may break a near-tie differently: at
# real size the whole layer may differ from the first checked candidate in this fraction of rows.
NEAR_TIE_ROWS = 1e-4
CHECK_RUNS = 2  # NaN-prefilled runs per check input before a candidate's time counts


class CandidateFailed(Exception):
    """A candidate could not run, or computed wrong numbers: ``category`` (``faults.CATEGORIES``) says
    which, the message why; ``sticky`` when the error left the CUDA context unusable."""

    def __init__(self, message: str, category: str = WRONG_NUMBERS, sticky: bool = False) -> None:
        super().__init__(message)
        self.category = category
        self.sticky = sticky


@dataclass
class Inputs:
    """Tensors for one problem (decode uses q1/q2 and ignores the span tensors)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    qstart: torch.Tensor
    qend: torch.Tensor
    cache_position: torch.Tensor
    mask: torch.Tensor | None
    q1: torch.Tensor
    grad_out: torch.Tensor | None = None

    def cast(self, dtype: torch.dtype) -> "Inputs":
        """The same inputs with the floating tensors in ``dtype``."""
        f = lambda t: None if t is None else t.to(dtype)  # noqa: E731
        return replace(self, q=f(self.q), k=f(self.k), v=f(self.v), q1=f(self.q1), grad_out=f(self.grad_out))


def search_like_spans(shape: tuple[int, int, int, int], cache_position: torch.Tensor, key_length: int, window: int,
                      factors: tuple[float, float, float], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(qstart, qend) of ``shape`` [B, Hq, Lq, K] as the search would produce them: anchors uniform
    before each query's window, spans ceil(bf t^p) back and ceil(ff t^p) forward (clamped to end
    before the window); -1 where no key precedes the window. Also used by the comparison scripts."""
    backward_factor, forward_factor, span_power = factors
    pos = cache_position.clamp(max=key_length - 1).view(1, 1, -1, 1).long()
    limit = (pos - window + 1).clamp(min=0) if window > 0 else pos + 1
    anchor = (torch.rand(shape, generator=gen, device=pos.device) * limit).floor().long()
    t = (pos + 1).double()
    back = torch.ceil(backward_factor * t.pow(span_power)).long()
    forward = torch.ceil(forward_factor * t.pow(span_power)).long()
    qstart = (anchor - back).clamp(min=0)
    qend = torch.minimum(anchor + forward, limit - 1)
    unused = (limit <= 0).expand(shape)
    return torch.where(unused, -1, qstart), torch.where(unused, -1, qend)


LEFT_PADDING = 100  # keys of padding per row (row b: 100 (b + 1)) in a 'left_padding' mask
HOLES = 0.1  # fraction of masked keys in a 'holes' mask


def decode_mask(kind: str | None, batch: int, keys: int, filled: int, device: torch.device,
                gen: torch.Generator) -> torch.Tensor | None:
    """A decode keep-mask [B, keys] (bool): None without ``kind``; 'prefix' (a static cache: the first
    ``filled`` keys), or over a full context 'ones', 'holes' (``HOLES`` of the keys before the last)
    or 'left_padding' (row b's first ``LEFT_PADDING`` (b + 1) keys masked)."""
    if kind is None:
        return None
    mask = torch.ones(batch, keys, dtype=torch.bool, device=device)
    if kind == "prefix":
        mask[:, filled:] = False
    elif kind == "holes":
        mask[:, :-1] = torch.rand(batch, keys - 1, generator=gen, device=device) >= HOLES
    elif kind == "left_padding":
        for row in range(batch):
            mask[row, : min(LEFT_PADDING * (row + 1), keys - 1)] = False
    elif kind != "ones":
        raise ValueError(f"mask kind must be 'prefix', 'ones', 'holes' or 'left_padding', got {kind!r}")
    return mask


def decode_step(case: Case, x: Inputs, fill: int | None, mask_kind: str | None, gen: torch.Generator) -> Inputs:
    """``x`` (decode inputs) at another fill of its static cache and another mask kind."""
    problem, lkv = case.problem, x.k.shape[2]
    filled = min(fill or lkv, lkv)
    kind = "prefix" if problem.masked and case.cache_fill is not None else mask_kind
    mask = decode_mask(kind, problem.batch, lkv, filled, x.k.device, gen)
    return replace(x, cache_position=torch.tensor([filled - 1], device=x.k.device), mask=mask)


def make_inputs(case: Case, device: torch.device, seed: int, queries: int | None = None,
                keys: int | None = None, fill: int | None = None, mask_kind: str | None = None) -> Inputs:
    """Random inputs of the case's shape (``queries``/``keys`` override Lq/Lkv for check sizes; decode
    at ``fill`` (default: the case's) with ``mask_kind`` (default: the case's first))."""
    problem = case.problem
    gen = torch.Generator(device=device).manual_seed(seed)
    lq = queries or problem.queries
    lkv = keys or problem.keys
    dtype = problem.torch_dtype
    b, hq, hkv, d = problem.batch, problem.q_heads, problem.kv_heads, problem.head_dim
    randn = lambda *shape: torch.randn(*shape, generator=gen, device=device).to(dtype)  # noqa: E731
    q, q1 = randn(b, hq, lq, d), randn(b, hq, lq, d)
    k, v = randn(b, hkv, lkv, d), randn(b, hkv, lkv, d)
    cache_position = torch.arange(lkv - lq, lkv, device=device)
    mask = None
    if problem.masked and problem.op != STAGED_DECODE:
        mask = torch.rand(b, lkv, generator=gen, device=device) > 0.05
    shape = (b, hq, lq, problem.spans)
    qstart, qend = search_like_spans(shape, cache_position, lkv, problem.window, case.span_factors, gen)
    grad = randn(b, hq, lq, problem.spans, d) if problem.op == SPAN_BACKWARD else None
    x = Inputs(q, k, v, qstart, qend, cache_position, mask, q1, grad)
    if problem.op == STAGED_DECODE:
        x = decode_step(case, x, fill or case.cache_fill, mask_kind or (case.mask_kinds or (None,))[0], gen)
    return x


def _settings(problem: Problem) -> DecodeSettings:
    bf, ff, sp = problem.factors
    return DecodeSettings(problem.sw_index, problem.spans, bf, ff, sp, problem.params)


def run(variant: Variant, config: KernelConfig, problem: Problem, x: Inputs) -> tuple[torch.Tensor, ...]:
    """Run a candidate once; returns its outputs (out; or dQ, dK, dV).

    A span_backward candidate runs as a training step does: the default forward (for out and its
    log-sum-exp), then the candidate backward; its timings therefore cover forward + backward.
    """
    if problem.op == STAGED_DECODE:
        return (variant.launch(x.q1, x.q, x.k, x.v, x.cache_position, x.mask, _settings(problem), config),)
    if problem.op == ATTENTION_LAYER:
        return (run_layer(variant, config, problem, x),)
    geo = LaunchGeometry.prepare(x.q, x.k, x.v, x.qstart, x.qend, x.cache_position, x.mask, problem.window)
    if problem.op == SPAN_BACKWARD:
        fwd = REGISTRY.fallback(problem._replace(op="span_forward"))
        out, lse = fwd.launch(geo, fwd.default(problem))
        return tuple(variant.launch(geo, config, out, lse, x.grad_out))
    out, _ = variant.launch(geo, config)
    return (out,)


def run_layer(variant: Variant, config: KernelConfig, problem: Problem, x: Inputs) -> torch.Tensor:
    """The whole layer's forward with ``variant`` as its search; the span part by the span ops' dispatch."""
    settings = _settings(problem).for_keys(problem.keys)
    anchors = variant.launch(x.q1, x.k, x.cache_position, x.mask, settings, config)
    power = problem.params.arguments

    def span_attention(qstart, qend):
        return torch_ops.span_forward(
            x.q, x.k, x.v, qstart, qend, x.cache_position, x.mask, problem.sw_index, power["search_power"],
            power["inv_search_power_int"], 0,
        )[0]

    return attention_layer(x.q1, x.k, anchors, x.cache_position, x.mask, settings, span_attention, x.q.dtype)


def relative_error(got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> float:
    """Largest max|got - expected| / max(1, max|expected|) over the outputs; inf on NaN."""
    worst = 0.0
    for a, b in zip(got, expected):
        if torch.isnan(a).any():
            return float("inf")
        scale = max(1.0, b.abs().max().item()) if b.numel() else 1.0
        worst = max(worst, (a.double() - b.double()).abs().max().item() / scale if a.numel() else 0.0)
    return worst


def rows_off(got: torch.Tensor, expected: torch.Tensor, tol: float) -> float:
    """Fraction of output rows (the last dimension) whose max |got - expected| / max(1, max |expected|)
    exceeds ``tol`` (NaN counts)."""
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    error = (got.double() - expected.double()).abs().amax(dim=-1) / scale
    return (~(error <= tol)).double().mean().item() if error.numel() else 0.0


def reference_outputs(problem: Problem, x: Inputs) -> tuple[torch.Tensor, ...]:
    """The float64 reference outputs for ``x``."""
    reference = REGISTRY.reference(problem.op)
    return run(reference, reference.default(problem), problem._replace(dtype="float64"), x.cast(torch.float64))


def tolerance(problem: Problem) -> float:
    """Accepted relative error for the problem's dtype (gradients sum more terms: 4x)."""
    return TOLERANCE[problem.dtype] * (4.0 if problem.op == SPAN_BACKWARD else 1.0)


def _guard(fn, what: str):
    try:
        return fn()
    except CandidateFailed:
        raise
    except Exception as err:  # compile errors, launch failures, out of memory: the candidate fails
        raise CandidateFailed(f"{what}: {err.__class__.__name__}: {str(err)[:300]}", classify(err), is_sticky(err)) from err


def context_usable(device: torch.device) -> bool:
    """False when the device's CUDA context no longer works (a sticky error from an earlier launch)."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return True
    except Exception:
        return False


def _prefilled_run(variant: Variant, config: KernelConfig, problem: Problem, x: Inputs, what: str) -> tuple[torch.Tensor, ...]:
    """``run`` with NaN-prefilled allocations, its failures as CandidateFailed."""
    def call():
        with nan_prefilled():
            outputs = run(variant, config, problem, x)
        if x.k.is_cuda:
            torch.cuda.synchronize(x.k.device)  # an asynchronous fault shows here, as this candidate's
        return outputs
    return _guard(call, what)


class ProblemBench:
    """Everything needed to check and time candidates of one problem on one device."""

    def __init__(self, case: Case, device: torch.device, seed: int) -> None:
        self.case = case
        self.problem = case.problem
        self.device = device
        self.inputs = make_inputs(case, device, seed)
        small = dict(queries=min(self.problem.queries, CHECK_QUERIES), keys=min(self.problem.keys, CHECK_KEYS))
        if self.problem.op == STAGED_DECODE:
            small["queries"] = 1
        if small["keys"] < self.problem.keys and self.problem.op != STAGED_DECODE:
            small["keys"] = max(small["keys"], small["queries"])
        check_case = replace(case, cache_fill=min(case.cache_fill, small["keys"]) if case.cache_fill else None)
        self.check_problem = self.problem._replace(queries=small["queries"], keys=small["keys"])
        self.check_inputs = make_inputs(check_case, device, seed + 1, **small)
        gen = torch.Generator(device=device).manual_seed(seed + 2)
        self.checks = [(x, reference_outputs(self.check_problem, x)) for x in [self.check_inputs] + [
            decode_step(check_case, self.check_inputs, None, kind, gen) for kind in case.mask_kinds[1:]]]
        self.timed = [self.inputs] + [decode_step(case, self.inputs, fill, kind, gen)
                                      for fill, kind in case.timed_inputs()[1:]]
        self.default_variant = REGISTRY.fallback(self.problem)
        self.default_config = self.default_variant.default(self.problem)
        self._baseline: tuple[torch.Tensor, ...] | None = None

    def check(self, variant: Variant, config: KernelConfig, runs: int = CHECK_RUNS) -> float:
        """The candidate's error against the reference over ``runs`` rounds of every check (check
        size, then real size); raises CandidateFailed when it is wrong."""
        error = 0.0
        for _ in range(runs):
            error = max(error, self._check_size(variant, config))
            if self.problem.keys > self.check_problem.keys or self.problem.queries > self.check_problem.queries:
                self._real_size(variant, config)
        return error

    def set_baseline(self, variant: Variant, config: KernelConfig) -> None:
        """Make ``variant``/``config`` (a candidate that passed before) the real-size baseline."""
        self._baseline = None
        if self.problem.keys > self.check_problem.keys or self.problem.queries > self.check_problem.queries:
            self._real_size(variant, config)

    def _check_size(self, variant: Variant, config: KernelConfig) -> float:
        error = 0.0
        for x, expected in self.checks:
            got = _prefilled_run(variant, config, self.check_problem, x, "check-size run failed")
            error = max(error, relative_error(got, expected))
        if not error <= tolerance(self.problem):
            raise CandidateFailed(f"wrong result: relative error {error:.3g} > {tolerance(self.problem):.3g} against the float64 reference")
        return error

    def _real_size(self, variant: Variant, config: KernelConfig) -> None:
        full = _prefilled_run(variant, config, self.problem, self.inputs, "real-size run failed")
        if any(torch.isnan(t).any() for t in full):
            raise CandidateFailed("NaN in the real-size result")
        if self._baseline is None:  # the first candidate that passed the reference check (the default)
            self._baseline = full
        if self.problem.op == ATTENTION_LAYER:  # fp32 near-ties may pick other anchors in a few rows
            off = rows_off(full[0], self._baseline[0], 2 * tolerance(self.problem))
            if not off <= NEAR_TIE_ROWS:
                raise CandidateFailed(f"wrong result at real size: {off:.3%} of the rows differ from the first checked candidate")
            return
        full_error = relative_error(full, self._baseline)
        if not full_error <= 2 * tolerance(self.problem):
            raise CandidateFailed(f"wrong result at real size: relative error {full_error:.3g} against the first checked candidate")

    def time_ms(self, variant: Variant, config: KernelConfig) -> float:
        """Median time of one call in milliseconds (the mean over the case's fills and mask kinds)."""
        graph = self.problem.op == STAGED_DECODE
        calls = [lambda x=x: run(variant, config, self.problem, x) for x in self.timed]
        times = [_guard(lambda call=call: measure(call, self.device, graph=graph), "timing failed") for call in calls]
        return statistics.fmean(times)


def measure(call, device: torch.device, graph: bool = False, cpu_runs: int = 3) -> float:
    """Median milliseconds of ``call``: do_bench (L2 flushed), a replayed CUDA graph if ``graph``."""
    if device.type != "cuda":
        call()
        times = []
        for _ in range(cpu_runs):
            start = time.perf_counter()
            call()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    from triton.testing import do_bench

    if not graph:
        return do_bench(call, return_mode="median")
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            call()
    torch.cuda.current_stream(device).wait_stream(stream)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        call()
    return do_bench(cuda_graph.replay, return_mode="median")


