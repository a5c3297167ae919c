"""span_forward on an sm_90 GPU at model-M prefill chunks: the Gluon hopper_tiles beside tc_tiles.

``tc_tiles`` runs with the dispatcher's entry for the problem (tuned where the shipped file has one).

Per case (32 query heads over 2 KV heads, D 128, bf16, W 2032, spans as the search places them):
``tc_tiles`` with the configuration the dispatcher gives the problem; the window part alone, by
tc_tiles' Triton kernel and by the Gluon window kernel on each of a few tiles (time and largest
difference from the Triton kernel's); then the whole ``hopper_tiles`` forward with the fastest
window tiles and each span tiles of a small sweep: the median time (``do_bench``), the error on 16
query rows spread over the chunk against the float64 reference and the largest difference from
``tc_tiles`` on every row; then the kernels of ``tc_tiles`` and of the fastest ``hopper_tiles`` one
by one (PyTorch profiler), and the lower bound (``span_forward_tiles.lower_bound``) with the
TFLOP/s of its FLOPs in each time. The JSON (``--out``) is rewritten after every case.

    PYTHONPATH=. python benchmarks/hopper_span_tiles.py --out hopper_span_tiles.json [--cases 3]
    PYTHONPATH=. python benchmarks/hopper_span_tiles.py --cases 2 --cpu-bounds 0 1 --gpu 'NVIDIA H100 80GB HBM3' --out bounds.json  # CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch
import triton
from span_forward_tiles import WINDOW, errors, lower_bound, profile, reference_rows, spans  # this folder's helpers

from superlinear_ops import dispatch
from superlinear_ops.launch import LaunchGeometry
from superlinear_ops.problem import SPAN_FORWARD, Problem, device_identity
from superlinear_ops.tuner.bench import PEAKS

CASES = [(8192, 16384), (32768, 1048576), (32768, 10_000_000), (8192, 139264)]  # (queries, keys), chunk at the end
TILES = [(128, 3, 2), (128, 3, 1), (128, 2, 2), (64, 3, 2), (64, 3, 1), (64, 4, 2)]  # (block_n, stages, mma_turns)


def tiles(part: str, n: int, stages: int, turns: int) -> dict:
    return {f"{part}_block_n": n, f"{part}_stages": stages, f"{part}_mma_turns": turns}


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    finite = torch.isfinite(b)
    return ((a.float() - b.float())[finite].abs().max() / b.float()[finite].abs().max()).item()


def timed(fn, long: bool) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=400 if long else 100)


def sweep(row: dict, label: str, part: str, base: dict, measure) -> str | None:
    """``measure(config)`` for ``part``'s tiles of ``TILES`` on ``base``, each entry into ``row`` as
    '``label`` nN sS tT' (a failure recorded as its error); the fastest entry's name."""
    best = None
    for n, stages, turns in TILES:
        config = {**base, **tiles(part, n, stages, turns)}
        name = f"{label} n{n} s{stages} t{turns}"
        try:
            entry = {"config": config, **measure(config)}
        except Exception as err:  # noqa: BLE001 - a configuration that fails is recorded, the sweep goes on
            entry = {"config": config, "error": repr(err)[:500]}
        row[name] = entry
        print(row["case"], name, {key: entry[key] for key in ("ms", "max_vs_tc_tiles", "error") if key in entry}, flush=True)
        if "ms" in entry and (best is None or entry["ms"] < row[best]["ms"]):
            best = name
    return best


