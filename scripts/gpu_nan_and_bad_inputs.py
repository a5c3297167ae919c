"""On a GPU: NaN never leaks from keys no query attends and always shows from attended
ones, on every registered variant and the whole layer; and the bad inputs that reach a kernel
(oversized topk, factors and sw_index, positions past the cache or negative, spans past the keys)
run cleanly.

    python scripts/gpu_nan_and_bad_inputs.py --part nan          # exits 1 when a case fails
    compute-sanitizer --tool memcheck --error-exitcode 9 python scripts/gpu_nan_and_bad_inputs.py --part bad-inputs

Without a GPU it runs the same cases under Triton's interpreter (small, slow), as a dry run.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from superlinear_ops import decode_span_attention_staged_gqa, fused_span_attention_gqa, geometry, superlinear_attention  # noqa: E402
from superlinear_ops.launch import LaunchGeometry  # noqa: E402
from superlinear_ops.ops.span_attention.reference import span_forward_reference  # noqa: E402
from superlinear_ops.problem import SPAN_BACKWARD, SPAN_FORWARD, STAGED_DECODE, Problem  # noqa: E402
from superlinear_ops.registry import REGISTRY  # noqa: E402
from superlinear_ops.settings import SpanSettings  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
POWER = geometry.power_params(search_power=None, inv_search_power_int=2)
SW_INDEX = 8  # W = 80
if DEVICE.type == "cuda":
    B, HQ, HKV, D, LQ, LKV, DECODE_KEYS = 1, 8, 2, 64, 64, 512, 4096
    FIRST_POS, TAIL, HOLE = 300, 400, range(370, 380)  # queries at 300..363; keys >= 400 unused; a masked hole
else:  # the interpreter's dry run
    B, HQ, HKV, D, LQ, LKV, DECODE_KEYS = 1, 4, 2, 16, 8, 160, 512
    FIRST_POS, TAIL, HOLE = 100, 120, range(92, 96)


def variants(op: str, problem: Problem) -> list:
    """Every registered variant of ``op`` that applies here (the float64-only reference is skipped)."""
    return [v for v in REGISTRY.variants(op) if not v.not_supported_reasons(problem)]


def span_inputs(seed: int):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, HQ, LQ, D, generator=gen)
    k, v = torch.randn(B, HKV, LKV, D, generator=gen), torch.randn(B, HKV, LKV, D, generator=gen)
    window = geometry.window_length(SW_INDEX, POWER)
    cp = torch.arange(FIRST_POS, FIRST_POS + LQ)
    end = (torch.rand(B, HQ, LQ, 3, generator=gen) * (cp.view(1, 1, -1, 1) - window)).long()
    start = (end - torch.randint(1, 90, end.shape, generator=gen)).clamp(min=0)
    mask = torch.ones(B, LKV, dtype=torch.bool)
    mask[:, list(HOLE)] = False
    return [t.to(DEVICE) for t in (q, k, v, start, end, cp, mask)] + [window]


def poisoned(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V with NaN in the unused tail and the masked hole (keys no query attends)."""
    k, v = k.clone(), v.clone()
    for t in (k, v):
        t[:, :, TAIL:] = float("nan")
        t[:, :, list(HOLE)] = float("nan")
    return k, v


