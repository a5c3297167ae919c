"""Time a new process's import and first calls of the whole layer and of a decode step.

    python benchmarks/first_call_latency.py [--device cuda] [--keys 32768] [--queries 8192]

Prints the import time, the first and second call of each, and whether torch.compile's machinery
(torch._dynamo, sympy) was imported. Run it in a fresh process (it is one); on a GPU, Triton's
cache decides whether the first call compiles.
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--keys", type=int, default=64, help="Lkv (default 64; model M's heads at bf16 on cuda)")
    parser.add_argument("--queries", type=int, default=64, help="the chunk's queries Lq (default 64)")
    args = parser.parse_args()
    start = time.perf_counter()
    import torch

    import superlinear_ops

    imported = time.perf_counter() - start
    gpu = args.device == "cuda"
    heads, kv_heads, dim, dtype = (32, 2, 128, torch.bfloat16) if gpu else (4, 2, 32, torch.float32)
    sw_index, topk = (65, 3) if gpu else (3, 2)
    # on the GPU, model M's settings (tuning/superlinear-exp-v0.1.yaml: what `superlinear-ops warmup` compiles)
    power = dict(search_power=0.55, inv_search_power_int=None, backward_factor=3.0, forward_factor=1.0,
                 span_power=0.55) if gpu else {}
    make = lambda *shape: torch.randn(*shape, device=args.device, dtype=dtype)  # noqa: E731
    q1, q2 = make(1, heads, args.queries, dim), make(1, heads, args.queries, dim)
    k, v = make(1, kv_heads, args.keys, dim), make(1, kv_heads, args.keys, dim)
    positions = torch.arange(args.keys - args.queries, args.keys, device=args.device)
    # a decode step's own position tensor, as model code passes it (a slice of ``positions`` would be
    # 8 bytes off 16-byte alignment, which Triton compiles as a separate specialisation)
    step_position = positions[-1:].clone()

    def timed(call) -> float:
        began = time.perf_counter()
        call()
        if gpu:
            torch.cuda.synchronize()
        return time.perf_counter() - began

    layer = lambda: superlinear_ops.superlinear_attention(q1, q2, k, v, positions, None, sw_index, topk, **power)  # noqa: E731
    decode = lambda: superlinear_ops.decode_span_attention_staged_gqa(  # noqa: E731
        q1[:, :, -1:], q2[:, :, -1:], k, v, step_position, None, sw_index, topk, **power)
    times = [timed(layer), timed(layer), timed(decode), timed(decode)]
    loaded = [m for m in ("torch._dynamo", "sympy") if m in sys.modules]
    print(f"import {imported:.2f} s; layer first {times[0]:.2f} s, second {times[1]:.3f} s; "
          f"decode first {times[2]:.2f} s, second {times[3]:.4f} s; loaded: {loaded or 'neither dynamo nor sympy'}")


if __name__ == "__main__":
    main()
