"""The layer's spans kernel under compute-sanitizer at small shapes (GPU).

Both power paths, forward factor 0 and 1, B 1 and 2, int64 and int32 anchors, 37 and 700 queries
(a ragged last program), no mask and masks of 20% holes longer than the keys, one position past
the keys. Every result is compared with the tensor ops (``spans_of_anchors``); exits 1 on a
difference.

    compute-sanitizer --tool memcheck python3 scripts/spans_memcheck.py
"""

from __future__ import annotations

import argparse
import sys

import torch

from superlinear_ops import geometry
from superlinear_ops.ops.layer.spans import spans_of_anchors
from superlinear_ops.ops.layer.spans_kernel import spans_by_kernel
from superlinear_ops.settings import SpanSettings

POWERS = ({"search_power": 0.55, "inv_search_power_int": None}, {"search_power": None, "inv_search_power_int": 2})
SHAPES = ((1, 37, 300, torch.int64), (2, 700, 3000, torch.int32))  # batch, queries, keys, anchor dtype


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("spans_memcheck.py needs a CUDA GPU; none is available")
    gen = torch.Generator(device="cuda").manual_seed(3)
    differing = []
    for power in POWERS:
        for ff in (0.0, 1.0):
            settings = SpanSettings(4, 3, 3.0, ff, 0.55, geometry.power_params(**power))
            for batch, lq, lkv, dtype in SHAPES:
                positions = torch.arange(lkv - lq - 5, lkv - 5, device="cuda")
                positions[3] = lkv + 9
                anchors = torch.randint(-1, lkv // 2, (batch, 4, lq, 3), device="cuda", generator=gen).to(dtype)
                for mask in (None, torch.rand(batch, lkv + 7, device="cuda", generator=gen) > 0.2):
                    want = spans_of_anchors(anchors.long(), positions, lkv, mask, settings)
                    got = spans_by_kernel(anchors, positions, lkv, mask, settings)
                    if not all(torch.equal(a, b) for a, b in zip(got, want)):
                        differing.append((power, ff, batch, lq, mask is not None))
    torch.cuda.synchronize()
    print("every case equals the tensor ops" if not differing else f"differing cases: {differing}")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