def check_span_nan(seed: int) -> list[str]:
    """Forward and backward of every span variant: unattended NaN changes nothing; attended NaN shows."""
    q, k, v, start, end, cp, mask, window = span_inputs(seed)
    q, k, v = q.to(DTYPE), k.to(DTYPE), v.to(DTYPE)
    failures = []
    kp, vp = poisoned(k, v)
    clean_k, clean_v = k.clone(), v.clone()
    for t in (clean_k, clean_v):
        t[:, :, TAIL:] = 0
        t[:, :, list(HOLE)] = 0
    grad = torch.randn(B, HQ, LQ, 3, D, device=DEVICE).to(DTYPE)
    problem = Problem.for_span(SPAN_FORWARD, q, k, 3, True, SW_INDEX, POWER.label)
    for variant in variants(SPAN_FORWARD, problem):
        config = variant.default(problem)
        out_p, lse_p = variant.launch(LaunchGeometry.prepare(q, kp, vp, start, end, cp, mask, window), config)
        out_c, lse_c = variant.launch(LaunchGeometry.prepare(q, clean_k, clean_v, start, end, cp, mask, window), config)
        if out_p.isnan().any() or not torch.equal(out_p, out_c):
            failures.append(f"{variant.qualified_name}: unattended NaN changed the output")
        for back in variants(SPAN_BACKWARD, problem._replace(op=SPAN_BACKWARD)):
            bconfig = back.default(problem._replace(op=SPAN_BACKWARD))
            gp = back.launch(LaunchGeometry.prepare(q, kp, vp, start, end, cp, mask, window), bconfig, out_p, lse_p, grad)
            gc = back.launch(LaunchGeometry.prepare(q, clean_k, clean_v, start, end, cp, mask, window), bconfig, out_c, lse_c, grad)
            # atomics make gradients differ run to run in the last bits: compare at the dtype's rounding
            if any(a.isnan().any() or not torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2) for a, b in zip(gp, gc)):
                failures.append(f"{variant.qualified_name} + {back.qualified_name}: unattended NaN changed a gradient")
    # Attended NaN: a key inside query 5's window.
    ka = k.clone()
    ka[:, 0, int(cp[5]) - 3, 7] = float("nan")
    expected = span_forward_reference(q.double().cpu(), ka.double().cpu(), v.double().cpu(), start.cpu(), end.cpu(), cp.cpu(),
                                      mask.cpu(), window)
    for variant in variants(SPAN_FORWARD, problem):
        out, _ = variant.launch(LaunchGeometry.prepare(q, ka, v, start, end, cp, mask, window), variant.default(problem))
        if not (out.isnan().cpu() | ~expected.isnan()).all():
            failures.append(f"{variant.qualified_name}: an attended NaN was hidden")
    return failures


def check_decode_nan(seed: int) -> list[str]:
    """Every decode variant on a static cache whose unused tail holds NaN (masked and not), and with
    NaN in Q1 (it must show)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    lkv, pos = DECODE_KEYS, DECODE_KEYS // 3
    q1, q2 = (torch.randn(B, HQ, 1, D, generator=gen).to(DEVICE, DTYPE) for _ in range(2))
    k, v = (torch.randn(B, HKV, lkv, D, generator=gen).to(DEVICE, DTYPE) for _ in range(2))
    kp, vp, kc, vc = k.clone(), v.clone(), k.clone(), v.clone()
    kp[:, :, pos + 1:] = vp[:, :, pos + 1:] = float("nan")
    kc[:, :, pos + 1:] = vc[:, :, pos + 1:] = 0
    cp = torch.tensor([pos], device=DEVICE)
    settings = SpanSettings(SW_INDEX, 3, 3.0, 1.0, 0.55, POWER)
    failures = []
    for masked in (False, True):
        mask = None
        if masked:
            mask = torch.zeros(B, lkv, dtype=torch.bool, device=DEVICE)
            mask[:, : pos + 1] = True
        problem = Problem.for_decode(q2, k, 3, masked, SW_INDEX, POWER.label, (3.0, 1.0, 0.55))
        for variant in variants(STAGED_DECODE, problem):
            config = variant.default(problem)
            got = variant.launch(q1, q2, kp, vp, cp, mask, settings, config)
            want = variant.launch(q1, q2, kc, vc, cp, mask, settings, config)
            if got.isnan().any() or not torch.equal(got, want):
                failures.append(f"{variant.qualified_name} (mask={masked}): the NaN tail reached the output")
            q1n = q1.clone()
            q1n[0, 0, 0, 0] = float("nan")
            if not variant.launch(q1n, q2, k, v, cp, mask, settings, config)[0, 0].isnan().any():
                failures.append(f"{variant.qualified_name} (mask={masked}): NaN in Q1 was hidden")
    return failures


def check_layer_nan(seed: int) -> list[str]:
    """The whole layer, forward and backward: NaN in the unused tail and a masked hole of K/V
    changes no output and no gradient; NaN in one query's Q1 shows in that row only."""
    q, k, v, _, _, cp, mask, _ = span_inputs(seed)
    q, k, v = q.to(DTYPE), k.to(DTYPE), v.to(DTYPE)
    q1 = torch.randn_like(q)
    kp, vp = poisoned(k, v)
    kc, vc = k.clone(), v.clone()
    for t in (kc, vc):
        t[:, :, TAIL:] = 0
        t[:, :, list(HOLE)] = 0
    grad = torch.randn_like(q)
    args = dict(sw_index=SW_INDEX, topk=3, backward_factor=3.0, forward_factor=1.0, span_power=0.55)

    def run(q1_, k_, v_):
        leaves = [t.detach().clone().requires_grad_() for t in (q1_, q, k_, v_)]
        out = superlinear_attention(*leaves, cp, mask, **args)
        return (out, *torch.autograd.grad(out, leaves, grad))

    got, want = run(q1, kp, vp), run(q1, kc, vc)
    failures = []
    if any(a[..., :TAIL, :].isnan().any() if a.shape[2] == LKV else a.isnan().any() for a in got):
        failures.append("layer: unattended NaN reached the output or a gradient")
    elif not all(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2) for a, b in zip(got, want)):
        failures.append("layer: unattended NaN changed the output or a gradient")
    q1n = q1.clone()
    q1n[0, 0, 5, 0] = float("nan")
    out = superlinear_attention(q1n, q, k, v, cp, mask, **args)
    others = torch.ones_like(out, dtype=torch.bool)
    others[0, 0, 5] = False
    if not out[0, 0, 5].isnan().any() or out[others].isnan().any():
        failures.append("layer: NaN in one Q1 row was hidden or leaked into other rows")
    return failures