def run_case(lq: int, lkv: int, gen: torch.Generator, dev: torch.device) -> dict:
    """One chunk of ``lq`` queries at the end of ``lkv`` keys: tc_tiles, then the hopper_tiles sweep."""
    from superlinear_ops.ops.span_attention.hopper_tile_forward import hopper_window, span_forward_hopper
    from superlinear_ops.ops.span_attention.tile_forward import span_forward_tc
    from superlinear_ops.ops.span_attention.variants import HOPPER_DEFAULTS, TC_FORWARD_DEFAULTS
    from superlinear_ops.ops.span_attention.window_forward import window_attention

    row: dict = {"case": f"{lq} over {lkv}"}
    q = torch.randn(1, 32, lq, 128, device=dev, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, 2, lkv, 128, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, 2, lkv, 128, device=dev, dtype=torch.bfloat16, generator=gen)
    positions = torch.arange(lkv - lq, lkv, device=dev)
    qstart, qend = spans(gen, lq, positions, lkv, WINDOW)
    geo = LaunchGeometry.prepare(q, k, v, qstart, qend, positions, None, WINDOW)
    problem = Problem(SPAN_FORWARD, "bfloat16", 128, 32, 2, 3, lq, lkv, 1, False, 65, "float0.55", device_identity(dev))
    choice = dispatch.select(problem)
    tc_config = dict(choice.config) if choice.variant.name == "tc_tiles" else dict(TC_FORWARD_DEFAULTS)
    row["dispatcher"] = f"{choice.variant.name} {choice.config.text()} ({choice.source})"
    row["bound"] = lower_bound(geo)
    long = lq >= 32768
    tc_out, tc_lse = span_forward_tc(geo, tc_config)
    sel = torch.linspace(0, lq - 1, 16, device=dev).long()
    f64 = reference_rows(geo, sel)
    row["tc_tiles"] = {"config": tc_config, "ms": timed(lambda: span_forward_tc(geo, tc_config), long),
                       "vs_float64": errors(tc_out[:, :, sel], tc_lse[:, :, sel], *f64),
                       "kernels": profile(lambda: span_forward_tc(geo, tc_config))}
    print(row["case"], "tc_tiles", f"{row['tc_tiles']['ms']:.3f} ms", row["dispatcher"], flush=True)
    triton_out, triton_lse = window_attention(geo, tc_config)
    row["window tc_tiles"] = {"ms": timed(lambda: window_attention(geo, tc_config), long)}
    print(row["case"], "window tc_tiles", row["window tc_tiles"], flush=True)

    def window_entry(config: dict) -> dict:
        out, lse = hopper_window(geo, config)
        return {"max_vs_tc_tiles": relative_difference(out, triton_out), "lse_max_vs_tc_tiles": relative_difference(lse, triton_lse),
                "ms": timed(lambda: hopper_window(geo, config), long)}

    def forward_entry(config: dict) -> dict:
        out, lse = span_forward_hopper(geo, config)
        return {"vs_float64": errors(out[:, :, sel], lse[:, :, sel], *f64), "max_vs_tc_tiles": relative_difference(out, tc_out),
                "ms": timed(lambda: span_forward_hopper(geo, config), long)}

    window_best = sweep(row, "window gluon", "window", HOPPER_DEFAULTS, window_entry)
    window_tiles = {k: v for k, v in row[window_best]["config"].items() if k.startswith("window_")} if window_best else {}
    best = sweep(row, "hopper_tiles span", "span", {**HOPPER_DEFAULTS, **window_tiles}, forward_entry)
    if best is not None:
        row["fastest_hopper_tiles"] = best
        row[best]["kernels"] = profile(lambda: span_forward_hopper(geo, row[best]["config"]))
        row["tc_over_hopper"] = row["tc_tiles"]["ms"] / row[best]["ms"]
        row["tflops"] = {name: row["bound"]["flops"] / row[name]["ms"] / 1e9 for name in ("tc_tiles", best)}
    return row


def cpu_bounds(cases: list[tuple[int, int]], seeds: list[int], gpu: str) -> list[dict]:
    """Each case's lower bound on the GPU named ``gpu``, on spans drawn alike on the CPU, per seed (the
    anchors are random, so the spans clamped at the window's edge and at key 0 differ from draw to draw)."""
    rows = []
    for lq, lkv in cases:
        positions = torch.arange(lkv - lq, lkv)
        q, k = torch.empty(1, 32, lq, 128, dtype=torch.bfloat16), torch.empty(1, 2, lkv, 128, dtype=torch.bfloat16)
        for seed in seeds:
            qstart, qend = spans(torch.Generator().manual_seed(seed), lq, positions, lkv, WINDOW)
            geo = LaunchGeometry.prepare(q, k, k, qstart, qend, positions, None, WINDOW)
            rows.append({"case": f"{lq} over {lkv}", "seed": seed, "bound": lower_bound(geo, gpu)})
            print(rows[-1], flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("hopper_span_tiles.json"))
    parser.add_argument("--cases", type=int, default=len(CASES), help="the first N cases (default: all)")
    parser.add_argument("--cpu-bounds", type=int, nargs="+", metavar="SEED",
                        help="only the cases' lower bounds, on spans drawn on the CPU with each seed (no GPU needed)")
    parser.add_argument("--gpu", default="NVIDIA H100 80GB HBM3", choices=sorted(PEAKS),
                        help="with --cpu-bounds: the GPU whose measured peaks bound the time (default: %(default)s)")
    args = parser.parse_args()
    if args.cpu_bounds:
        args.out.write_text(json.dumps(cpu_bounds(CASES[: args.cases], args.cpu_bounds, args.gpu), indent=1))
        return 0
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("hopper_span_tiles.py needs an sm_90 GPU (H100 or H200)", file=sys.stderr)
        return 1
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "cases": []}
    for lq, lkv in CASES[: args.cases]:
        try:
            results["cases"].append(run_case(lq, lkv, gen, dev))
        except Exception:  # noqa: BLE001 - a case that fails is recorded, the next runs
            results["cases"].append({"case": f"{lq} over {lkv}", "error": traceback.format_exc()[-1500:]})
            print(results["cases"][-1]["error"], flush=True)
        args.out.write_text(json.dumps(results, indent=1, default=str))
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
