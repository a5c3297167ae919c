"""The whole attention layer (docs/semantics.md section 4) on a GPU at model M, side by side in one run.

Parts (``--parts``, default all, in this order):
- checks: max errors of O and dQ1/dQ2/dK/dV against the float64 reference (the library's PyTorch
  composition run on our anchors), the share of (head, query) rows whose anchors differ from the
  float64 search's, and a prefill chunk captured in a CUDA graph and replayed (also after moving
  the chunk) compared with eager;
- sweep: both Triton searches' tiles at 8192 over 139,264 and 32,768 over 1,048,576 keys;
- targets: the public op (tuned cache as installed), dense SDPA with the cuDNN and the flash backend
  forced (prefill: the chunk over the prefix without a mask plus the causal chunk over itself;
  training: causal), the original package's best path (``fused_prefill_with_swtriton_bucketed_gqa``)
  where it runs, and the lower bounds: prefill chunks over growing prefixes, 32,768 over 1M, the
  search alone, training fwd + bwd 4K/16K/64K, with per-kernel times (PyTorch profiler) of the
  large cases.

Model M: B 1, Hq 32, Hkv 2, D 128, bf16, sw_index 65 (W 2032), search power 0.55, span power 0.55,
bf 3, ff 1, topk 3. Run on a GPU:  PYTHONPATH=. python benchmarks/whole_layer.py --out whole_layer.json
"""

from __future__ import annotations

import argparse
import json
import re

import torch
import torch.nn.functional as F
import triton
from span_forward_tiles import bench, profile, time_few  # this folder's model-M comparison helpers
from torch.nn.attention import SDPBackend, sdpa_kernel

from superlinear_ops import geometry, torch_ops
from superlinear_ops.launch import KernelConfig
from superlinear_ops.layer_api import superlinear_attention
from superlinear_ops.ops.inputs import decode_mask
from superlinear_ops.ops.layer.composition import attention_layer
from superlinear_ops.ops.layer.spans import spans_of_anchors
from superlinear_ops.ops.layer_search.reference import search_reference
from superlinear_ops.ops.layer_search.stripe_tile_search import stripe_tile_search
from superlinear_ops.ops.layer_search.tiled_search import tiled_search
from superlinear_ops.ops.layer_search.variants import search_default, stripe_tile_default
from superlinear_ops.ops.span_attention.reference import span_forward_reference
from superlinear_ops.problem import Problem
from superlinear_ops.settings import SpanSettings
from superlinear_ops.tuner.bench import device_peaks

HQ, HKV, D, TOPK = 32, 2, 128, 3
SW_INDEX, POWER, SPAN_POWER, BF, FF = 65, 0.55, 0.55, 3.0, 1.0
DEVICE = "cuda"
PARAMS = geometry.power_params(search_power=POWER, inv_search_power_int=None)
WINDOW = geometry.window_length(SW_INDEX, PARAMS)
SETTINGS = SpanSettings(SW_INDEX, TOPK, BF, FF, SPAN_POWER, PARAMS)
ARGS = dict(sw_index=SW_INDEX, topk=TOPK, backward_factor=BF, forward_factor=FF, span_power=SPAN_POWER,
            search_power=POWER, inv_search_power_int=None)
PREFILL = [(8192, 8192), (8192, 16384), (8192, 32768), (8192, 65536), (8192, 139264), (8192, 1048576), (32768, 1048576)]
TRAINING = [4096, 16384, 65536]
PROFILED = {"prefill 8192 over 16384", "prefill 8192 over 139264", "prefill 32768 over 1048576", "training 16384"}
SWEEP_SHAPES = [(8192, 139264), (32768, 1048576)]
SWEEP = {  # per Triton search: its launcher and configurations
    "tiled_search": (tiled_search, [KernelConfig(block_q=bq, block_h=bh, num_warps=w, num_stages=st)
                                    for bq in (16, 32) for bh in (8, 16) for w in (4, 8) for st in (1, 2)]),
    "stripe_tiles": (stripe_tile_search, [KernelConfig(block_s=bs, block_h=16, block_q=1, num_warps=w)
                                          for bs in (16, 32, 64, 128) for w in (1, 2, 4)]),
}
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
ORIGINAL_SKIP = {"training 65536"}  # the original needs about 2.4 s per 16K step: 64K would take minutes


