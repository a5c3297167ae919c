"""Both Triton searches under compute-sanitizer at a small masked shape (GPU).

B 2 with a mask (left padding in row 0, a 400-key hole in row 1), a 40-query chunk ending 7 keys
before the end of a 3000-key cache, sw_index 2 (many stripes), rep 16, 4 and 1; each variant's
default tiles and the extremes of its declared space that pass its compile check (stripe tiles:
block_s 16 and 128, one and two query blocks, 1 and 8 warps; tiled search: block_q 16 and 64,
1 and 3 stages, 4 and 8 warps). Anchor sets are compared with the float64 search, and the scores
of equal anchor sets with its scores (relative to the scores' RMS); the script exits 1 when any
anchor set differs or a score is off by more than 1e-4.

    compute-sanitizer --tool memcheck python3 scripts/search_memcheck.py
"""

from __future__ import annotations

import argparse
import sys

import torch

import superlinear_ops  # noqa: F401  (registers the variants)
from superlinear_ops import geometry
from superlinear_ops.launch import KernelConfig
from superlinear_ops.ops.layer_search.reference import search_reference
from superlinear_ops.problem import Problem
from superlinear_ops.registry import REGISTRY
from superlinear_ops.settings import SpanSettings

KEYS, QUERIES, D = 3000, 40, 128
GROUPS = ((32, 2), (8, 2), (4, 4))  # (Hq, Hkv): rep 16, 4, 1


def extremes(name: str, rep: int) -> list[KernelConfig]:
    """The variant's extreme tiles for a group of ``rep`` heads."""
    heads = min(16, rep)
    if name == "stripe_tiles":
        return [KernelConfig(block_s=s, block_h=heads, block_q=max(1, 16 // heads) * q, num_warps=w)
                for s in (16, 128) for q in (1, 2) for w in (1, 8) if max(1, 16 // heads) * q <= 16]
    return [KernelConfig(block_q=q, block_h=min(8, heads), num_warps=w, num_stages=st)
            for q in (16, 64) for w in (4, 8) for st in (1, 3)]


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("search_memcheck.py needs a CUDA GPU; none is available")
    params = geometry.power_params(search_power=0.55, inv_search_power_int=None)
    settings = SpanSettings(2, 3, 3.0, 1.0, 0.55, params).for_keys(KEYS)
    differing = 0
    for hq, hkv in GROUPS:
        rep = hq // hkv
        gen = torch.Generator(device="cuda").manual_seed(0)
        q1 = torch.randn(2, hq, QUERIES, D, generator=gen, device="cuda").bfloat16()
        k = torch.randn(2, hkv, KEYS, D, generator=gen, device="cuda").bfloat16()
        positions = torch.arange(KEYS - QUERIES - 7, KEYS - 7, device="cuda")
        mask = torch.ones(2, KEYS + 5, dtype=torch.bool, device="cuda")
        mask[0, :300] = False
        mask[1, 1000:1400] = False
        exact = search_reference(q1.double(), k.double(), positions, mask, settings, KernelConfig())
        order = exact.anchors.sort(-1)
        expected, expected_scores = order.values, exact.scores.gather(-1, order.indices)
        scale = expected_scores[exact.anchors.sort(-1).values >= 0].pow(2).mean().sqrt()
        problem = Problem.for_layer(q1, k, settings.topk, True, 2, params.label, (3.0, 1.0, 0.55))
        for name in ("stripe_tiles", "tiled_search"):
            variant = REGISTRY.get("attention_layer", name)
            for config in [variant.default(problem), *extremes(name, rep)]:
                if (why := variant.compile_check(problem, config)) is not None:
                    print(f"{name} rep {rep} {config.text()}: not run ({why})")
                    continue
                found = variant.launch(q1, k, positions, mask, settings, config)
                got = found.anchors.sort(-1)
                same = (got.values == expected).all(-1)
                scores = found.scores.double().gather(-1, got.indices)
                score_error = ((scores - expected_scores).abs()[same] / scale).max().item()
                bad = same.double().mean().item() < 1 or score_error > 1e-4
                differing += bad
                print(f"{name} rep {rep} {config.text()}: rows equal to the float64 search {same.double().mean().item():.5f}, "
                      f"max score error / rms {score_error:.2e}", flush=True)
    print(f"anchor sets or scores differ in {differing} configurations")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
