"""Decode variants side by side on a GPU, in one run: the original-style 'staged' orchestration,
'fused_search' (stripe search + top-k + spans in one Triton kernel), 'split_window' (that search,
then chunked span/window attention merged with the gate), 'grouped' (stripe search and window once
per KV group, tensor-core span chunks merged by the last program: two launches), dense SDPA and
the lower bound. Every variant is checked against the float64 reference first; decode is timed by
replaying a CUDA graph (and eagerly at 1M, also through the public API and its dispatcher); each
variant's kernels are timed one by one with the PyTorch profiler; each variant's graph is replayed
at five advancing positions and compared with eager calls.

Run on a GPU:  PYTHONPATH=. python benchmarks/decode_variants.py --out decode_variants.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from superlinear_ops import decode_span_attention_staged_gqa, dispatch
from superlinear_ops.ops.inputs import Inputs
from superlinear_ops.problem import device_identity
from superlinear_ops.registry import REGISTRY
from superlinear_ops.settings import SpanSettings
from superlinear_ops.tuner.bench import lower_bound, sdpa_time
from superlinear_ops.tuner.runner import ProblemBench, measure, run
from superlinear_ops.tuner.workload import Case, load

VARIANTS = ("staged", "split_window", "grouped")


def kernel_times(call, device: torch.device, runs: int = 20) -> dict[str, float]:
    """Median device milliseconds of each kernel launched by ``call`` (PyTorch profiler)."""
    call()
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            call()
        torch.cuda.synchronize(device)
    times: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times.setdefault(event.name[:60], []).append(event.device_time_total / 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def api_call(bench: ProblemBench, inputs: Inputs | None = None):
    """The public API on ``inputs`` (default: the bench's): validation off, the dispatcher's choice."""
    p, x = bench.problem, inputs or bench.inputs
    bf, ff, sp = p.factors
    return lambda: decode_span_attention_staged_gqa(  # noqa: E731
        x.q1, x.q, x.k, x.v, x.cache_position, x.mask, p.sw_index, p.spans, backward_factor=bf,
        forward_factor=ff, span_power=sp, **p.params.arguments,
    )


def graph_replay_matches_eager(bench: ProblemBench, name: str) -> float:
    """Max |replay - eager| over five advancing decode positions (static-cache inputs)."""
    variant = REGISTRY.get("staged_decode", name)
    problem, x = bench.problem, bench.inputs
    config = variant.default(problem)
    keys = problem.keys
    cache_position = torch.tensor([keys // 2], device=bench.device)
    mask = torch.zeros(problem.batch, keys, dtype=torch.bool, device=bench.device)
    mask[:, : keys // 2 + 1] = True
    settings = SpanSettings.of_problem(problem)
    call = lambda: variant.launch(x.q1, x.q, x.k, x.v, cache_position, mask, settings, config)  # noqa: E731
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = call()
    worst = 0.0
    for step in range(1, 6):
        cache_position.fill_(keys // 2 + step)
        mask[:, keys // 2 + step] = True
        x.q1.normal_()
        graph.replay()
        worst = max(worst, (static_out.float() - call().float()).abs().max().item())
    return worst


def decode_cases(device: torch.device) -> list[Case]:
    """Model M's decode problems without a mask over a full context (decode_masks.py has
    those), the static cache, and B = 4 at 256K."""
    workload = load("tuning/superlinear-exp-v0.1.yaml")
    cases = [c for c in workload.cases(device_identity(device)) if c.problem.op == "staged_decode" and not c.mask_kinds]
    b4 = next(c for c in cases if c.label == "decode 262144")
    return [*cases, dataclasses.replace(b4, label="decode 262144, B=4", problem=b4.problem._replace(batch=4))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="decode_variants.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_variants.py needs a CUDA GPU; none is available")
    device = torch.device("cuda")
    cases = decode_cases(device)
    rows = []
    for case in cases:
        bench = ProblemBench(case, device, seed=0)
        row = {"label": case.label}
        for name in VARIANTS:
            variant = REGISTRY.get("staged_decode", name)
            config = variant.default(case.problem)
            row[f"{name}_error"] = bench.check(variant, config)
            row[f"{name}_graph_ms"] = bench.time_ms(variant, config)
            call = lambda: run(variant, config, case.problem, bench.inputs, bench.parts)  # noqa: E731
            row[f"{name}_kernels_ms"] = kernel_times(call, device)
            if case.label == "decode 1048576":
                row[f"{name}_eager_ms"] = measure(call, device)
        if case.label == "decode 1048576":
            row["api_eager_ms"] = measure(api_call(bench), device)
            row["api_choice"] = dispatch.select(case.problem).variant.name
        row["sdpa_ms"], _ = sdpa_time(bench)
        row["lower_bound_ms"], row["bound_basis"] = lower_bound(case, bench.timed)
        rows.append(row)
        print(json.dumps(row), flush=True)
    graph_check = {name: graph_replay_matches_eager(ProblemBench(cases[1], device, seed=1), name) for name in VARIANTS}
    print("graph replay vs eager, max |diff|:", graph_check, flush=True)
    with open(args.out, "w") as fh:
        json.dump({"rows": rows, "graph_replay_vs_eager": graph_check, "gpu": torch.cuda.get_device_name()}, fh, indent=2)


if __name__ == "__main__":
    main()