def bad_inputs() -> int:
    """Run the public ops on bad inputs that reach the kernels (past the cache, the keys or the sizes); returns how many ran."""
    q, k, v, start, end, cp, mask, window = span_inputs(3)
    q, k, v = q.to(DTYPE), k.to(DTYPE), v.to(DTYPE)
    ran = 0
    span_cases = {
        "spans past the keys": (start, end + LKV),
        "negative span starts": (start - 1000, end),
        "positions past the cache": (start, end),
    }
    for name, (qs, qe) in span_cases.items():
        positions = cp + LKV if name == "positions past the cache" else cp
        out = fused_span_attention_gqa(q.requires_grad_(), k, v, qs, qe, positions, mask, SW_INDEX, inv_search_power_int=2)
        out.float().sum().backward()
        q = q.detach()
        assert not out.isnan().any(), name
        ran += 1
    q1 = torch.randn(B, HQ, 1, D, device=DEVICE, dtype=DTYPE)
    decode_cases = {
        "topk 1000": dict(topk=1000),
        "backward factor 1e6": dict(backward_factor=1e6),
        "forward factor 1e6": dict(forward_factor=1e6),
        "sw_index 10**4": dict(sw_index=10**4),
        "position past the cache": dict(position=LKV + 77),
    }
    for name, change in decode_cases.items():
        settings = dict(sw_index=SW_INDEX, topk=3, backward_factor=3.0, forward_factor=1.0, span_power=0.55)
        position = change.pop("position", 400)
        settings.update(change)
        out = decode_span_attention_staged_gqa(q1, q1, k, v, torch.tensor([position], device=DEVICE), mask,
                                               inv_search_power_int=2, search_power=None, **settings)
        assert not out.isnan().any(), name
        ran += 1
    layer_cases = {
        "topk 1000": dict(topk=1000),
        "backward factor 1e6": dict(backward_factor=1e6),
        "forward factor 1e6": dict(forward_factor=1e6),
        "sw_index 10**4": dict(sw_index=10**4),
        "positions past the cache": dict(shift=LKV),
        "negative positions": dict(shift=-FIRST_POS - LQ),
    }
    for name, change in layer_cases.items():
        settings = dict(sw_index=SW_INDEX, topk=3, backward_factor=3.0, forward_factor=1.0, span_power=0.55)
        positions = cp + change.pop("shift", 0)
        settings.update(change)
        leaves = [t.detach().clone().requires_grad_() for t in (q, q, k, v)]
        out = superlinear_attention(*leaves, positions, mask, inv_search_power_int=2, **settings)
        out.float().sum().backward()
        assert not out.isnan().any(), name
        ran += 1
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    return ran


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("nan", "bad-inputs"), required=True)
    args = parser.parse_args()
    if args.part == "bad-inputs":
        print(f"bad-input cases run: {bad_inputs()} (device {DEVICE})")
        return 0
    failures = check_span_nan(1) + check_decode_nan(2) + check_layer_nan(4)
    checked = len(variants(SPAN_FORWARD, Problem.for_span(SPAN_FORWARD, *span_inputs(0)[:2], 3, True, SW_INDEX, POWER.label)))
    print(f"NaN cases on {DEVICE}: {checked} forward variants x every backward, every decode variant, the whole layer; failures: {len(failures)}")
    for failure in failures:
        print("  FAIL", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
