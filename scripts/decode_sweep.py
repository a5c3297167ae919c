"""Sweep the grouped decode kernels on a GPU: span chunk length x (block_k, num_warps, num_stages),
with and without programmatic dependent launch, timed by replaying a CUDA graph, each result
compared with the default configuration's; then the kernels of the best configuration timed one by
one with the PyTorch profiler.

Run on a GPU:  PYTHONPATH=. python scripts/decode_sweep.py --out sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from decode_compare import decode_cases, kernel_times

from superlinear_ops.decode.grouped_kernels import grouped_decode_attention
from superlinear_ops.decode.tables import decode_tables
from superlinear_ops.registry import REGISTRY
from superlinear_ops.settings import SpanSettings
from superlinear_ops.tuner.bench import lower_bound, sdpa_time
from superlinear_ops.tuner.runner import ProblemBench, measure

CHUNKS = (None, 512, 1024, 2048)  # None: the heuristic chunk length
LAUNCHES = ((64, 4, 3), (64, 4, 2), (128, 4, 2), (32, 4, 3))  # (block_k, num_warps, num_stages)
PDL = (False, True)


def grouped_call(bench: ProblemBench, chunk: int | None, block_k: int, num_warps: int, num_stages: int, pdl: bool):
    """A closure running the grouped kernels on the bench's inputs with this configuration."""
    p, x = bench.problem, bench.inputs
    settings = SpanSettings.of_problem(p)
    tables = decode_tables(p.keys, settings, bench.device)
    return lambda: grouped_decode_attention(  # noqa: E731
        x.q1, x.q, x.k, x.v, x.cache_position, x.mask, tables.offsets, tables.back, tables.forward,
        settings.window, p.spans, tables.longest_span, block_k=block_k, num_warps=num_warps,
        num_stages=num_stages, chunk=chunk, pdl=pdl,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="decode_sweep.json")
    args = parser.parse_args()
    device = torch.device("cuda")
    cases = decode_cases(device)
    grouped = REGISTRY.get("staged_decode", "grouped")
    rows = []
    for case in cases:
        bench = ProblemBench(case, device, seed=0)
        row = {"label": case.label, "grouped_error": bench.check(grouped, grouped.default(case.problem))}
        reference = grouped_call(bench, None, 64, 4, 3, False)().float()
        sweep = []
        for chunk, (block_k, warps, stages), pdl in itertools.product(CHUNKS, LAUNCHES, PDL):
            call = grouped_call(bench, chunk, block_k, warps, stages, pdl)
            diff = (call().float() - reference).abs().max().item()
            sweep.append({"chunk": chunk, "block_k": block_k, "num_warps": warps, "num_stages": stages, "pdl": pdl,
                          "graph_ms": measure(call, device, graph=True), "max_diff_vs_default": diff})
        row["heuristic_ms"] = {str(r["pdl"]): r["graph_ms"] for r in sweep
                               if r["chunk"] is None and (r["block_k"], r["num_warps"], r["num_stages"]) == (64, 4, 3)}
        sweep.sort(key=lambda r: r["graph_ms"])
        row["best"] = best = sweep[0]
        row["top"] = sweep[:8]
        row["sweep"] = sweep
        best_call = grouped_call(bench, best["chunk"], best["block_k"], best["num_warps"], best["num_stages"], best["pdl"])
        row["kernels_ms"] = kernel_times(best_call, device)
        row["sdpa_ms"], _ = sdpa_time(bench)
        row["lower_bound_ms"], row["bound_basis"] = lower_bound(case)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("top", "sweep", "bound_basis")}), flush=True)
    with open(args.out, "w") as fh:
        json.dump({"rows": rows, "gpu": torch.cuda.get_device_name()}, fh, indent=2)


if __name__ == "__main__":
    main()
