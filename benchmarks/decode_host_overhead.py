"""Where an eager decode call spends its host time: the public API and the grouped launcher
called directly, timed per call on the CPU (no GPU wait), with a cProfile of the API path.

Run on a GPU:  PYTHONPATH=. python benchmarks/decode_host_overhead.py --context 1048576
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from decode_variants import api_call, decode_cases

from superlinear_ops.registry import REGISTRY
from superlinear_ops.tuner.runner import ProblemBench, run


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
    if not torch.cuda.is_available():
        raise SystemExit("decode_host_overhead.py needs a CUDA GPU; none is available")
    device = torch.device("cuda")
    case = next(c for c in decode_cases(device)
                if c.problem.keys == args.context and c.cache_fill is None and c.problem.batch == 1)
    bench = ProblemBench(case, device, seed=0)
    variant = REGISTRY.get("staged_decode", "grouped")
    config = variant.default(bench.problem)
    api = api_call(bench)

    def launcher():
        return run(variant, config, bench.problem, bench.inputs, bench.parts)

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
