"""The stripe-tile search under compute-sanitizer at a small masked shape (GPU).

B 2 with a mask (left padding in row 0, a 400-key hole in row 1), a 40-query chunk ending 7 keys
before the end of a 3000-key cache, sw_index 2 (many stripes), rep 16, 4 and 1; the default tiles
and the extremes of the declared space (block_s 16 and 128, one and two query blocks, 1 and 8
warps) that pass the variant's compile check. Anchor sets are compared with the float64 search;
the script exits 1 when any differs.

    compute-sanitizer --tool memcheck python3 scripts/search_memcheck.py
"""

from __future__ import annotations

import sys

import torch

import superlinear_ops.variants  # noqa: F401  (registers the variants)
from superlinear_ops import geometry
from superlinear_ops.kernels.launch import KernelConfig
from superlinear_ops.layer.search import search_reference
from superlinear_ops.problem import Problem
from superlinear_ops.registry import REGISTRY
from superlinear_ops.settings import SpanSettings

KEYS, QUERIES, D = 3000, 40, 128
GROUPS = ((32, 2), (8, 2), (4, 4))  # (Hq, Hkv): rep 16, 4, 1


def main() -> int:
    variant = REGISTRY.get("attention_layer", "stripe_tiles")
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
        expected = search_reference(q1.double(), k.double(), positions, mask, settings, KernelConfig()).sort(-1).values
        problem = Problem.for_layer(q1, k, settings.topk, True, 2, params.label, (3.0, 1.0, 0.55))
        heads = min(16, rep)
        configs = [variant.default(problem)] + [
            KernelConfig(block_s=s, block_h=heads, block_q=max(1, 16 // heads) * q, num_warps=w)
            for s in (16, 128) for q in (1, 2) for w in (1, 8) if max(1, 16 // heads) * q <= 16]
        for config in configs:
            if (why := variant.compile_check(problem, config)) is not None:
                print(f"rep {rep} {config.text()}: not run ({why})")
                continue
            got = variant.launch(q1, k, positions, mask, settings, config).sort(-1).values
            same = (got == expected).all(-1).double().mean().item()
            differing += same < 1
            print(f"rep {rep} {config.text()}: rows equal to the float64 search {same:.5f}", flush=True)
    print(f"anchor sets differ in {differing} configurations")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
