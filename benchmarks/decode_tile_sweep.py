"""Sweep a chunked decode variant's tiles on a GPU beside the dispatcher's choice, in one run.

For each of model M's decode problems whose label matches ``--cases`` (the workload's labels, masked
problems included), every configuration of ``--variant`` (a decode variant that tunes ``chunk``:
grouped, stripe_spans, group_spans, one_launch or split_merge) in the product of ``--chunks`` x ``--block-k`` x
``--warps`` x ``--stages`` is checked against the float64 reference and timed as the tuner times
it (``ProblemBench``: a replayed CUDA graph, L2 flushed, the mean over the problem's mask kinds
and fills), beside the dispatcher's choice (the shipped file with a clean user cache) timed the
same way in the same run. Configurations the variant refuses are listed with their reason;
failures are kept with their message. One JSON row per problem is printed as it
finishes, and all of them are written to ``--out`` with the sweep sorted by time.

Run on a GPU:  PYTHONPATH=. python benchmarks/decode_tile_sweep.py --cases '^decode 65536' --stages 3 4 6 8
"""

from __future__ import annotations

import argparse
import itertools
import json
import re

import torch
from decode_variants import kernel_times

from superlinear_ops import dispatch
from superlinear_ops.launch import KernelConfig
from superlinear_ops.problem import STAGED_DECODE, device_identity
from superlinear_ops.registry import REGISTRY
from superlinear_ops.tuner.bench import lower_bound
from superlinear_ops.tuner.runner import ProblemBench, run
from superlinear_ops.tuner.workload import load

CHUNKED = tuple(v.name for v in REGISTRY.variants(STAGED_DECODE) if any(p.name == "chunk" for p in v.space))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="decode_tile_sweep.json", help="the JSON file written at the end")
    parser.add_argument("--workload", default="tuning/superlinear-exp-v0.1.yaml")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1 (a smoke run)")
    parser.add_argument("--cases", default="^decode (65536|1048576)", help="regex over the workload's decode labels")
    parser.add_argument("--variant", default="grouped", choices=CHUNKED, help="a decode variant that tunes chunk")
    parser.add_argument("--chunks", type=int, nargs="+", default=None,
                        help="span chunk lengths (default: the dispatcher's choice's, else the variant default's)")
    parser.add_argument("--block-k", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--stages", type=int, nargs="+", default=[3, 4, 6, 8])
    return parser.parse_args()


def timed(bench: ProblemBench, variant, config: KernelConfig) -> dict:
    """The configuration's reference error and time, or why it did not run."""
    row = {"config": dict(config)}
    reason = variant.violation(config) or variant.compile_check(bench.problem, config)
    if reason is not None:
        return {**row, "refused": reason}
    try:
        row["max_error"] = bench.check(variant, config)
        row["graph_ms"] = bench.time_ms(variant, config)
    except Exception as err:  # a wrong result, a compile error: kept with the row, the sweep goes on
        row["failed"] = f"{err.__class__.__name__}: {err}"
    return row


def main() -> None:
    args = parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("decode_tile_sweep.py needs a CUDA GPU; none is available (--device cpu under TRITON_INTERPRET=1 for a smoke run)")
    device = torch.device(args.device)
    pattern = re.compile(args.cases)
    cases = [c for c in load(args.workload).cases(device_identity(device))
             if c.problem.op == STAGED_DECODE and pattern.search(c.label)]
    if not cases:
        raise SystemExit(f"no decode problem of {args.workload} matches --cases {args.cases!r}")
    variant = REGISTRY.get(STAGED_DECODE, args.variant)
    rows = []
    for case in cases:
        bench = ProblemBench(case, device, seed=0)
        chosen = dispatch.select(case.problem)
        own = chosen.config if chosen.variant.name == args.variant else variant.default(case.problem)
        chunks = args.chunks or [own["chunk"]]
        row = {"label": case.label, "masks": list(case.mask_kinds), "dispatcher": {
            "variant": chosen.variant.name, "source": chosen.source, **timed(bench, chosen.variant, chosen.config)}}
        sweep = [timed(bench, variant, KernelConfig(block_k=b, num_warps=w, num_stages=s, chunk=c))
                 for c, b, w, s in itertools.product(chunks, args.block_k, args.warps, args.stages)]
        ran = sorted((r for r in sweep if "graph_ms" in r), key=lambda r: r["graph_ms"])
        row["sweep"] = ran + [r for r in sweep if "graph_ms" not in r]
        if ran and "graph_ms" in row["dispatcher"]:
            row["best_over_dispatcher"] = ran[0]["graph_ms"] / row["dispatcher"]["graph_ms"]
        if ran and device.type == "cuda":
            best = KernelConfig(ran[0]["config"])
            row["best_kernels_ms"] = kernel_times(lambda: run(variant, best, case.problem, bench.inputs, bench.parts),
                                                  device)
        row["lower_bound_ms"], row["bound_basis"] = lower_bound(case, bench.timed)
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("label", "dispatcher", "best_over_dispatcher") if k in row}
                         | {"best": ran[:3]}), flush=True)
    with open(args.out, "w") as fh:
        json.dump({"rows": rows, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}, fh, indent=2)


if __name__ == "__main__":
    main()
