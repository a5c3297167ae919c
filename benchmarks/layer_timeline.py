"""The kernel timeline of one eager prefill call of the public op at model M (GPU).

The host queues a few calls behind a sleeping kernel, so that it is far ahead and the trace shows
the GPU's own schedule: each kernel's start and end in us from the call's first kernel, its
duration and its stream (the span-tile plan runs on a side stream). Calls are split at the
search kernel, so a call's tail lists the next call's small kernels before its search.

    PYTHONPATH=. python3 benchmarks/layer_timeline.py --cases 8192:16384 8192:139264
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
from span_forward_tiles import bench
from whole_layer import public_call  # this folder's model-M helpers

TRACED = ("kernel", "gpu_memset", "gpu_memcpy")


def timeline(lq: int, lkv: int, calls: int = 4) -> None:
    """Print do_bench's median and the kernels of the second-to-last traced call."""
    call, _ = public_call(lq, lkv, False)
    with torch.no_grad():
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        print(f"== {lq} over {lkv}: do_bench median {bench(call):.4f} ms", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            torch.cuda._sleep(200_000_000)
            for _ in range(calls):
                call()
            torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.load(open(trace.name))["traceEvents"]
    events = sorted((e for e in events if e.get("cat") in TRACED and "spin_kernel" not in e["name"]), key=lambda e: e["ts"])
    starts = [i for i, e in enumerate(events) if "search_kernel" in e["name"]]
    one = events[starts[-2]:starts[-1]]
    t0 = one[0]["ts"]
    print(f"call span {one[-1]['ts'] + one[-1]['dur'] - t0:.1f} us; the next call starts at {events[starts[-1]]['ts'] - t0:.1f}")
    for e in one:
        print(f"  {e['ts'] - t0:9.1f} {e['ts'] + e['dur'] - t0:9.1f} {e['dur']:8.1f} s{e['args'].get('stream')} {e['name'][:70]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["8192:16384", "8192:139264"], help="QUERIES:KEYS chunks")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("layer_timeline.py needs a CUDA GPU; none is available")
    for case in args.cases:
        lq, lkv = (int(n) for n in case.split(":"))
        timeline(lq, lkv)


if __name__ == "__main__":
    main()
