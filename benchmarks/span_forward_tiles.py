"""Tensor-core span forward vs the per-span forward vs dense SDPA at model-M prefill/training shapes (GPU).

One run does everything: small correctness checks (dtypes, D, rep, masks, random positions) against
the float64 reference; then per case (bf16, B 1, Hq 32, Hkv 2, D 128, K 3, W 2032): the error of
the tensor-core forward on a 64-query slice against float64 and against the per-span kernel on all rows,
a small config sweep, medians of the tensor-core forward, the per-span ``span_forward`` (block_k 16, 1 warp), dense
``scaled_dot_product_attention`` and the lower bound, per-kernel profiler times, and the compiled
kernels' registers, spills and whether ``tl.dot`` became ``wgmma``. Prints a table; JSON to --out.

    PYTHONPATH=$PWD python3 benchmarks/span_forward_tiles.py --out $OUT/span_forward_tiles.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from superlinear_ops.geometry import window_len_from_sw_index
from superlinear_ops.launch import KernelConfig, LaunchGeometry
from superlinear_ops.ops.inputs import search_like_spans
from superlinear_ops.ops.span_attention.per_query_forward import span_forward
from superlinear_ops.ops.span_attention.reference import span_forward_reference
from superlinear_ops.ops.span_attention.span_tiles import clamped_span_bounds
from superlinear_ops.ops.span_attention.tile_forward import span_forward_tc, span_tile_kernel
from superlinear_ops.ops.span_attention.variants import TC_FORWARD_DEFAULTS, tc_forward_default
from superlinear_ops.ops.span_attention.window_forward import window_attention, window_attention_kernel
from superlinear_ops.problem import SPAN_FORWARD, Problem
from superlinear_ops.tuner.bench import device_peaks

B, HQ, HKV, D, K_SPANS = 1, 32, 2, 128, 3
WINDOW = window_len_from_sw_index(65, search_power=0.55, inv_search_power_int=None)  # 2032
CASES = {  # name: (queries, keys); prefill chunks end at the last key, training has Lq = Lkv
    "prefill 2048/65536": (2048, 65536),
    "prefill 8192/139264": (8192, 139264),
    "train 4K": (4096, 4096),
    "train 16K": (16384, 16384),
}
SWEEP_WINDOW = [(64, 64, 4, 3)]  # besides the defaults (a wider sweep on 2026-11-30: these won or tied)
SWEEP_SPAN = [(128, 64, 8, 3), (64, 64, 4, 4)]
PER_SPAN_CONFIG = KernelConfig(block_k=16, num_warps=1, num_stages=1)


def spans(gen, lq, cache_position, lkv, window):
    """Spans as model M's search would produce them (``search_like_spans``): bf 3, ff 1, power 0.55."""
    return search_like_spans((B, HQ, lq, K_SPANS), cache_position, lkv, window, (3.0, 1.0, 0.55), gen)


def reference_rows(geo, sel, heads_per_chunk=8):
    """float64 reference (out, lse) of the queries ``sel`` (all heads), a few heads at a time."""
    rep = geo.rep
    heads_per_chunk = math.gcd(heads_per_chunk, rep)  # a chunk never straddles two KV heads
    outs, lses = [], []
    for h0 in range(0, geo.q.shape[1], heads_per_chunk):
        hs = slice(h0, h0 + heads_per_chunk)
        kv = slice(h0 // rep, h0 // rep + 1)
        o, lse = span_forward_reference(
            geo.q[:, hs][:, :, sel].double(), geo.k[:, kv].double(), geo.v[:, kv].double(),
            geo.qstart[:, hs][:, :, sel], geo.qend[:, hs][:, :, sel], geo.cache_position[sel],
            geo.attention_mask, geo.window, return_lse=True,
        )
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, 1), torch.cat(lses, 1)


def errors(out, lse, ref_out, ref_lse):
    diff = (out.double() - ref_out).abs()
    finite = torch.isfinite(ref_lse)
    return {
        "max_abs": diff.max().item(),
        "rel_norm": (diff.norm() / ref_out.norm().clamp(min=1e-30)).item(),
        "lse_max_abs": (lse.double() - ref_lse.double())[finite].abs().max().item() if finite.any() else 0.0,
        "inf_match": bool(torch.equal(torch.isinf(lse), ~finite)),
        "nan": bool(torch.isnan(out).any() or torch.isnan(lse).any()),
    }


