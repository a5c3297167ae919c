"""Dispatch overhead on the memoised path, in microseconds per call (CPU; no kernel runs).

Run:  python benchmarks/dispatch_overhead.py
Measures, for a model-M decode problem: ``select`` on a ready Problem; building the Problem from
tensors plus ``select`` (what each op call does); and, for scale, one full public decode call on
tiny CPU inputs (validation, custom-op dispatch, dispatcher and the reference path).
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import torch

from superlinear_ops import dispatch
from superlinear_ops.problem import Problem


def per_call_us(fn, number: int, repeat: int = 7) -> float:
    """Median over ``repeat`` runs of the mean time per call, in microseconds."""
    fn()
    return statistics.median(t / number * 1e6 for t in timeit.repeat(fn, number=number, repeat=repeat))


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    q = torch.zeros(1, 32, 1, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 65536, 128, dtype=torch.bfloat16)
    factors = (3.0, 1.0, 0.55)
    problem = Problem.for_decode(q, k, 3, False, 65, "float0.55", factors)
    rows = [
        ("select(problem), memoised", per_call_us(lambda: dispatch.select(problem), 100_000)),
        ("Problem.for_decode + select", per_call_us(
            lambda: dispatch.select(Problem.for_decode(q, k, 3, False, 65, "float0.55", factors)), 50_000)),
    ]
    print(f"{'path':<32}{'us/call':>10}")
    for name, us in rows:
        print(f"{name:<32}{us:>10.2f}")


if __name__ == "__main__":
    main()
