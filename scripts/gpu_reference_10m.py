"""Errors at 10M keys against the float64 reference, and the memory the reference uses.

Staged decode at the last of ``--keys`` keys, and whole-layer rows at the start, middle and end of a
``--chunk``-query chunk ending there (model M's heads and settings by default: 32 query heads over 2
KV heads, D 128, bf16, 10,000,000 keys, a 32,768-query chunk).

The kernels run through the public API on the inputs' dtype; the reference takes the same K and V
(never copied: it converts one key block at a time to float64) with float64 queries, for the
decode and for the chosen layer rows only. Prints each error as a share of the reference output's
largest magnitude and the memory the reference used beyond the inputs (CUDA: peak allocated; CPU:
peak RSS of the process). Exit status 1 when an error exceeds ``--tolerance`` or is NaN.

    python scripts/gpu_reference_10m.py                       # on an H100: model M at 10M keys
    python scripts/gpu_reference_10m.py --device cpu --keys 3000 --chunk 64 --q-heads 4 --head-dim 16 --sw-index 3
"""

from __future__ import annotations

import argparse
import math
import resource
import sys
import time

import torch

from superlinear_ops import decode_span_attention_staged_gqa, superlinear_attention, torch_ops
from superlinear_ops.launch import KernelConfig
from superlinear_ops.ops.layer.composition import attention_layer
from superlinear_ops.ops.layer_search.reference import search_reference
from superlinear_ops.ops.span_attention.reference import span_forward_reference
from superlinear_ops.problem import STAGED_DECODE
from superlinear_ops.registry import REGISTRY
from superlinear_ops.settings import SpanSettings


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--keys", type=int, default=10_000_000, help="Lkv (default 10,000,000)")
    parser.add_argument("--chunk", type=int, default=32768, help="queries of the layer chunk ending at the last key")
    parser.add_argument("--rows", type=int, default=4, help="layer rows checked at each of the chunk's three places")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--sw-index", type=int, default=65)
    parser.add_argument("--search-power", type=float, default=0.55)
    parser.add_argument("--span-power", type=float, default=0.55)
    parser.add_argument("--backward-factor", type=float, default=3.0)
    parser.add_argument("--forward-factor", type=float, default=1.0)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=1e-2, help="largest error accepted, as a share of the output's max")
    args = parser.parse_args(argv)
    for name in ("keys", "chunk", "rows", "q_heads", "kv_heads", "head_dim", "topk"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.chunk > args.keys or args.q_heads % args.kv_heads:
        parser.error("--chunk must be <= --keys and --q-heads a multiple of --kv-heads")
    return args


class Memory:
    """Peak memory beyond what was in use when ``start`` ran: CUDA allocations, or the process's RSS."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def used_gib(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return (torch.cuda.max_memory_allocated(self.device) - self.base) / 2**30
        return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.base) / 2**30  # peak RSS growth


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (NaN when either holds a NaN)."""
    if bool(torch.isnan(got).any()) or bool(torch.isnan(want).any()):
        return math.nan
    return float((got.double() - want).abs().max() / want.abs().max().clamp(min=1e-30))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    lkv, hq, hkv, dim = args.keys, args.q_heads, args.kv_heads, args.head_dim
    span = dict(sw_index=args.sw_index, topk=args.topk, backward_factor=args.backward_factor,
                forward_factor=args.forward_factor, span_power=args.span_power, search_power=args.search_power,
                inv_search_power_int=None)
    settings = SpanSettings.checked(lkv, args.sw_index, args.topk, args.backward_factor, args.forward_factor,
                                    args.span_power, args.search_power, None)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    k = torch.randn(1, hkv, lkv, dim, generator=gen, device=device, dtype=dtype)
    v = torch.randn(1, hkv, lkv, dim, generator=gen, device=device, dtype=dtype)
    memory, failed = Memory(device), False
    print(f"{lkv:,} keys, {hq} query heads over {hkv} KV heads, D {dim}, {args.dtype}, on {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'})", flush=True)

    def report(what: str, got: torch.Tensor, want: torch.Tensor, used: float, seconds: float) -> None:
        nonlocal failed
        error = relative_error(got, want)
        ok = error <= args.tolerance  # False for NaN
        failed |= not ok
        print(f"{what}: error {error:.3e} of the output's max ({'ok' if ok else 'OVER'} {args.tolerance:g}); "
              f"reference {seconds:.1f} s, {used:.2f} GiB beyond the inputs", flush=True)

    # Staged decode at the last key.
    q1, q2 = (torch.randn(1, hq, 1, dim, generator=gen, device=device, dtype=dtype) for _ in range(2))
    position = torch.tensor([lkv - 1], device=device)
    with torch.no_grad():
        got = decode_span_attention_staged_gqa(q1, q2, k, v, position, None, **span)
        reference = REGISTRY.reference(STAGED_DECODE)
        memory.start()
        started = time.perf_counter()
        want = reference.launch(q1.double(), q2.double(), k, v, position, None, settings, KernelConfig())
        report(f"decode at position {lkv - 1:,}", got, want, memory.used_gib(), time.perf_counter() - started)
        del got, want

        # Whole-layer rows of a chunk ending at the last key.
        chunk = args.chunk
        q1, q2 = (torch.randn(1, hq, chunk, dim, generator=gen, device=device, dtype=dtype) for _ in range(2))
        positions = torch.arange(lkv - chunk, lkv, device=device)
        out = superlinear_attention(q1, q2, k, v, positions, None, **span)
        rows = min(args.rows, chunk)
        places = {"start": 0, "middle": (chunk - rows) // 2, "end": chunk - rows}
        for place, first in places.items():
            pick = torch.arange(first, first + rows, device=device)
            r1, r2, at = q1[:, :, pick].double(), q2[:, :, pick].double(), positions[pick]
            memory.start()
            started = time.perf_counter()
            anchors, scores = search_reference(r1, k, at, None, settings, KernelConfig())
            window = settings.window_for(lkv)

            def span_attention(qstart, qend, r2=r2, at=at, window=window):
                return span_forward_reference(r2, k, v, qstart, qend, at, None, window)

            want = attention_layer(r1, k, anchors, at, None, settings, span_attention, torch.float64, torch_ops.LAYER_STEPS,
                                   search_scores=scores)
            report(f"layer rows {first:,}..{first + rows - 1:,} of the chunk ({place}; positions {int(at[0]):,}..)",
                   out[:, :, pick], want, memory.used_gib(), time.perf_counter() - started)
    print("FAILED: an error over the tolerance" if failed else "all errors within the tolerance")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
