"""The span-tile plan on its high-priority side stream vs in place, side by side in one process (GPU).

The public ``superlinear_attention`` at model M (prefill chunks, training forward + backward) with
``span_tc_forward.SideStream`` as shipped or forced in place (the CPU behaviour): medians of
do_bench over 3 interleaved rounds, outputs compared (training's gradients differ by the
backward's fp32 atomic order only), at 8192 over 139K a CUDA graph of the side-stream path
replayed against eager (also after moving the chunk), and per-kernel profiles at 16K and 139K.

    PYTHONPATH=. python3 scripts/plan_stream_ab.py --out plan_stream.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from layer_compare import captured, interleaved_ab, public_call, warm_gpu  # this folder's model-M helpers
from prefill_compare import bench, profile

from superlinear_ops.ops import side_stream
from superlinear_ops.ops.span_attention import tile_forward as span_tc_forward

CASES = [(8192, 16384, False), (8192, 139264, False), (8192, 1048576, False), (32768, 1048576, False),
         (4096, 4096, True), (16384, 16384, True), (65536, 65536, True)]


def use(side: bool) -> None:
    span_tc_forward.SideStream = side_stream.SideStream if side else (lambda device: side_stream.SideStream(torch.device("cpu")))


def graph_check(call, positions: torch.Tensor, eager: torch.Tensor) -> dict:
    """Replay of a captured call against eager, before and after moving the chunk 50,000 back."""
    graph, (static, *_) = captured(call)
    graph.replay()
    torch.cuda.synchronize()
    result = {"replay_vs_eager_max_abs": (static.float() - eager).abs().max().item()}
    positions.sub_(50000)
    graph.replay()
    torch.cuda.synchronize()
    result["moved_replay_vs_eager_max_abs"] = (static.float() - call()[0].float()).abs().max().item()
    result["replay_ms"] = bench(graph.replay)
    positions.add_(50000)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="plan_stream.json", help="JSON results file")
    args = parser.parse_args()
    warm_gpu(2.0)
    results = {}
    for lq, lkv, training in CASES:
        name = f"{'training' if training else 'prefill'} {lq} over {lkv}"
        call, positions = public_call(lq, lkv, training)
        outputs, times = interleaved_ab(call, use, training)
        row = {"max_diff": max((a - b).abs().max().item() for a, b in zip(outputs[False], outputs[True])),
               "nan": any(torch.isnan(t).any().item() for t in outputs[True])}
        row.update(in_place_ms=statistics.median(times[False]), side_ms=statistics.median(times[True]), rounds=times)
        row["speedup"] = row["in_place_ms"] / row["side_ms"]
        use(True)
        if not training and lkv == 139264:
            with torch.no_grad():
                row.update(graph_check(call, positions, outputs[True][0]))
        if not training and lkv in (16384, 139264):
            for side in (False, True):
                use(side)
                with torch.no_grad():
                    row[f"profile_{'side' if side else 'in_place'}"] = profile(call)[:14]
            use(True)
        results[name] = row
        print(name, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()
                     if k != "rounds" and not k.startswith("profile")}, flush=True)
        del outputs, call
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
