"""Training (forward + backward) of span attention on a GPU at model M, in one run.

For Lq = Lkv = 4K, 16K, 64K (cache_position = arange, spans from random anchors before each window
with the search's lengths, bf 3 / ff 1 / span power 0.55, W = 2032): the tensor-core backward
(``span_backward_tc``) after the tensor-core forward (``span_forward_tc`` when it imports, else the
per-span ``span_forward``); backward alone and forward + backward; the per-span fused-span split-dK/dV
backward (``span_backward``, 4K only); dense SDPA causal forward + backward; the FLOP lower bound at 790 TFLOP/s; the
per-kernel times (PyTorch profiler). First, on small slices, max errors of dQ/dK/dV against the
float64 reference, a check that the backward never synchronises with the host, and a short sweep
of the backward's tile settings at 16K (the best one is used for the table).

Run on a GPU:  PYTHONPATH=. python benchmarks/span_training.py --out span_training.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton

from superlinear_ops import geometry
from superlinear_ops.launch import KernelConfig, LaunchGeometry
from superlinear_ops.ops.inputs import search_like_spans
from superlinear_ops.ops.span_attention.per_query_backward import span_backward
from superlinear_ops.ops.span_attention.per_query_forward import span_forward
from superlinear_ops.ops.span_attention.reference import span_backward_reference, span_forward_reference
from superlinear_ops.ops.span_attention.span_tiles import clamped_span_bounds
from superlinear_ops.ops.span_attention.tile_backward import span_backward_tc
from superlinear_ops.ops.span_attention.variants import TC_BACKWARD_DEFAULTS

try:
    from superlinear_ops.ops.span_attention.tile_forward import span_forward_tc
    from superlinear_ops.ops.span_attention.variants import TC_FORWARD_DEFAULTS
except ImportError:
    span_forward_tc = None

HQ, HKV, D, K_SPANS = 32, 2, 128, 3
SW_INDEX, POWER, SPAN_POWER, BF, FF = 65, 0.55, 0.55, 3.0, 1.0
WINDOW = geometry.window_len_from_sw_index(SW_INDEX, search_power=POWER, inv_search_power_int=None)
DEVICE = "cuda"
PEAK_FLOPS = 790e12
PER_SPAN_CONFIG = KernelConfig(block_k=32, num_warps=4, num_stages=2)
SLICES = {  # correctness problems (float64 reference): training with rep 8; unsorted positions, mask
    "train_4096_rep8": {"length": 4096, "hq": 8, "hkv": 1, "seed": 1},
    "random_pos_512_over_6000_mask": {"length": 6000, "hq": 4, "hkv": 2, "seed": 2, "masked": True, "queries": 512},
}
SWEEP_LENGTH = 16384
SWEEP = {  # tried at 16K, one part at a time (the other at its default)
    "window": [(64, 64, 8, 2), (32, 128, 8, 2), (128, 64, 8, 2)],
    "span": [(64, 64, 8, 2), (128, 64, 8, 2), (64, 32, 8, 2)],
}


def problem(length, hq=HQ, hkv=HKV, seed=0, masked=False, queries=None):
    """bf16 inputs of model M (cache_position = the last ``queries`` positions of ``length`` keys)."""
    dev = torch.device(DEVICE)
    gen = torch.Generator(device=dev).manual_seed(seed)
    lq = queries or length
    q = torch.randn(1, hq, lq, D, generator=gen, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(1, hkv, length, D, generator=gen, device=dev, dtype=torch.bfloat16) for _ in range(2))
    cache_position = torch.arange(length - lq, length, device=dev)
    if queries:  # random, unsorted positions
        cache_position = cache_position[torch.randperm(lq, generator=gen, device=dev)]
    mask = (torch.rand(1, length, generator=gen, device=dev) > 0.1) if masked else None
    qstart, qend = search_like_spans((1, hq, lq, K_SPANS), cache_position, length, WINDOW, (BF, FF, SPAN_POWER), gen)
    return LaunchGeometry.prepare(q, k, v, qstart, qend, cache_position, mask, WINDOW)


def forward(geo):
    """The tensor-core forward when it imports and runs, else the per-span one."""
    global span_forward_tc
    if span_forward_tc is not None:
        try:
            return span_forward_tc(geo, TC_FORWARD_DEFAULTS)
        except Exception as exc:  # noqa: BLE001 (keep measuring the backward with the per-span forward)
            print("span_forward_tc failed, using span_forward:", str(exc)[:300], flush=True)
            span_forward_tc = None
    return span_forward(geo, PER_SPAN_CONFIG)


def bench(fn, rep=200):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def config_of(window, span):
    names = ("block_m", "block_n", "warps", "stages")
    return {**TC_BACKWARD_DEFAULTS, **{f"window_{n}": x for n, x in zip(names, window)},
            **{f"span_{n}": x for n, x in zip(names, span)}}


def errors(geo, config):
    """Max |error| / max |expected| and relative norm error of dQ/dK/dV vs float64 (reference forward)."""
    g = geo
    args = (g.q.double(), g.k.double(), g.v.double(), g.qstart, g.qend, g.cache_position, g.attention_mask, g.window)
    out, lse = span_forward_reference(*args, return_lse=True)
    grad_out = torch.randn(out.shape, device=out.device, dtype=torch.float64).to(torch.bfloat16)
    got = span_backward_tc(geo, config, out.to(torch.bfloat16), lse.float(), grad_out)
    want = span_backward_reference(*args, grad_out.double())
    res = {}
    for name, a, e in zip(("dQ", "dK", "dV"), got, want):
        a = a.double()
        res[name] = {"max_err": ((a - e).abs().max() / e.abs().max()).item(),
                     "norm_err": ((a - e).norm() / e.norm()).item(), "nan": bool(torch.isnan(a).any())}
    return res


def lower_bound_ms(geo):
    """(forward + backward) FLOPs with the window once per query: 4D + 10D per attended (query, key)."""
    lo, hi = clamped_span_bounds(geo)
    span_keys = (hi - lo + 1).clamp(min=0).sum().item()
    pos = geo.cache_position.long()
    window_keys = ((pos + 1).clamp(max=WINDOW).sum() * geo.q.shape[1]).item()
    flops = 14 * D * (span_keys + window_keys)
    return flops / PEAK_FLOPS * 1e3, flops


def kernel_times(call, runs=5):
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            call()
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times.setdefault(event.name[:50], []).append(event.device_time_total / 1e3)
    return {name: sum(t) / runs for name, t in sorted(times.items(), key=lambda kv: -sum(kv[1]))}


def dense_ms(length):
    dev = torch.device(DEVICE)
    # K/V repeated to the query heads outside the timing: the flash kernels, as MHA
    q, k, v = (torch.randn(1, HQ, length, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(1, HQ, length, D, device=dev, dtype=torch.bfloat16)

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), g)
    return bench(step)


def sweep(geo):
    """Best (window, span) settings of SWEEP by backward time, one part at a time; (config, times)."""
    out, lse = forward(geo)
    grad_out = torch.randn_like(out)
    best = {"window": SWEEP["window"][0], "span": SWEEP["span"][0]}
    report = {}
    for part in ("window", "span"):
        times = {}
        for setting in SWEEP[part]:
            cfg = config_of(**{**best, part: setting})
            try:
                times[setting] = bench(lambda cfg=cfg: span_backward_tc(geo, cfg, out, lse, grad_out), rep=100)
            except Exception as exc:  # noqa: BLE001 (a setting that does not compile or fit)
                print(part, setting, "failed:", str(exc)[:200], flush=True)
        best[part] = min(times, key=times.get)
        report[part] = {str(s): t for s, t in times.items()}
        print("sweep", part, report[part], "best", best[part], flush=True)
    return config_of(**best), report


def measure(length, config):
    """One table row: times (ms) and per-kernel times of forward + backward at Lq = Lkv = length."""
    geo = problem(length, seed=5)
    out, lse = forward(geo)
    grad_out = torch.randn_like(out)
    row = {"length": length}
    row["bwd_ms"] = bench(lambda: span_backward_tc(geo, config, out, lse, grad_out))
    if span_forward_tc is None and length > 16384:  # the per-span forward would take minutes
        print(json.dumps(row), flush=True)
        return row
    row["fwd_ms"] = bench(lambda: forward(geo))
    row["fwd_bwd_ms"] = bench(lambda: span_backward_tc(geo, config, *forward(geo), grad_out))
    if length <= SLICES["train_4096_rep8"]["length"]:
        row["per_span_fwd_bwd_ms"] = bench(lambda: span_backward(
            geo, PER_SPAN_CONFIG, *span_forward(geo, PER_SPAN_CONFIG), grad_out, fused_spans=True, split_dkv=True), rep=1)
    row["dense_fwd_bwd_ms"] = dense_ms(length)
    row["lower_bound_ms"], row["flops"] = lower_bound_ms(geo)
    row["kernels_ms"] = kernel_times(lambda: span_backward_tc(geo, config, *forward(geo), grad_out))
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="span_training.json")
    parser.add_argument("--lengths", default="4096,16384,65536")
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("span_training.py needs a CUDA GPU; none is available")
    report = {"device": torch.cuda.get_device_name(), "window": WINDOW}
    config = dict(TC_BACKWARD_DEFAULTS)

    # 1. correctness on slices: training (rep 16, 4K) and random unsorted positions with a masked prefix
    report["errors"] = {name: errors(problem(**kw), config) for name, kw in SLICES.items()}
    print("errors", json.dumps(report["errors"]), flush=True)
    geo = problem(SLICES["train_4096_rep8"]["length"], seed=3)
    out, lse = forward(geo)
    grad_out = torch.randn_like(out)
    span_backward_tc(geo, config, out, lse, grad_out)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    span_backward_tc(geo, config, out, lse, grad_out)
    torch.cuda.set_sync_debug_mode(0)
    report["host_sync_free"] = True

    # 2. sweep at 16K, 3. the table
    if not args.no_sweep:
        config, report["sweep_16k_backward_ms"] = sweep(problem(SWEEP_LENGTH, seed=4))
        report["errors_chosen_config"] = errors(problem(**SLICES["train_4096_rep8"]), config)
        print("errors with the chosen config", json.dumps(report["errors_chosen_config"]), flush=True)
    report["config"] = config
    report["rows"] = [measure(int(length), config) for length in args.lengths.split(",")]
    report["forward"] = "span_forward_tc" if span_forward_tc else "span_forward (per span)"
    rows = report["rows"]
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)

    print(f"\nforward: {report['forward']}; backward config: {config}")
    print(f"{'case':>12} {'bwd':>9} {'fwd':>9} {'fwd+bwd':>9} {'per span':>9} {'dense':>9} {'bound':>9}  (ms, medians)")
    for r in rows:
        cells = [f"{r[n]:9.2f}" if n in r else f"{'-':>9}" for n in
                 ("bwd_ms", "fwd_ms", "fwd_bwd_ms", "per_span_fwd_bwd_ms", "dense_fwd_bwd_ms", "lower_bound_ms")]
        print(f"{r['length']:>12} {' '.join(cells)}")
    for r in rows:
        top = ", ".join(f"{n} {t:.2f}" for n, t in list(r.get("kernels_ms", {}).items())[:8])
        print(f"{r['length']}: {top}")
    print("errors (max|err|/max|ref|, norm):", {c: {g: (round(e['max_err'], 5), round(e['norm_err'], 5))
                                                    for g, e in v.items()} for c, v in report["errors"].items()})


if __name__ == "__main__":
    main()