def inputs(lq, lkv, seed=0, masked_front=0, grad=False):
    """bf16 model-M tensors; the chunk is the last ``lq`` positions of ``lkv`` keys."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=DEVICE, dtype=torch.bfloat16)  # noqa: E731
    q1, q2, k, v = rnd(1, HQ, lq, D), rnd(1, HQ, lq, D), rnd(1, HKV, lkv, D), rnd(1, HKV, lkv, D)
    if grad:
        for t in (q1, q2, k, v):
            t.requires_grad_(True)
    mask = None
    if masked_front:
        mask = torch.ones(1, lkv, dtype=torch.bool, device=DEVICE)
        mask[:, :masked_front] = False
    return q1, q2, k, v, torch.arange(lkv - lq, lkv, device=DEVICE), mask


def public_call(lq, lkv, training, mask_kind=None):
    """(call, positions): ``call()`` runs the public op at model M on ``inputs(lq, lkv, seed=4)`` and
    returns (O,) or, for training, (O, dQ1, dQ2, dK, dV) under a fixed output gradient; with
    ``mask_kind`` ('ones', 'holes' or 'left_padding': ``ops.inputs.decode_mask``) under that mask."""
    q1, q2, k, v, positions, _ = inputs(lq, lkv, seed=4, grad=training)
    grad = torch.randn(1, HQ, lq, D, device=DEVICE, dtype=torch.bfloat16)
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    mask = decode_mask(mask_kind, 1, lkv, lkv, torch.device(DEVICE), gen)

    def call():
        out = superlinear_attention(q1, q2, k, v, positions, mask, **ARGS)
        return (out, *torch.autograd.grad(out, (q1, q2, k, v), grad)) if training else (out,)
    return call, positions


def captured(call, warmups: int = 2):
    """(graph, its static result): ``call`` captured in a CUDA graph after ``warmups`` runs on a side
    stream (the first calls build the geometry tables and compile; a capture must not)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = call()
    return graph, static


def interleaved_ab(call, use, training: bool, rounds: int = 3) -> tuple[dict, dict]:
    """``call`` with ``use(False)`` and with ``use(True)`` in one process: ({side: its outputs as
    float tensors}, {side: its do_bench medians over ``rounds`` interleaved rounds})."""
    grad_mode = torch.enable_grad if training else torch.no_grad
    outputs, times = {}, {False: [], True: []}
    for side in (False, True):
        use(side)
        with grad_mode():
            outputs[side] = [t.float() for t in call()]
    for _ in range(rounds):
        for side in (False, True):
            use(side)
            with grad_mode():
                times[side].append(bench(call))
    return outputs, times


def reference_layer(q1, q2, k, v, cp, mask, anchors):
    """The float64 layer on given anchors (the library's PyTorch composition), differentiable."""
    settings = SETTINGS.for_keys(k.shape[2])

    def spans(qstart, qend):
        return span_forward_reference(q2, k, v, qstart, qend, cp, mask, WINDOW)

    return attention_layer(q1, k, anchors, cp, mask, settings, spans, torch.float64, torch_ops.LAYER_STEPS)


def rows_with_other_anchor_sets(a, b):
    """Share of (head, query) rows whose anchor sets differ; -1 slots pad the narrower (topk clamped to the stripes)."""
    width = max(a.shape[-1], b.shape[-1])
    a, b = (F.pad(t, (0, width - t.shape[-1]), value=-1).sort(-1).values for t in (a, b))
    return (a != b).any(-1).double().mean().item()