def poisoned_tc(geo, config):
    b, h, lq, d = geo.q.shape
    n = geo.qstart.shape[-1]
    out = torch.full((b, h, lq, n, d), float("nan"), device=geo.q.device, dtype=geo.q.dtype)
    lse = torch.full((b, h, lq, n), float("nan"), device=geo.q.device)
    return span_forward_tc(geo, config, out=(out, lse))


def small_checks(gen, dev):
    """Correctness of compiled kernels on shapes the benchmark does not cover."""
    results = []
    for dtype, hq, hkv, d, masked, random_pos in [
        (torch.bfloat16, 8, 2, 128, True, True), (torch.float16, 8, 2, 96, True, False),
        (torch.float32, 4, 4, 64, False, True), (torch.bfloat16, 4, 1, 256, True, False),
        (torch.float32, 4, 2, 200, True, False),
    ]:
        lq, lkv, window = 300, 3000, 700
        cp = torch.randint(0, lkv + 50, (lq,), generator=gen, device=dev) if random_pos else torch.arange(lkv - lq, lkv, device=dev)
        q = torch.randn(1, lq, hq, d, generator=gen, device=dev).to(dtype).transpose(1, 2)  # non-contiguous Q
        k, v = (torch.randn(1, hkv, lkv, d, generator=gen, device=dev).to(dtype) for _ in range(2))
        mask = (torch.rand(1, lkv + 8, generator=gen, device=dev) > 0.2) if masked else None
        qs, qe = spans(gen, lq, cp, lkv, window)
        qs, qe = qs[:, :hq], qe[:, :hq]
        geo = LaunchGeometry.prepare(q, k, v, qs, qe, cp, mask, window)
        config = tc_forward_default(Problem.for_span(SPAN_FORWARD, q, k, qs.shape[-1], masked, 65, "float0.55"))
        entry = {"dtype": str(dtype), "hq": hq, "hkv": hkv, "d": d, "masked": masked, "random_pos": random_pos}
        try:
            out, lse = poisoned_tc(geo, config)
            ref_out, ref_lse = span_forward_reference(q.double(), k.double(), v.double(), qs, qe, cp, mask, window, return_lse=True)
            entry.update(errors(out, lse, ref_out, ref_lse))
        except Exception as exc:  # noqa: BLE001 - record and go on
            entry["error"] = f"{type(exc).__name__}: {exc}"[:400]
        print("check", entry, flush=True)
        results.append(entry)
    return results


def bench(fn, rep=100):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def time_few(fn, n=3):
    """Median of ``n`` event-timed runs after one warm-up (for the slow per-span kernel)."""
    fn()
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def lower_bound(geo, gpu: str | None = None):
    """The span forward's bytes over the GPU's bandwidth or its FLOPs over its tensor-core rate (ms);
    ``gpu``: the GPU's name (default: the current CUDA device's)."""
    gpu = gpu or torch.cuda.get_device_name()
    bandwidth, rate = device_peaks(gpu)
    lq, lkv = geo.q.shape[2], geo.k.shape[2]
    pos = geo.cache_position.long().clamp(max=lkv - 1)
    window_keys = (pos - (pos - geo.window + 1).clamp(min=0) + 1).clamp(min=0).sum().item() * HQ
    lo, hi = clamped_span_bounds(geo)
    span_keys = (hi.long() - lo.long() + 1).clamp(min=0).sum().item()
    flops = 4 * D * (window_keys + span_keys)
    bytes_ = 2 * (geo.q.numel() + 2 * geo.k.numel() + B * HQ * lq * K_SPANS * D) + 4 * B * HQ * lq * K_SPANS
    return {"flops": flops, "bytes": bytes_, "ms": 1e3 * max(bytes_ / bandwidth, flops / rate), "gpu": gpu,
            "window_keys": window_keys, "span_keys": span_keys}


def with_part(config, part, values):
    return {**config, **dict(zip((f"{part}_block_m", f"{part}_block_n", f"{part}_warps", f"{part}_stages"), values))}


def profile(fn):
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    rows = []
    for evt in prof.key_averages():
        total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if total > 0:
            rows.append({"name": evt.key[:80], "count": evt.count, "ms_per_call": total / 1e3 / 5})
    return sorted(rows, key=lambda r: -r["ms_per_call"])


