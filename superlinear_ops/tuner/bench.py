"""``bench`` and ``verify``: the heuristic default, the tuned choice, dense SDPA and the lower bound,
side by side in one run, per problem of a workload."""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import torch

from .. import dispatch
from ..ops.inputs import Inputs
from ..problem import device_identity
from ..registry import REGISTRY
from .runner import CandidateFailed, ProblemBench, measure
from .tune import unique_cases
from .workload import Case, load

log = logging.getLogger(__name__)

# Measured ceilings per GPU: copy bandwidth (bytes/s) and bf16 tensor-core rate (FLOP/s).
PEAKS = {"NVIDIA H200": (4.3e12, 790e12), "NVIDIA H100 80GB HBM3": (3.0e12, 798e12)}


def device_peaks(device_name: str) -> tuple[float, float]:
    """(copy bandwidth in bytes/s, bf16 tensor-core FLOP/s) measured on the GPU named ``device_name``
    (``PEAKS``); nan for a GPU with no figures."""
    return PEAKS.get(device_name, (math.nan, math.nan))


@dataclass(frozen=True)
class BenchRow:
    """One problem's timings (milliseconds) and its lower bound."""

    label: str
    op: str
    default_ms: float
    tuned_ms: float
    tuned_choice: str
    tuned_source: str
    sdpa_ms: float  # the fastest backend's
    sdpa_kind: str  # what was timed, and the fastest backend's name
    lower_bound_ms: float
    lower_bound_basis: str
    sdpa_by_backend: dict  # every backend's ms, or why it did not run

    @property
    def speedup(self) -> float:
        """Default over tuned."""
        return self.default_ms / self.tuned_ms if self.tuned_ms > 0 else float("nan")


def lower_bound(case: Case, timed: Sequence[Inputs]) -> tuple[float, str]:
    """max(bytes / bandwidth, FLOPs / tensor rate) in ms for this device's peaks (nan if unknown), the
    case's traffic taken on the inputs it is timed on (``ProblemBench.timed``)."""
    return bound_of_traffic(case, *traffic(case, timed))


def bound_of_traffic(case: Case, bytes_: float, flops: float) -> tuple[float, str]:
    """(ms, basis) of ``lower_bound`` for traffic already counted."""
    bandwidth, rate = device_peaks(case.problem.device.name)
    if math.isnan(bandwidth):
        return math.nan, "no peak figures for this device"
    seconds = max(bytes_ / bandwidth, flops / rate)
    basis = f"{bytes_ / 1e9:.3g} GB at {bandwidth / 1e12:.1f} TB/s, {flops / 1e12:.3g} TFLOP at {rate / 1e12:.0f} TFLOP/s"
    return seconds * 1e3, basis


def traffic(case: Case, timed: Sequence[Inputs]) -> tuple[float, float]:
    """(bytes every implementation must move, FLOPs it must compute) for one call on the timed inputs
    (the op's cost model)."""
    return REGISTRY.spec(case.problem.op).traffic(case, timed)


DENSE_BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")  # SDPBackend names, fastest first on Hopper
# Dense calls above this many FLOPs take over a second each at any tensor-core rate of today's GPUs
# (about 5 PFLOP for 32,768 queries over 10M keys): not timed, the reason recorded instead.
DENSE_FLOP_LIMIT = 1e15


@dataclass(frozen=True)
class DenseTimes:
    """Dense ``scaled_dot_product_attention`` on a problem's inputs under each backend forced: the
    milliseconds of those that ran and the reason of those that did not, and the fastest."""

    kind: str  # what was timed, e.g. 'causal forward + backward'
    by_backend: dict[str, float | str]

    @property
    def fastest(self) -> tuple[str, float]:
        """(backend name, ms) of the fastest backend that ran; ('none', nan) when none did."""
        ran = {name: ms for name, ms in self.by_backend.items() if isinstance(ms, float)}
        if not ran:
            return "none", math.nan
        name = min(ran, key=ran.get)
        return name, ran[name]


def _forced(backend: str, call):
    """``call`` run under one SDPA backend only."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run():
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return call()

    return run


def time_backends(make_call, device: torch.device, graph: bool, backends=DENSE_BACKENDS) -> dict[str, float | str]:
    """{backend: ms or 'unavailable: why'}; ``make_call(expand)`` builds the call, with K/V repeated
    to every query head when ``expand`` (backends without grouped-query support take that form)."""
    times: dict[str, float | str] = {}
    for backend in backends:
        for expand in (False, True):
            name = f"{backend} (K/V expanded to every query head)" if expand else backend
            try:
                times[name] = measure(_forced(backend, make_call(expand)), device, graph=graph)
                break
            except RuntimeError as err:
                times[name] = f"unavailable: {str(err).strip().splitlines()[0][:160]}"
    return times


def dense_times(bench: ProblemBench) -> DenseTimes:
    """Dense SDPA on the same inputs under each of ``DENSE_BACKENDS`` forced, what the op's spec
    compares with (``OpSpec.dense``; the mean over its timed inputs, e.g. a static cache's fills;
    nothing for an op without a dense counterpart; the reason, untimed, for calls above ``DENSE_FLOP_LIMIT``)."""
    dense = bench.spec.dense(bench.case, bench.inputs)
    if dense.flops > DENSE_FLOP_LIMIT:
        reason = (f"not timed: {dense.flops / 1e15:.1f} PFLOP a call, over the {DENSE_FLOP_LIMIT / 1e15:g} PFLOP "
                  "that a GPU does in about a second")
        return DenseTimes(dense.kind, dict.fromkeys(DENSE_BACKENDS, reason))
    per_input = [time_backends(make_call, bench.device, graph=dense.graph) for make_call in dense.calls]
    merged = {name: (statistics.fmean(t[name] for t in per_input)
                     if all(isinstance(t.get(name), float) for t in per_input) else per_input[0][name])
              for name in (per_input[0] if per_input else ())}
    return DenseTimes(dense.kind, merged)


def sdpa_time(bench: ProblemBench) -> tuple[float, str]:
    """(ms, what) of the fastest dense SDPA backend on the same inputs (``dense_times``)."""
    dense = dense_times(bench)
    name, ms = dense.fastest
    return ms, f"{dense.kind}, {name}"


def bench_case(case: Case, device: torch.device, seed: int = 0) -> BenchRow:
    """Time the default and the dispatcher's choice, dense SDPA, and the lower bound for one case."""
    bench = ProblemBench(case, device, seed)
    default_ms = bench.time_ms(bench.default_variant, bench.default_config)
    choice = dispatch.select(case.problem)
    bench.check(choice.variant, choice.config)
    tuned_ms = bench.time_ms(choice.variant, choice.config)
    dense = dense_times(bench)
    backend, sdpa_ms = dense.fastest
    bound, basis = lower_bound(case, bench.timed)
    config = choice.config
    return BenchRow(
        case.label, case.problem.op, default_ms, tuned_ms,
        f"{choice.variant.name} {config.text()}", choice.source,
        sdpa_ms, f"{dense.kind}, {backend}", bound, basis, dense.by_backend,
    )


