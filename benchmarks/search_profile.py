"""The layer's stripe search alone at model M (GPU), for a profiler: a chunk of queries over a prefix of
keys, searched ``--runs`` times with the dispatcher's choice or ``--variant``'s default; profile a
launch after the first (compiled).

Prints the stripes each query scores, the key rows the search gathers (one 256-byte row per query,
stripe and KV head) and the distinct key rows, the figures a profile's DRAM and L2 counts compare with.

    ncu --kernel-name regex:stripe_tile_search --launch-skip 1 --launch-count 1 \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sector_op_read_hit_rate.pct \\
        python3 benchmarks/search_profile.py --keys 10000000
"""

from __future__ import annotations

import argparse

import torch
from whole_layer import BF, FF, HKV, PARAMS, POWER, SETTINGS, SPAN_POWER, SW_INDEX, TOPK, D, inputs  # this folder's model-M helpers

from superlinear_ops import geometry, torch_ops
from superlinear_ops.problem import Problem
from superlinear_ops.registry import REGISTRY


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=int, default=32768, help="queries in the chunk (the last positions)")
    parser.add_argument("--keys", type=int, default=10_000_000, help="keys of the prefix, the chunk included")
    parser.add_argument("--runs", type=int, default=2, help="searches to run (the first compiles)")
    parser.add_argument("--variant", help="an attention_layer variant run with its default configuration "
                        "(default: the dispatcher's choice)")
    args = parser.parse_args()
    if not 1 <= args.queries <= args.keys:
        parser.error(f"--queries must be in [1, --keys], got {args.queries} over {args.keys}")
    if not torch.cuda.is_available():
        raise SystemExit("search_profile.py needs a CUDA GPU; none is available")
    q1, _, k, _, positions, _ = inputs(args.queries, args.keys, seed=4)
    if args.variant is None:
        def search() -> None:
            torch_ops.layer_search(q1, k, positions, None, SW_INDEX, TOPK, BF, FF, SPAN_POWER, POWER, None)
    else:
        variant = REGISTRY.get("attention_layer", args.variant)
        config = variant.default(Problem.for_layer(q1, k, TOPK, False, SW_INDEX, PARAMS.label, (BF, FF, SPAN_POWER)))
        settings = SETTINGS.for_keys(args.keys)

        def search() -> None:
            variant.launch(q1, k, positions, None, settings, config)
    with torch.no_grad():
        for _ in range(args.runs):
            search()
    torch.cuda.synchronize()
    stripes = geometry.stripe_count(args.keys, SW_INDEX, geometry.power_params(search_power=POWER, inv_search_power_int=None)) - SW_INDEX
    row = D * k.element_size()
    print(f"{args.queries} queries over {args.keys} keys: {stripes} stripes, "
          f"{args.queries * stripes * HKV * row / 1e9:.1f} GB of key rows gathered, {args.keys * HKV * row / 1e9:.2f} GB distinct")


if __name__ == "__main__":
    main()