def run_case(name, lq, lkv, gen, dev):
    res = {"case": name, "lq": lq, "lkv": lkv}
    q = torch.randn(B, HQ, lq, D, generator=gen, device=dev).bfloat16()
    k, v = (torch.randn(B, HKV, lkv, D, generator=gen, device=dev).bfloat16() for _ in range(2))
    cp = torch.arange(lkv - lq, lkv, device=dev)
    qs, qe = spans(gen, lq, cp, lkv, WINDOW)
    geo = LaunchGeometry.prepare(q, k, v, qs, qe, cp, None, WINDOW)
    res["bound"] = lower_bound(geo)
    config = dict(TC_FORWARD_DEFAULTS)
    out, lse = poisoned_tc(geo, config)
    sel = torch.sort(torch.randperm(lq, generator=gen, device=dev)[:64]).values
    ref_out, ref_lse = reference_rows(geo, sel)
    res["error_vs_f64"] = errors(out[:, :, sel], lse[:, :, sel], ref_out, ref_lse)
    print(name, "error vs float64", res["error_vs_f64"], flush=True)

    res["tc_default_ms"] = bench(lambda: span_forward_tc(geo, config))
    res["window_default_ms"] = bench(lambda: window_attention(geo, config))
    sweep = {"window": {}, "span": {}}
    for part, values_list in (("window", SWEEP_WINDOW), ("span", SWEEP_SPAN)):
        default = tuple(config[f"{part}_{n}"] for n in ("block_m", "block_n", "warps", "stages"))
        best = (math.inf, default)
        for values in [default, *values_list]:  # span configs are timed with the whole forward
            trial = with_part(config, part, values)
            fn = (lambda c=trial: window_attention(geo, c)) if part == "window" else (lambda c=trial: span_forward_tc(geo, c))
            try:
                t = bench(fn)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: record, go on
                t = math.inf
                sweep[part][f"{values} error"] = f"{type(exc).__name__}: {exc}"[:200]
            sweep[part][str(values)] = t
            best = min(best, (t, values))
        config = with_part(config, part, best[1])
    res["sweep"], res["best_config"] = sweep, config
    res["tc_best_ms"] = bench(lambda: span_forward_tc(geo, config))
    res["tc_best_ms_again"] = bench(lambda: span_forward_tc(geo, config))
    best_out, best_lse = poisoned_tc(geo, config)
    res["error_best_vs_f64"] = errors(best_out[:, :, sel], best_lse[:, :, sel], ref_out, ref_lse)
    res["profile"] = profile(lambda: span_forward_tc(geo, config))[:12]
    print(name, "tc default", res["tc_default_ms"], "best", res["tc_best_ms"], config, flush=True)

    try:
        res["per_span_ms"] = time_few(lambda: span_forward(geo, PER_SPAN_CONFIG))
        per_span_out, per_span_lse = span_forward(geo, PER_SPAN_CONFIG)
        res["tc_vs_per_span_max_abs"] = (out.float() - per_span_out.float()).abs().max().item()
        res["tc_vs_per_span_lse_max_abs"] = (lse - per_span_lse)[torch.isfinite(per_span_lse)].abs().max().item()
        del per_span_out, per_span_lse
    except Exception as exc:  # noqa: BLE001
        res["per_span_error"] = f"{type(exc).__name__}: {exc}"[:300]
    del out, lse, best_out, best_lse
    kd, vd = (t.repeat_interleave(HQ // HKV, dim=1) for t in (k, v))
    causal = lq == lkv
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        res["sdpa_ms"] = bench(lambda: F.scaled_dot_product_attention(q, kd, vd, is_causal=causal))
    print(name, {k_: res.get(k_) for k_ in ("tc_best_ms", "per_span_ms", "sdpa_ms")}, res["bound"]["ms"], flush=True)
    return res


def compiled_variants(kernels):
    """(kernel, compiled variant) for every variant of ``kernels`` (Triton JIT functions) compiled in this process."""
    for kernel in kernels:
        for device_cache in kernel.device_caches.values():
            for compiled in device_cache[0].values():
                yield kernel, compiled


def constexprs(compiled) -> dict:
    """The integer and boolean compile-time arguments of a compiled kernel by name (its tile sizes)."""
    src = getattr(compiled, "src", None)
    names = getattr(getattr(src, "fn", None), "arg_names", [])
    values = {}
    for key, value in getattr(src, "constants", {}).items():
        if isinstance(key, tuple) and len(key) == 1 and key[0] < len(names) and isinstance(value, (int, bool)):
            values[names[key[0]]] = value
    return values


def kernel_registers(kernels) -> list[dict]:
    """Registers, spill stores, shared memory and compile-time arguments of every compiled variant of
    ``kernels`` (a variant never launched has no register figures yet: None)."""
    rows = []
    for kernel, compiled in compiled_variants(kernels):
        meta = compiled.metadata
        rows.append({"kernel": kernel.fn.__name__, "module": kernel.fn.__module__, "warps": meta.num_warps,
                     "stages": meta.num_stages, "registers": getattr(compiled, "n_regs", None),
                     "spills": getattr(compiled, "n_spills", None), "shared_bytes": meta.shared,
                     "constexprs": constexprs(compiled)})
    return sorted(rows, key=lambda r: (r["kernel"], r["warps"], r["stages"]))


def compiled_info(out_dir):
    """Registers, spills, shared memory and matrix instructions of every compiled variant."""
    info = []
    for i, (fn, ck) in enumerate(compiled_variants((window_attention_kernel, span_tile_kernel))):
        ptx, ttgir = ck.asm.get("ptx", ""), ck.asm.get("ttgir", "")
        meta = ck.metadata
        entry = {
            "kernel": fn.__name__, "num_warps": meta.num_warps, "num_stages": meta.num_stages,
            "shared": meta.shared, "n_regs": getattr(ck, "n_regs", None), "n_spills": getattr(ck, "n_spills", None),
            "wgmma_ptx": ptx.count("wgmma.mma_async"), "mma_sync_ptx": ptx.count("mma.sync"),
            "warp_group_dot_ttgir": ttgir.count("warp_group_dot"),
        }
        info.append(entry)
        if out_dir:
            (out_dir / f"{fn.__name__}_{i}.ptx").write_text(ptx)
            (out_dir / f"{fn.__name__}_{i}.ttgir").write_text(ttgir)
    return info


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("span_forward_tiles.json"))
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--seed", type=int, default=20261130)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("span_forward_tiles.py needs a CUDA GPU; none is available")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "seed": args.seed, "window": WINDOW, "cases": []}
    t0 = time.time()
    report["small_checks"] = small_checks(gen, dev)

    def save():
        args.out.write_text(json.dumps(report, indent=1, default=str))

    save()
    for name in args.cases:
        try:
            report["cases"].append(run_case(name, *CASES[name], gen, dev))
        except Exception:  # noqa: BLE001 - keep the other cases
            report["cases"].append({"case": name, "error": traceback.format_exc()[-1500:]})
            print(traceback.format_exc(), flush=True)
        torch.cuda.empty_cache()
        save()
    asm_dir = args.out.parent / "asm"
    asm_dir.mkdir(exist_ok=True)
    try:
        report["compiled"] = compiled_info(asm_dir)
    except Exception:  # noqa: BLE001 - the numbers matter more than the listing
        report["compiled"] = []
        print(traceback.format_exc(), flush=True)
    report["wall_s"] = time.time() - t0
    save()
    for c in report["compiled"]:
        print("compiled", c)
    for r in report["cases"]:
        if "sweep" in r:
            print(r["case"], "sweep", json.dumps(r["sweep"]), "\n  profile", [(p["name"][:40], round(p["ms_per_call"], 3)) for p in r["profile"][:6]])
    print(f"\n{'case':22} {'tc ms':>8} {'window':>8} {'span ms':>9} {'SDPA ms':>8} {'bound ms':>8} {'err rel':>9} {'vs span':>8}")
    for r in report["cases"]:
        if "error" in r:
            print(f"{r['case']:22} ERROR")
            continue
        print(f"{r['case']:22} {r['tc_best_ms']:8.3f} {r['window_default_ms']:8.3f} {r.get('per_span_ms', math.nan):9.1f} "
              f"{r['sdpa_ms']:8.3f} {r['bound']['ms']:8.3f} {r['error_vs_f64']['rel_norm']:9.2e} "
              f"{r.get('tc_vs_per_span_max_abs', math.nan):8.1e}")
    print(f"wall {report['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