def run_bench(workload_path: str, device: torch.device, output: str, plot: str | None,
              only: str | None = None) -> list[BenchRow]:
    """Bench every problem of a workload; writes JSON (and a PNG when matplotlib is installed)."""
    workload = load(workload_path)
    identity = device_identity(device)
    rows = []
    for case in unique_cases(workload.cases(identity, only)):
        log.info("bench: %s", case.label)
        rows.append(bench_case(case, device))
    document = {
        "workload": workload.name,
        "device": identity._asdict(),
        "torch": torch.__version__,
        "rows": [{**asdict(r), "speedup": r.speedup} for r in rows],
    }
    with open(output, "w", encoding="utf-8") as fh:
        json.dump(document, fh, indent=2)
    if plot:
        _plot(rows, plot, workload.name, identity.name)
    return rows


def _plot(rows: list[BenchRow], path: str, workload: str, device: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot written")
        return
    labels = [r.label for r in rows]
    series = [("default", [r.default_ms for r in rows]), ("tuned", [r.tuned_ms for r in rows]),
              ("dense SDPA", [r.sdpa_ms for r in rows]), ("lower bound", [r.lower_bound_ms for r in rows])]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 1.1), 5))
    width = 0.2
    for i, (name, values) in enumerate(series):
        ax.bar([j + (i - 1.5) * width for j in range(len(rows))], [v if v == v else 0 for v in values], width, label=name)
    ax.set_yscale("log")
    ax.set_ylabel("milliseconds per call (log)")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
    ax.set_title(f"{workload} on {device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


VERIFY_ROUNDS = 5


def side_by_side(bench: ProblemBench, *candidates: tuple) -> list[float]:
    """Median milliseconds of each (variant, config), timed in ``VERIFY_ROUNDS`` interleaved rounds
    so that drifts of the machine (clocks, host load) fall on every candidate alike."""
    times: list[list[float]] = [[] for _ in candidates]
    for _ in range(VERIFY_ROUNDS):
        for samples, (variant, config) in zip(times, candidates):
            samples.append(bench.time_ms(variant, config))
    return [statistics.median(samples) for samples in times]


@dataclass(frozen=True)
class VerifyRow:
    """One problem's verdict: the default and the cached winner side by side, and dense SDPA."""

    label: str
    default_ms: float
    tuned_ms: float
    verdict: str  # 'ok', 'no tuned entry' or 'FAIL: why'
    dense: DenseTimes | None = None

    @property
    def failed(self) -> bool:
        """True when the winner failed its check or is slower than the default."""
        return self.verdict.startswith("FAIL")


def verify(workload_path: str, device: torch.device, threshold: float, only: str | None = None) -> Iterator[VerifyRow]:
    """Re-measure each problem's cached winner against the default, with dense SDPA under each backend:
    one row per problem, yielded as soon as it is measured."""
    workload = load(workload_path)
    for case in unique_cases(workload.cases(device_identity(device), only)):
        explanation = dispatch.explain(case.problem)
        choice = explanation.choice
        if choice is None or choice.source == dispatch.HEURISTIC:
            yield VerifyRow(case.label, math.nan, math.nan, "no tuned entry")
            continue
        bench = ProblemBench(case, device, seed=0)
        try:
            bench.check(choice.variant, choice.config)
        except CandidateFailed as err:
            yield VerifyRow(case.label, math.nan, math.nan, f"FAIL: {err}")
            continue
        default = (bench.default_variant, bench.default_config)
        if (choice.variant, choice.config) == default:  # one configuration: nothing to compare but the timer's noise
            (default_ms,) = side_by_side(bench, default)
            tuned_ms, verdict = default_ms, "ok (the winner is the default)"
        else:
            default_ms, tuned_ms = side_by_side(bench, default, (choice.variant, choice.config))
            verdict = "FAIL: slower than the default" if tuned_ms > default_ms * (1.0 + threshold) else "ok"
        yield VerifyRow(case.label, default_ms, tuned_ms, verdict, dense_times(bench))