def check_case(name, lq, lkv, front):
    q1, q2, k, v, cp, mask = inputs(lq, lkv, seed=1, masked_front=front, grad=True)
    out = superlinear_attention(q1, q2, k, v, cp, mask, **ARGS)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q1, q2, k, v), grad)
    settings = SETTINGS.for_keys(lkv)
    with torch.no_grad():
        ours = torch_ops.layer_search(q1, k, cp, mask, SW_INDEX, TOPK, BF, FF, SPAN_POWER, POWER, None)[0]
    exact = search_reference(q1.detach().double(), k.detach().double(), cp, mask, settings, KernelConfig()).anchors
    differ = rows_with_other_anchor_sets(ours, exact)
    x64 = [t.detach().double().requires_grad_(True) for t in (q1, q2, k, v)]
    ref = reference_layer(*x64, cp, mask, ours)
    want = torch.autograd.grad(ref, x64, grad.double())
    row = {"anchor_rows_differing_from_float64_search": differ, "nan": bool(out.isnan().any() or any(g.isnan().any() for g in got))}
    for label, a, b in zip(("O", "dQ1", "dQ2", "dK", "dV"), (out, *got), (ref, *want)):
        row[label] = {"max_abs": (a.double() - b).abs().max().item(), "max_ref": b.abs().max().item(),
                      "rel_to_max": ((a.double() - b).abs().max() / b.abs().max()).item()}
    print(name, json.dumps(row), flush=True)
    return row


def checks():
    res = {}
    for name, lq, lkv, front in (("prefill 512 over 12288, 100 padded keys", 512, 12288, 100), ("training 2048", 2048, 2048, 0)):
        res[name] = check_case(name, lq, lkv, front)
        torch.cuda.empty_cache()
    # CUDA graph: a prefill chunk captured once, replayed, then replayed after moving the chunk.
    q1, q2, k, v, cp, _ = inputs(8192, 139264, seed=2)
    static_cp = cp.clone()
    eager = superlinear_attention(q1, q2, k, v, static_cp, None, **ARGS)
    graph, static_out = captured(lambda: superlinear_attention(q1, q2, k, v, static_cp, None, **ARGS), warmups=1)
    graph.replay()
    same = torch.equal(static_out, eager)
    static_cp.copy_(cp - 50000)
    graph.replay()
    moved = superlinear_attention(q1, q2, k, v, cp - 50000, None, **ARGS)
    static_cp.copy_(cp)  # both timings at the same positions (the moved chunk attends fewer keys)
    res["cuda_graph"] = {"replay_equals_eager": same, "moved_chunk_replay_equals_eager": torch.equal(static_out, moved),
                         "replay_ms": bench(graph.replay), "eager_ms": bench(lambda: superlinear_attention(q1, q2, k, v, cp, None, **ARGS))}
    print("cuda_graph", res["cuda_graph"], flush=True)
    return res


def sweep_shape(lq, lkv):
    q1, _, k, _, cp, _ = inputs(lq, lkv, seed=3)
    settings = SETTINGS.for_keys(lkv)
    problem = Problem.for_layer(q1, k, TOPK, False, SW_INDEX, PARAMS.label, (BF, FF, SPAN_POWER))
    base = tiled_search(q1, k, cp, None, settings, search_default(problem)).anchors.sort(-1).values
    rows = []
    for name, (launch, configs) in SWEEP.items():
        for config in configs:
            row = {"variant": name, "config": dict(config)}
            try:
                same = (launch(q1, k, cp, None, settings, config).anchors.sort(-1).values == base).all(-1).double().mean().item()
                row.update(ms=bench(lambda: launch(q1, k, cp, None, settings, config), rep=50), rows_equal_tiled_default=same)
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {exc}"[:200]
            rows.append(row)
    rows.sort(key=lambda r: r.get("ms", float("inf")))
    print(lq, lkv, rows[:3], flush=True)
    return {"defaults": {"tiled_search": dict(search_default(problem)),
                         "stripe_tiles": dict(stripe_tile_default(problem))}, "rows": rows}


