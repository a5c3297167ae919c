"""Masked decode beside unmasked decode and dense attention on a GPU, in one run.

For model M's decode over a full context of 4K, 64K and 1M keys (B = 1), one row per mask: none,
all ones, 10% holes, 100 left-padded keys (bool masks, and the same masks as int64, as model code
passes them). Each row has: the public API's decode step (the dispatcher's choice) replayed from a
CUDA graph (median of do_bench over replays, L2 flushed), checked against the float64 reference
first; its kernels one by one (profiler); dense SDPA on the same inputs with each backend forced
(the fastest named); the lower bound (``bench``'s: the bytes every implementation must move over
the GPU's measured copy bandwidth, or its FLOPs over the tensor-core rate, whichever is longer); the
largest difference between a graph replay and an eager call on fresh queries; and ``explain``.
Every row of ours is timed before any dense backend runs (their slow backends leave the GPU slower
for a while), so every row's inputs stay on the GPU until the end (about 13 GB at 1M).

Run on a GPU:  PYTHONPATH=. python benchmarks/decode_masks.py --out decode_masks.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import torch.nn.functional as F
from decode_variants import api_call, kernel_times

from superlinear_ops import dispatch
from superlinear_ops.ops.inputs import Inputs
from superlinear_ops.ops.spec import grouped_heads
from superlinear_ops.problem import device_identity
from superlinear_ops.tuner.bench import DENSE_BACKENDS, lower_bound, time_backends
from superlinear_ops.tuner.runner import ProblemBench, measure
from superlinear_ops.tuner.workload import Case, load

CONTEXTS = (4096, 65536, 1048576)
MASKS = (("no mask", None), ("mask of ones", "ones"), ("10% holes", "holes"), ("100 left-padded keys", "left_padding"))
BACKENDS = (*DENSE_BACKENDS, "MATH")


def masked_case(context: int, kind: str | None) -> Case:
    """Model M's decode over ``context`` keys with a mask of ``kind`` (None: no mask)."""
    workload = load("tuning/superlinear-exp-v0.1.yaml")
    base = next(c for c in workload.cases(device_identity(torch.device("cuda"))) if c.label == f"decode {context}")
    problem = base.problem._replace(masked=kind is not None)
    return dataclasses.replace(base, problem=problem, mask_kinds=(kind,) if kind else ())


def sdpa_times(x: Inputs, device: torch.device, backends: tuple[str, ...] = BACKENDS) -> dict[str, float | str]:
    """Median graph-replay ms of dense SDPA with the inputs' mask per backend forced (its reason where
    it cannot run, e.g. out of memory for K/V repeated to every query head)."""
    mask = None if x.mask is None else (x.mask[:, None, None, : x.k.shape[2]] != 0)

    def call(expand):
        k, v = grouped_heads(x, expand)
        return lambda: F.scaled_dot_product_attention(x.q, k, v, attn_mask=mask, enable_gqa=not expand)

    return time_backends(call, device, graph=True, backends=backends)


def replay_vs_eager(call, x: Inputs, device: torch.device, steps: int = 3) -> float:
    """Max |graph replay - eager| over ``steps`` fresh queries."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        call()
        call()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = call()
    worst = 0.0
    for _ in range(steps):
        x.q.normal_()
        x.q1.normal_()
        graph.replay()
        worst = max(worst, (static_out.float() - call().float()).abs().max().item())
    return worst


def measure_row(case: Case, label: str, mask_dtype: torch.dtype, device: torch.device) -> tuple[dict, Inputs]:
    """One row of the table without its dense columns (see the module docstring), and its inputs."""
    bench = ProblemBench(case, device, seed=0)
    x = bench.inputs if bench.inputs.mask is None else dataclasses.replace(bench.inputs, mask=bench.inputs.mask.to(mask_dtype))
    explanation = dispatch.explain(case.problem)
    choice = explanation.choice
    call = api_call(bench, x)
    row = {
        "context": case.problem.keys, "mask": label, "mask_dtype": None if x.mask is None else str(mask_dtype),
        "error_vs_float64_reference": bench.check(choice.variant, choice.config),
        "ours_graph_ms": measure(call, device, graph=True),
        "ours_kernels_ms": kernel_times(call, device),
        "choice": f"{choice.variant.name} {choice.config.text()}", "source": choice.source, "rule": explanation.rule,
        "explain": explanation.text(),
    }
    row["lower_bound_ms"], row["lower_bound_basis"] = lower_bound(case, bench.timed)
    row["replay_vs_eager_max_abs"] = replay_vs_eager(call, x, device)
    return row, x


def add_dense(row: dict, x: Inputs, device: torch.device) -> None:
    """The row's dense SDPA columns (timed after every row of ours: the slow backends, MATH above
    all, leave the GPU slower for a while, which showed as about 10 us on a 1M decode step)."""
    row["sdpa_ms"] = sdpa_times(x, device)
    timed = {name: ms for name, ms in row["sdpa_ms"].items() if isinstance(ms, float)}
    row["sdpa_best"] = min(timed, key=timed.get) if timed else None
    row["sdpa_best_ms"] = timed.get(row["sdpa_best"], float("nan"))
    row["ours_over_sdpa"] = row["ours_graph_ms"] / row["sdpa_best_ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--mask-dtypes", nargs="+", choices=("bool", "int64"), default=["bool", "int64"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_masks.py needs a CUDA GPU; none is available")
    device = torch.device("cuda")
    measured = [measure_row(masked_case(context, kind), label, getattr(torch, dtype), device)
                for context in args.contexts for label, kind in MASKS
                for dtype in (args.mask_dtypes if kind else args.mask_dtypes[:1])]
    rows = []
    for row, x in measured:
        add_dense(row, x, device)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("explain", "ours_kernels_ms")}), flush=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
