"""On a GPU: huge windows, non-finite values nobody uses or one row uses, decode
gradients, and every value of the tensor-core backward's tile space, each against the float64
reference path on the same GPU.

    python scripts/gpu_extreme_inputs.py [--out results.json]               # exits 1 when a case fails
    compute-sanitizer --tool memcheck --error-exitcode 9 python scripts/gpu_extreme_inputs.py --small

``--small`` shrinks the tile-space sweep's shape for the memory checker. Without a GPU it runs the
same cases under Triton's interpreter (tiny shapes, slow), as a dry run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from superlinear_ops import decode_span_attention_staged_gqa, fused_span_attention_gqa, superlinear_attention  # noqa: E402
from superlinear_ops.launch import KernelConfig, LaunchGeometry  # noqa: E402
from superlinear_ops.ops.span_attention.reference import span_backward_reference, span_forward_reference  # noqa: E402
from superlinear_ops.ops.span_attention.tile_backward import span_backward_tc  # noqa: E402
from superlinear_ops.ops.span_attention.tile_forward import span_forward_tc  # noqa: E402
from superlinear_ops.ops.span_attention.variants import TC_BACKWARD_DEFAULTS  # noqa: E402
from superlinear_ops.problem import SPAN_BACKWARD, Problem  # noqa: E402
from superlinear_ops.registry import REGISTRY  # noqa: E402
from superlinear_ops.tuner.sanitize import covering_configs  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
DTYPE = torch.bfloat16 if GPU else torch.float32
TOLERANCE = 3e-2 if GPU else 1e-4  # max error over max magnitude (bf16 inputs against float64)
# (queries, keys, query heads, KV heads, head dim) of the cases; the interpreter's dry run is tiny.
SHAPE = (256, 1024, 8, 2, 64) if GPU else (16, 64, 2, 1, 16)
TRAINING_DIM = 128 if GPU else 16


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (inf when got has NaN where want has none)."""
    got, want = got.double(), want.double()
    if bool((got.isnan() & ~want.isnan()).any()):
        return math.inf
    return float((got - want).nan_to_num(0.0).abs().max() / want.nan_to_num(0.0).abs().max().clamp(min=1e-30))