def sweep():
    res = {f"{lq} over {lkv}": sweep_shape(lq, lkv) for lq, lkv in SWEEP_SHAPES}
    torch.cuda.empty_cache()
    return res


def peaks():
    """This GPU's copy bandwidth (bytes/s) and bf16 tensor-core rate (FLOP/s), as measured
    (``tuner.bench.PEAKS``; nan for a GPU with no figures)."""
    return device_peaks(torch.cuda.get_device_name())


def lower_bound(lq, lkv, training, anchors, cp):
    """Bytes over this GPU's bandwidth or FLOPs over its tensor-core rate, for the layer and for the
    search; also the search's gathered key rows over bandwidth (one 2*D-byte row per (query, KV head, stripe))."""
    bandwidth, rate = peaks()
    qstart, qend = spans_of_anchors(anchors, cp, lkv, None, SETTINGS.for_keys(lkv))
    pos = cp.long().clamp(max=lkv - 1)
    lo_w = (pos - WINDOW + 1).clamp(min=0)
    window_keys = (pos - lo_w + 1).sum().item() * HQ
    span_keys = (qend - qstart + 1).clamp(min=0).sum().item()
    attn = 4 * D * (window_keys + span_keys) * (3.5 if training else 1.0)
    offsets = geometry.stripe_offsets_tensor(lkv, SW_INDEX, PARAMS, cp.device)
    stripe_total = int(torch.searchsorted(offsets, pos + 1, right=True).sum().item())  # (query, stripe) pairs
    search = 2 * D * HQ * stripe_total
    bytes_ = 2 * (2 * HQ * lq * D + 2 * HKV * lkv * D + HQ * lq * TOPK * D) * (3 if training else 1)
    search_bytes = 2 * (HQ * lq * D + HKV * lkv * D)
    gathered = 2 * D * HKV * stripe_total
    ms = 1e3 * max(bytes_ / bandwidth, (attn + search) / rate)
    return {"ms": ms, "attention_tflop": attn / 1e12, "search_tflop": search / 1e12, "gb": bytes_ / 1e9,
            "search_ms": 1e3 * max(search_bytes / bandwidth, search / rate),
            "search_gathered_gb": gathered / 1e9, "search_gathered_ms": 1e3 * gathered / bandwidth,
            "basis": f"max(bytes / {bandwidth / 1e12:.1f} TB/s, FLOPs / {rate / 1e12:.0f} TFLOP/s bf16 tensor cores); "
                     f"search alone likewise, and its gathered stripe rows / {bandwidth / 1e12:.1f} TB/s (what an L2 "
                     "miss on every row would cost)"}


