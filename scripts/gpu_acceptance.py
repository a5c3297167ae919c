"""GPU acceptance run: every variant compiles and matches the reference at model-M
shapes (bf16), decode replays from a CUDA graph equal to eager, 64-bit offsets, timings beside SDPA.

Run on a machine with an NVIDIA GPU:  python scripts/gpu_acceptance.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time

import torch
import triton
from triton.testing import do_bench

from superlinear_ops import decode_span_attention_staged_gqa, fused_span_attention_gqa, geometry
from superlinear_ops.launch import KernelConfig, LaunchGeometry
from superlinear_ops.ops.span_attention.per_query_forward import span_forward
from superlinear_ops.ops.span_attention.reference import decode_reference, span_forward_reference
from superlinear_ops.registry import REGISTRY

DEV = torch.device("cuda")
DT = torch.bfloat16
HQ, HKV, D = 32, 2, 128
MODEL_M = dict(sw_index=65, search_power=0.55, inv_search_power_int=None, span_power=0.55)
WINDOW = geometry.window_len_from_sw_index(65, search_power=0.55, inv_search_power_int=None)
RESULTS: dict = {}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    err = (a.double() - b.double()).abs().max().item()
    return float("nan") if math.isnan(err) else err


def rand(*shape, gen):
    return torch.randn(*shape, generator=gen, device=DEV).to(DT)


def spans_before_window(gen, lq, cache_position, n_spans, max_len):
    pos = cache_position.view(1, 1, lq, 1)
    limit = (pos - WINDOW + 1).clamp(min=0)
    shape = (1, HQ, lq, n_spans)
    end = (torch.rand(shape, generator=gen, device=DEV) * limit).floor().long()
    start = (end - torch.randint(1, max_len, shape, generator=gen, device=DEV)).clamp(min=0)
    unused = (limit <= 0).expand(shape) | (torch.rand(shape, generator=gen, device=DEV) < 0.1)
    return torch.where(unused, -1, start), torch.where(unused, -1, end)


def check_decode(gen) -> None:
    lkv = 65536
    q1, q2 = rand(1, HQ, 1, D, gen=gen), rand(1, HQ, 1, D, gen=gen)
    k, v = rand(1, HKV, lkv, D, gen=gen), rand(1, HKV, lkv, D, gen=gen)
    cp = torch.tensor([lkv - 1], device=DEV)
    kw = dict(MODEL_M, topk=3, backward_factor=3.0, forward_factor=1.0)
    out = decode_span_attention_staged_gqa(q1, q2, k, v, cp, **kw)
    params = geometry.power_params(search_power=0.55, inv_search_power_int=None)
    ref = decode_reference(
        *(t.cpu() for t in (q1, q2, k, v, cp)), None, sw_index=65, topk=3, backward_factor=3.0,
        forward_factor=1.0, span_power=0.55, params=params,
    )
    RESULTS["decode_64k_max_err"] = max_err(out.cpu(), ref)
    eager_ms = do_bench(lambda: decode_span_attention_staged_gqa(q1, q2, k, v, cp, **kw))
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q2, k, v, enable_gqa=True)  # noqa: E731
    RESULTS["decode_64k_eager_ms"] = eager_ms
    RESULTS["decode_64k_sdpa_ms"] = do_bench(sdpa)
    log(f"decode 64K: max err {RESULTS['decode_64k_max_err']:.3e}, eager {eager_ms:.3f} ms, sdpa {RESULTS['decode_64k_sdpa_ms']:.3f} ms")

    # CUDA graph over a 131072-token static cache, replayed at five advancing positions.
    cache = 131072
    ks, vs = rand(1, HKV, cache, D, gen=gen), rand(1, HKV, cache, D, gen=gen)
    static_cp = torch.tensor([40000], device=DEV)
    static_mask = torch.zeros(1, cache, dtype=torch.bool, device=DEV)
    static_mask[:, :40001] = True
    sq1, sq2 = q1.clone(), q2.clone()
    run = lambda: decode_span_attention_staged_gqa(sq1, sq2, ks, vs, static_cp, static_mask, **kw)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run()
    diffs = []
    for pos in range(40000, 40005):
        static_cp.fill_(pos)
        static_mask[:, pos] = True
        sq1.copy_(rand(1, HQ, 1, D, gen=gen))
        sq2.copy_(rand(1, HQ, 1, D, gen=gen))
        graph.replay()
        eager = run()
        diffs.append(max_err(static_out, eager))
    RESULTS["graph_replay_vs_eager_max_diff"] = max(diffs)
    RESULTS["decode_131k_static_graph_ms"] = do_bench(graph.replay)
    log(f"graph replay at 5 positions: max |replay - eager| = {max(diffs):.3e}; replay {RESULTS['decode_131k_static_graph_ms']:.3f} ms")


def check_prefill_chunk(gen) -> None:
    lkv, lq = 65536, 2048
    q = rand(1, HQ, lq, D, gen=gen)
    k, v = rand(1, HKV, lkv, D, gen=gen), rand(1, HKV, lkv, D, gen=gen)
    cp = torch.arange(lkv - lq, lkv, device=DEV)
    qs, qe = spans_before_window(gen, lq, cp, 3, 400)
    args = (q, k, v, qs, qe, cp, None, 65)
    kw = dict(span_power=0.55, search_power=0.55, inv_search_power_int=None)
    out = fused_span_attention_gqa(*args, **kw)
    idx = torch.randperm(lq, generator=torch.Generator().manual_seed(1))[:48].to(DEV)
    ref = span_forward_reference(
        q[:, :, idx].double(), k.double(), v.double(), qs[:, :, idx], qe[:, :, idx], cp[idx], None, WINDOW
    )
    RESULTS["prefill_2048x64k_max_err"] = max_err(out[:, :, idx], ref)
    RESULTS["prefill_2048x64k_ms"] = do_bench(lambda: fused_span_attention_gqa(*args, **kw))
    RESULTS["prefill_2048x64k_sdpa_nocausal_ms"] = do_bench(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    )
    log(f"prefill chunk 2048 x 64K: max err {RESULTS['prefill_2048x64k_max_err']:.3e}, "
        f"{RESULTS['prefill_2048x64k_ms']:.2f} ms, sdpa {RESULTS['prefill_2048x64k_sdpa_nocausal_ms']:.2f} ms")


def check_training(gen) -> None:
    n = 4096
    q = rand(1, HQ, n, D, gen=gen)
    k, v = rand(1, HKV, n, D, gen=gen), rand(1, HKV, n, D, gen=gen)
    cp = torch.arange(n, device=DEV)
    qs, qe = spans_before_window(gen, n, cp, 3, 300)
    geo = LaunchGeometry.prepare(q, k, v, qs, qe, cp, None, WINDOW)
    config = KernelConfig()
    out, lse = span_forward(geo, config)
    grad = rand(*out.shape, gen=gen)
    # float64 reference, one kv group at a time (16 query heads share each kv head).
    rep = HQ // HKV
    ref_out, ref_grads = [], [[], [], []]
    for g in range(HKV):
        leaves = [q[:, g * rep:(g + 1) * rep].double(), k[:, g:g + 1].double(), v[:, g:g + 1].double()]
        leaves = [t.requires_grad_() for t in leaves]
        o = span_forward_reference(*leaves, qs[:, g * rep:(g + 1) * rep], qe[:, g * rep:(g + 1) * rep], cp, None, WINDOW)
        o.backward(grad[:, g * rep:(g + 1) * rep].double())
        ref_out.append(o.detach())
        for i, leaf in enumerate(leaves):
            ref_grads[i].append(leaf.grad)
        del o, leaves
        torch.cuda.empty_cache()
    ref_out = torch.cat(ref_out, 1)
    ref_grads = [torch.cat(r, 1) for r in ref_grads]
    RESULTS["train_4k_forward_max_err"] = max_err(out, ref_out)
    RESULTS["train_4k_forward_ms"] = do_bench(lambda: span_forward(geo, config))
    for variant in [v for v in REGISTRY.variants("span_backward") if v.name != "reference"]:
        grads = variant.launch(geo, config, out, lse, grad)
        errs = {name: max_err(g, r) for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)}
        scale = {name: r.abs().max().item() for name, r in zip(("dq", "dk", "dv"), ref_grads)}
        ms = do_bench(lambda: variant.launch(geo, config, out, lse, grad), rep=200)
        RESULTS[f"train_4k_backward_{variant.name}"] = dict(max_err=errs, ref_max_abs=scale, ms=ms)
        log(f"backward {variant.name}: errors {errs} (ref max {scale}), {ms:.2f} ms")

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def sdpa_fwd_bwd():
        o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=True)
        o.backward(grad[:, :, :, 0])

    RESULTS["train_4k_sdpa_causal_fwd_bwd_ms"] = do_bench(sdpa_fwd_bwd)
    RESULTS["train_4k_sdpa_causal_fwd_ms"] = do_bench(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    )
    log(f"training 4K: forward err {RESULTS['train_4k_forward_max_err']:.3e}, {RESULTS['train_4k_forward_ms']:.2f} ms; "
        f"sdpa fwd {RESULTS['train_4k_sdpa_causal_fwd_ms']:.2f} ms, fwd+bwd {RESULTS['train_4k_sdpa_causal_fwd_bwd_ms']:.2f} ms")


def check_int64_offsets(gen) -> None:
    """K/V with more than 2**31 elements: queries and spans near the end of the keys."""
    lkv, hq, hkv = 8_500_000, 2, 2
    k = torch.empty(1, hkv, lkv, D, device=DEV, dtype=DT)
    v = torch.empty_like(k)
    tail = 20000
    k[:, :, -tail:] = rand(1, hkv, tail, D, gen=gen)
    v[:, :, -tail:] = rand(1, hkv, tail, D, gen=gen)
    k[:, :, :-tail] = 0
    v[:, :, :-tail] = 0
    q = rand(1, hq, 4, D, gen=gen)
    cp = torch.arange(lkv - 4, lkv, device=DEV)
    qs = torch.full((1, hq, 4, 2), lkv - tail + 100, device=DEV)
    qe = qs + 500
    out = fused_span_attention_gqa(q, k, v, qs, qe, cp, None, 65, **{kk: MODEL_M[kk] for kk in ("span_power", "search_power", "inv_search_power_int")})
    base = lkv - tail
    ref = span_forward_reference(q.double(), k[:, :, base:].double(), v[:, :, base:].double(), qs - base, qe - base, cp - base, None, WINDOW)
    RESULTS["int64_offsets_max_err"] = max_err(out, ref)
    RESULTS["int64_offsets_numel"] = k.numel()
    log(f"64-bit offsets ({k.numel()} elements in K): max err {RESULTS['int64_offsets_max_err']:.3e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="gpu_acceptance.json", help="where to write the JSON results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_acceptance.py needs a CUDA GPU; none is available")
    RESULTS["env"] = dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        cuda=torch.version.cuda, python=platform.python_version(), date=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    log(str(RESULTS["env"]))
    gen = torch.Generator(device=DEV).manual_seed(1234)
    failures = []
    for check in (check_decode, check_prefill_chunk, check_training, check_int64_offsets):
        try:
            check(gen)
        except Exception as exc:  # report every check, even after one fails
            failures.append(f"{check.__name__}: {exc!r}")
            log(f"FAILED {check.__name__}: {exc!r}")
        torch.cuda.empty_cache()
    RESULTS["failures"] = failures
    with open(args.out, "w") as fh:
        json.dump(RESULTS, fh, indent=2)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
