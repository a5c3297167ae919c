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
from dataclasses import replace

import torch

from .. import dispatch
from ..launch import KernelConfig
from ..ops.inputs import Inputs
from ..ops.spec import Parts
from ..problem import Problem
from ..registry import REGISTRY, Variant
from .faults import WRONG_NUMBERS, classify, is_sticky
from .nan_fill import nan_prefilled
from .workload import Case

CHECK_QUERIES = 64
CHECK_KEYS = 16384
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


def make_inputs(case: Case, device: torch.device, seed: int, queries: int | None = None,
                keys: int | None = None) -> Inputs:
    """Random inputs of the case's shape from ``seed`` (``queries``/``keys`` override Lq/Lkv for check sizes)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return REGISTRY.spec(case.problem.op).inputs(case, device, gen, queries or case.problem.queries,
                                                 keys or case.problem.keys)


def run(variant: Variant, config: KernelConfig, problem: Problem, x: Inputs, parts: Parts) -> tuple[torch.Tensor, ...]:
    """Run a candidate once with its op's other parts at ``parts``; returns its outputs (out; or dQ, dK, dV)."""
    return REGISTRY.spec(problem.op).run(variant, config, problem, x, parts)


PartNames = dict[str, tuple[str, dict]]  # part -> (variant name, configuration): picklable, for a worker


def resolve_parts(problem: Problem, chosen: PartNames | None = None) -> Parts:
    """The configuration of each of ``problem``'s parts (``OpSpec.parts``), fixed for every run: the
    one ``chosen`` names, else the dispatcher's choice for the part's own problem."""
    parts = {}
    for name, part in REGISTRY.spec(problem.op).parts(problem).items():
        if chosen and name in chosen:
            variant, config = chosen[name]
            parts[name] = (REGISTRY.get(part.op, variant), KernelConfig(config))
        else:
            choice = dispatch.select(part)
            parts[name] = (choice.variant, choice.config)
    return parts


def reference_parts(problem: Problem) -> Parts:
    """Every part of ``problem`` at its op's float64 reference."""
    return {name: (REGISTRY.reference(part.op), REGISTRY.reference(part.op).default(part))
            for name, part in REGISTRY.spec(problem.op).parts(problem).items()}


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
    """The float64 reference outputs for ``x`` (every part at its reference too)."""
    reference, wide = REGISTRY.reference(problem.op), problem._replace(dtype="float64")
    return run(reference, reference.default(problem), wide, x.cast(torch.float64), reference_parts(wide))


def tolerance(problem: Problem) -> float:
    """Accepted relative error for the problem's dtype (its op's spec)."""
    return REGISTRY.spec(problem.op).tolerance(problem)


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


def _prefilled_run(variant: Variant, config: KernelConfig, problem: Problem, x: Inputs, parts: Parts,
                   what: str) -> tuple[torch.Tensor, ...]:
    """``run`` with NaN-prefilled allocations, its failures as CandidateFailed."""
    def call():
        with nan_prefilled():
            outputs = run(variant, config, problem, x, parts)
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)  # an asynchronous fault shows here, as this candidate's
        return outputs
    return _guard(call, what)


class ProblemBench:
    """Everything needed to check and time candidates of one problem on one device."""

    def __init__(self, case: Case, device: torch.device, seed: int, parts: PartNames | None = None) -> None:
        """``parts`` names the configurations of the op's other parts (default: the dispatcher's
        choices, resolved here once)."""
        self.case = case
        self.problem = case.problem
        self.device = device
        self.spec = REGISTRY.spec(self.problem.op)
        self.inputs = make_inputs(case, device, seed)
        small = dict(queries=1 if self.spec.single_query else min(self.problem.queries, CHECK_QUERIES),
                     keys=min(self.problem.keys, CHECK_KEYS))
        if small["keys"] < self.problem.keys and not self.spec.single_query:
            small["keys"] = max(small["keys"], small["queries"])
        check_case = replace(case, cache_fill=min(case.cache_fill, small["keys"]) if case.cache_fill else None)
        self.check_problem = self.problem._replace(queries=small["queries"], keys=small["keys"])
        self.check_inputs = make_inputs(check_case, device, seed + 1, **small)
        self.parts = resolve_parts(self.problem, parts)
        self.check_parts = resolve_parts(self.check_problem, parts)
        gen = torch.Generator(device=device).manual_seed(seed + 2)
        self.checks = [(x, reference_outputs(self.check_problem, x)) for x in
                       [self.check_inputs, *self.spec.variations(check_case, self.check_inputs, gen, timed=False)]]
        self.timed = [self.inputs, *self.spec.variations(case, self.inputs, gen, timed=True)]
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
            got = _prefilled_run(variant, config, self.check_problem, x, self.check_parts, "check-size run failed")
            error = max(error, relative_error(got, expected))
        if not error <= tolerance(self.problem):
            raise CandidateFailed(f"wrong result: relative error {error:.3g} > {tolerance(self.problem):.3g} against the float64 reference")
        return error

    def _real_size(self, variant: Variant, config: KernelConfig) -> None:
        full = _prefilled_run(variant, config, self.problem, self.inputs, self.parts, "real-size run failed")
        if any(torch.isnan(t).any() for t in full):
            raise CandidateFailed("NaN in the real-size result")
        if self._baseline is None:  # the first candidate that passed the reference check (the default)
            self._baseline = full
        if self.spec.near_ties:  # fp32 near-ties may pick other anchors in a few rows
            off = rows_off(full[0], self._baseline[0], 2 * tolerance(self.problem))
            if not off <= NEAR_TIE_ROWS:
                raise CandidateFailed(f"wrong result at real size: {off:.3%} of the rows differ from the first checked candidate")
            return
        full_error = relative_error(full, self._baseline)
        if not full_error <= 2 * tolerance(self.problem):
            raise CandidateFailed(f"wrong result at real size: relative error {full_error:.3g} against the first checked candidate")

    def time_ms(self, variant: Variant, config: KernelConfig) -> float:
        """Median time of one call in milliseconds (the mean over the case's fills and mask kinds)."""
        graph = self.spec.graph_timed
        calls = [lambda x=x: run(variant, config, self.problem, x, self.parts) for x in self.timed]
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