def dense_times(q, k, v, training, grad):
    """SDPA with each backend forced (ms): training causal fwd + bwd; prefill the chunk over the
    prefix without a mask plus the chunk over itself, causal (K/V repeated to Hq heads outside the timing)."""
    lq, lkv = q.shape[2], k.shape[2]
    kd, vd = (t.detach().repeat_interleave(HQ // HKV, dim=1).requires_grad_(training) for t in (k, v))
    qd = q.detach().requires_grad_(training)
    times = {}
    for name, backend in BACKENDS.items():
        def run(backend=backend):
            with sdpa_kernel(backend):
                if training:
                    out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
                    torch.autograd.grad(out, (qd, kd, vd), grad)
                    return
                F.scaled_dot_product_attention(qd, kd[:, :, lkv - lq:], vd[:, :, lkv - lq:], is_causal=True)
                if lkv > lq:
                    F.scaled_dot_product_attention(qd, kd[:, :, :lkv - lq], vd[:, :, :lkv - lq])
        try:
            times[f"sdpa_{name}_ms"] = bench(run)
        except RuntimeError as exc:
            times[f"sdpa_{name}_error"] = str(exc)[:200]
    return times


def original_module():
    try:
        from superlinear.kernels.superlinear.attention import api
    except Exception as exc:  # noqa: BLE001
        print("original package unavailable:", exc, flush=True)
        return None
    return api


def target_case(name, lq, lkv, training, original):
    q1, q2, k, v, cp, _ = inputs(lq, lkv, seed=4, grad=training)
    grad = torch.randn(1, HQ, lq, D, device=DEVICE, dtype=torch.bfloat16)

    def ours():
        out = superlinear_attention(q1, q2, k, v, cp, None, **ARGS)
        if training:
            torch.autograd.grad(out, (q1, q2, k, v), grad)

    row = {"ours_ms": bench(ours)}
    with torch.no_grad():
        anchors = torch_ops.layer_search(q1, k, cp, None, SW_INDEX, TOPK, BF, FF, SPAN_POWER, POWER, None)[0]
    row["search_ms"] = bench(lambda: torch_ops.layer_search(q1, k, cp, None, SW_INDEX, TOPK, BF, FF, SPAN_POWER, POWER, None))
    row["bound"] = lower_bound(lq, lkv, training, anchors, cp)
    row.update(dense_times(q2, k, v, training, grad))
    if original is not None and name not in ORIGINAL_SKIP:
        def theirs():
            out = original.fused_prefill_with_swtriton_bucketed_gqa(
                q1, q2, k, v, cp, None, SW_INDEX, TOPK, backward_factor=BF, forward_factor=FF, span_power=SPAN_POWER,
                search_power=POWER, inv_search_power_int=None)
            if training:
                torch.autograd.grad(out, (q1, q2, k, v), grad)
        try:
            row["original_ms"] = time_few(theirs)
        except Exception as exc:  # noqa: BLE001
            row["original_error"] = f"{type(exc).__name__}: {exc}"[:200]
        torch.cuda.empty_cache()
    if name in PROFILED:
        row["kernels"] = profile(ours)[:12]
    row["ours_vs_cudnn"] = row.get("sdpa_cudnn_ms", float("nan")) / row["ours_ms"]
    print(name, {k_: row.get(k_) for k_ in ("ours_ms", "search_ms", "sdpa_cudnn_ms", "sdpa_flash_ms", "original_ms")},
          f"bound {row['bound']['ms']:.2f} (search {row['bound']['search_ms']:.2f}, gathered {row['bound']['search_gathered_ms']:.2f})",
          flush=True)
    for kernel in row.get("kernels", [])[:8]:
        print(f"    {kernel['ms_per_call']:8.3f} ms per call  {kernel['count'] // 5:3d} launches  {kernel['name']}", flush=True)
    return row


def warm_gpu(seconds: float = 2.0) -> None:
    """Keep the GPU busy for ``seconds`` so that the first case is not timed at idle clocks (it
    measured 2.54 ms instead of 1.77 once without this)."""
    a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(20):
            a @ a
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > 1e3 * seconds:
            return


def targets(only: str = ""):
    """The target table's cases whose names match the regular expression ``only`` (all when empty)."""
    warm_gpu()
    original = original_module()
    cases = [(f"prefill {lq} over {lkv}", lq, lkv, False) for lq, lkv in PREFILL]
    cases += [(f"training {n}", n, n, True) for n in TRAINING]
    res = {}
    for name, lq, lkv, training in cases:
        if not re.search(only, name):
            continue
        res[name] = target_case(name, lq, lkv, training, original)
        torch.cuda.empty_cache()
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="whole_layer.json", help="JSON results file")
    parser.add_argument("--parts", default="checks,sweep,targets", help="comma-separated: checks, sweep, targets")
    parser.add_argument("--cases", default="", help="targets: only the cases matching this regular expression, "
                        "e.g. '^prefill' (training has its own script, whole_layer_training.py)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("whole_layer.py needs a CUDA GPU; none is available")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    parts = {"checks": checks, "sweep": sweep, "targets": lambda: targets(args.cases)}
    for part in args.parts.split(","):
        results[part] = parts[part]()
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