def layer_grads(dtype, q1, q2, k, v, cp, mask, grad, **settings):
    """(O, dQ1, dQ2, dK, dV) of superlinear_attention in float64 for inputs converted to ``dtype``."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q1, q2, k, v)]
    out = superlinear_attention(*leaves, cp, mask, **settings)
    out.backward(grad.to(dtype))
    return [out.detach().double()] + [(t.grad if t.grad is not None else torch.zeros_like(t)).double() for t in leaves]


def compare(name: str, got: list, want: list, labels=("O", "dQ1", "dQ2", "dK", "dV")) -> dict:
    errors = {label: relative_error(g, w) for label, g, w in zip(labels, got, want)}
    return {"case": name, "errors": errors, "ok": all(e <= TOLERANCE for e in errors.values())}


def layer_inputs(seed: int, lq: int, lkv: int):
    hq, hkv, dim = SHAPE[2:]
    gen = torch.Generator().manual_seed(seed)
    q1, q2 = (torch.randn(1, hq, lq, dim, generator=gen).to(DEVICE) for _ in range(2))
    k, v = (torch.randn(1, hkv, lkv, dim, generator=gen).to(DEVICE) for _ in range(2))
    return q1, q2, k, v, torch.randn(1, hq, lq, dim, generator=gen).to(DEVICE)


def huge_window_cases() -> list[dict]:
    """The layer and the span op with W at or past 2**31 keys, against float64 on clean inputs."""
    results = []
    lq, lkv, hq, _, dim = SHAPE
    q1, q2, k, v, grad = layer_inputs(1, lq, lkv)
    cp = torch.arange(lkv - lq, lkv, device=DEVICE)
    for name, settings in (("sw_index 46340", dict(sw_index=46340)), ("sw_index 2**31 - 2", dict(sw_index=2**31 - 2)),
                           ("search power 0.02, sw_index 1", dict(sw_index=1, search_power=0.02, inv_search_power_int=None))):
        want = layer_grads(torch.float64, q1, q2, k, v, cp, None, grad, topk=3, **settings)
        results.append(compare(f"layer, {name}", layer_grads(DTYPE, q1, q2, k, v, cp, None, grad, topk=3, **settings), want))
    gen = torch.Generator().manual_seed(2)
    qstart = torch.randint(0, lkv // 2, (1, hq, lq, 3), generator=gen).to(DEVICE)
    qend = qstart + lq // 4
    span_grad = torch.randn(1, hq, lq, 3, dim, generator=gen).to(DEVICE)
    for sw_index in (46339, 46340):
        def run(dtype):
            leaves = [t.detach().to(dtype).requires_grad_() for t in (q2, k, v)]
            out = fused_span_attention_gqa(*leaves, qstart, qend, cp, None, sw_index=sw_index)
            out.backward(span_grad.to(dtype))
            return [out.detach().double()] + [t.grad.double() for t in leaves]
        results.append(compare(f"span op, sw_index {sw_index}", run(DTYPE), run(torch.float64), ("O", "dQ", "dK", "dV")))
    return results


def unused_nan_cases() -> list[dict]:
    """NaN at a masked key 0 (left padding, empty span slots) and in a Q1 row with t <= W: every
    gradient equals the float64 one on clean inputs."""
    results = []
    lq = SHAPE[0]
    q1, q2, k, v, grad = layer_inputs(3, lq, 2 * lq)
    cp = torch.arange(lq, 2 * lq, device=DEVICE)
    mask = torch.ones(1, 2 * lq, dtype=torch.bool, device=DEVICE)
    mask[0, : lq // 8] = False
    bad_k, bad_v = k.clone(), v.clone()
    bad_k[0, :, 0], bad_v[0, :, 0] = math.nan, math.nan
    sw_index = math.isqrt(lq) - 1  # W = lq - 1: early queries have empty span slots
    settings = dict(sw_index=sw_index, topk=3, forward_factor=1.0)
    want = layer_grads(torch.float64, q1, q2, k, v, cp, mask, grad, **settings)
    results.append(compare("layer, NaN at a masked key 0", layer_grads(DTYPE, q1, q2, bad_k, bad_v, cp, mask, grad, **settings), want))
    cp = torch.arange(0, lq, device=DEVICE)  # every query but the last has t <= W
    want = layer_grads(torch.float64, q1, q2, k, v, cp, None, grad, **settings)
    bad_q1 = q1.clone()
    bad_q1[0, 1, lq // 3] = math.nan
    results.append(compare("layer, NaN in a Q1 row nobody uses", layer_grads(DTYPE, bad_q1, q2, k, v, cp, None, grad, **settings), want))
    return results


def poisoned_row_cases() -> list[dict]:
    """NaN in one Q row and in one attended window key: the tensor-core forward and backward give
    the float64 reference's gradients (poisoned rows pass none)."""
    results = []
    lq, lkv, hq, hkv, dim = SHAPE
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, hq, lq, dim, generator=gen).to(DEVICE)
    k, v = (torch.randn(1, hkv, lkv, dim, generator=gen).to(DEVICE) for _ in range(2))
    cp = torch.arange(lkv - lq, lkv, device=DEVICE)
    qstart = torch.randint(0, lkv // 2, (1, hq, lq, 3), generator=gen).to(DEVICE)
    qend = qstart + lq // 6
    grad = torch.randn(1, hq, lq, 3, dim, generator=gen).to(DEVICE)
    window = lq // 3
    for name in ("Q row", "window key"):
        bad_q, bad_k = q.clone(), k.clone()
        if name == "Q row":
            bad_q[0, hq - 1, lq // 3, 3] = math.nan
        else:
            bad_k[0, hkv - 1, lkv - lq // 2, 9] = math.nan
        want_out, want_lse = span_forward_reference(bad_q.double(), bad_k.double(), v.double(), qstart, qend, cp, None, window,
                                                    return_lse=True)
        want = span_backward_reference(bad_q.double(), bad_k.double(), v.double(), qstart, qend, cp, None, window, grad.double())
        geo = LaunchGeometry.prepare(bad_q.to(DTYPE), bad_k.to(DTYPE), v.to(DTYPE), qstart, qend, cp, None, window)
        out, lse = span_forward_tc(geo, KernelConfig(window_block_m=64, window_block_n=64, window_warps=4, window_stages=2,
                                                     span_block_m=64, span_block_n=64, span_warps=4, span_stages=2))
        grads = span_backward_tc(geo, TC_BACKWARD_DEFAULTS, out, lse, grad.to(DTYPE))
        poisoned_ok = bool(torch.equal(out.isnan().any(-1), want_out.isnan().any(-1)))
        entry = compare(f"span tensor cores, NaN in one {name}", list(grads), list(want), ("dQ", "dK", "dV"))
        entry["poisoned outputs match"] = poisoned_ok
        entry["ok"] = entry["ok"] and poisoned_ok
        results.append(entry)
    return results


def decode_cases() -> list[dict]:
    """Decode with inputs that require grad: differentiable, gradients equal float64's."""
    gen = torch.Generator().manual_seed(7)
    _, lkv, hq, hkv, dim = SHAPE
    q1, q2 = (torch.randn(2, hq, 1, dim, generator=gen).to(DEVICE) for _ in range(2))
    k, v = (torch.randn(2, hkv, 4 * lkv, dim, generator=gen).to(DEVICE) for _ in range(2))
    cp, grad = torch.tensor([4 * lkv - 90], device=DEVICE), torch.randn(2, hq, 1, dim, generator=gen).to(DEVICE)
    settings = dict(sw_index=3, topk=3, backward_factor=3.0, forward_factor=1.0, span_power=0.55)

    def run(dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q1, q2, k, v)]
        out = decode_span_attention_staged_gqa(*leaves, cp, None, **settings)
        if not out.requires_grad:
            return [out.double()] + [torch.full_like(t, math.nan).double() for t in leaves]
        out.backward(grad.to(dtype))
        return [out.detach().double()] + [t.grad.double() for t in leaves]
    return [compare("decode, inputs that require grad", run(DTYPE), run(torch.float64))]


def backward_space_cases(small: bool) -> list[dict]:
    """The tensor-core backward at a training shape (every query its own window, three spans) for
    each covering configuration of the declared space, against the float64 reference."""
    lq = (256 if small else 2048) if GPU else 48
    hq, hkv, dim = SHAPE[2], SHAPE[3], TRAINING_DIM
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, hq, lq, dim, generator=gen).to(DEVICE)
    k, v = (torch.randn(1, hkv, lq, dim, generator=gen).to(DEVICE) for _ in range(2))
    cp = torch.arange(lq, device=DEVICE)
    window = 80 if GPU else 8
    end = (torch.rand(1, hq, lq, 3, generator=gen) * (cp.cpu().view(1, 1, -1, 1) - window)).long().to(DEVICE)
    start = (end - torch.randint(1, 200, end.shape, generator=gen).to(DEVICE)).clamp(min=0)
    end = torch.where(cp.view(1, 1, -1, 1) > window, end, -1)  # t <= W rows: empty span slots
    start = torch.where(end >= 0, start, -1)
    grad = torch.randn(1, hq, lq, 3, dim, generator=gen).to(DEVICE)
    variant = REGISTRY.get(SPAN_BACKWARD, "tc_tiles")
    problem = Problem.for_span(SPAN_BACKWARD, q.to(DTYPE), k, 3, False, 8, "int2")
    want = span_backward_reference(q.double(), k.double(), v.double(), start, end, cp, None, window, grad.double())
    geo = LaunchGeometry.prepare(q.to(DTYPE), k.to(DTYPE), v.to(DTYPE), start, end, cp, None, window)
    out, lse = span_forward_tc(geo, KernelConfig(window_block_m=64, window_block_n=64, window_warps=4, window_stages=2,
                                                 span_block_m=64, span_block_n=64, span_warps=4, span_stages=2))
    results = []
    for config in covering_configs(variant, KernelConfig(TC_BACKWARD_DEFAULTS)):
        reason = variant.compile_check(problem, config)
        if reason:  # the registry's static check keeps it from every tune on this GPU
            results.append({"case": f"backward {config.text()}", "ok": True, "skipped": reason, "errors": {}})
            continue
        try:
            grads = span_backward_tc(geo, config, out, lse, grad.to(DTYPE))
            if GPU:
                torch.cuda.synchronize()
            results.append(compare(f"backward {config.text()}", list(grads), list(want), ("dQ", "dK", "dV")))
        except Exception as error:  # a resource limit or a fault: report it, the sweep goes on while it can
            results.append({"case": f"backward {config.text()}", "ok": False, "error": f"{type(error).__name__}: {error}"[:300]})
            if "illegal memory access" in str(error):
                break
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a small shape for the tile-space sweep (memory checker)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    start = time.time()
    results = huge_window_cases() + unused_nan_cases() + poisoned_row_cases() + decode_cases()
    results += backward_space_cases(args.small)
    for r in results:
        detail = r.get("error") or r.get("skipped") or " ".join(f"{k} {v:.1e}" for k, v in r["errors"].items())
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['case']}: {detail}", flush=True)
    failed = sum(not r["ok"] for r in results)
    print(f"{len(results) - failed} passed, {failed} failed ({time.time() - start:.0f} s, {DEVICE}, {DTYPE})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
