"""Where an eager decode call spends its host time: the public API and the grouped launcher
called directly, timed per call on the CPU (no GPU wait), with a cProfile of the API path.

Run on a GPU:  PYTHONPATH=. python scripts/eager_overhead.py --context 1048576
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from superlinear_ops import decode_span_attention_staged_gqa
from superlinear_ops.decode import DecodeSettings
from superlinear_ops.problem import device_identity
from superlinear_ops.registry import REGISTRY
from superlinear_ops.tuner.runner import ProblemBench
from superlinear_ops.tuner.workload import load


def host_us(call, runs: int = 200) -> float:
    """Median host microseconds per call (the GPU queue is drained between batches)."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e6)
        if len(times) % 20 == 0:
            torch.cuda.synchronize()
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--context", type=int, default=1048576)
    args = parser.parse_args()
    device = torch.device("cuda")
    workload = load("tuning/superlinear-exp-v0.1.yaml")
    case = next(c for c in workload.cases(device_identity(device))
                if c.problem.op == "staged_decode" and c.problem.keys == args.context and c.cache_fill is None)
    bench = ProblemBench(case, device, seed=0)
    p, x = bench.problem, bench.inputs
    bf, ff, sp = p.factors
    variant = REGISTRY.get("staged_decode", "grouped")
    config = variant.default(p)
    settings = DecodeSettings(p.sw_index, p.spans, bf, ff, sp, p.params)

    def api():
        return decode_span_attention_staged_gqa(x.q1, x.q, x.k, x.v, x.cache_position, x.mask, p.sw_index, p.spans,
                                                backward_factor=bf, forward_factor=ff, span_power=sp,
                                                **p.params.arguments)

    def launcher():
        return variant.launch(x.q1, x.q, x.k, x.v, x.cache_position, x.mask, settings, config)

    for call in (api, launcher):
        call()
    torch.cuda.synchronize()
    print(f"host us per call: api {host_us(api):.1f}, grouped launcher {host_us(launcher):.1f}, "
          f"torch.empty {host_us(lambda: torch.empty(1000, device=device)):.1f}")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        api()
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
