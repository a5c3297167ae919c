"""Registry consistency: spaces, defaults, static checks and reasons."""

from __future__ import annotations

from itertools import product

import pytest
from helpers import H200, problem

from superlinear_ops.launch import KernelConfig
from superlinear_ops.problem import OPS, DeviceIdentity
from superlinear_ops.registry import REGISTRY, Registry, Variant

GPUS = [H200, DeviceIdentity("NVIDIA A100", "sm_80", 108), DeviceIdentity("NVIDIA L4", "sm_89", 58)]
CPU_INTERPRETER = DeviceIdentity("cpu", "interpreter", 0)
CPU = DeviceIdentity("cpu", "reference", 0)


def sample_problems():
    for op, device, dim, dtype, (hq, hkv), spans in product(
        OPS, GPUS + [CPU_INTERPRETER, CPU], (64, 96, 128, 256), ("bfloat16", "float32", "float64"),
        ((32, 2), (8, 8)), (1, 3),
    ):
        yield problem(op=op, device=device, head_dim=dim, dtype=dtype, q_heads=hq, kv_heads=hkv, spans=spans,
                      queries=1 if op == "staged_decode" else 4096, keys=65536,
                      factors=(3.0, 1.0, 0.55) if op == "staged_decode" else ())


def test_every_op_has_variants_and_a_fallback_last() -> None:
    for op in OPS:
        variants = REGISTRY.variants(op)
        assert len(variants) >= 2
        assert variants[-1].space == () and "reference" in variants[-1].name


def test_defaults_lie_in_their_space_and_pass_their_check() -> None:
    for p in sample_problems():
        for variant in REGISTRY.variants(p.op):
            if variant.not_supported_reasons(p):
                continue
            default = variant.default(p)
            if variant.space:
                assert variant.contains(default), (variant.qualified_name, default)
            assert variant.compile_check(p, default) is None, (variant.qualified_name, p, default)


def test_static_check_rejects_configurations_that_cannot_build() -> None:
    forward = REGISTRY.get("span_forward", "per_query_span")
    p = problem(device=H200, head_dim=256)
    assert "registers" in forward.compile_check(p, KernelConfig(block_k=256, num_warps=1, num_stages=1))
    l4 = problem(device=GPUS[2], dtype="float32", head_dim=256)
    assert "shared memory" in forward.compile_check(l4, KernelConfig(block_k=128, num_warps=8, num_stages=4))
    accepted = [c for c in forward.configs() if forward.compile_check(p, c) is None]
    assert 0 < len(accepted) < len(list(forward.configs()))
    assert forward.compile_check(p._replace(device=CPU_INTERPRETER), KernelConfig(block_k=256, num_warps=1, num_stages=1)) is None


def test_unrunnable_lists_the_configurations_an_arch_cannot_run_with_their_reasons() -> None:
    forward = REGISTRY.get("span_forward", "per_query_span")
    l4 = problem(device=GPUS[2], dtype="float32", head_dim=256)
    bad = forward.unrunnable(l4)
    assert bad and all(forward.compile_check(l4, c) == reason for c, reason in bad)
    assert {c for c, _ in bad} == {c for c in forward.configs() if forward.compile_check(l4, c) is not None}
    assert any("on sm_89" in reason for _, reason in bad)
    assert forward.unrunnable(l4._replace(device=CPU_INTERPRETER)) == []


def test_reasons_are_given_whenever_a_variant_does_not_apply() -> None:
    triton = [v for op in OPS for v in REGISTRY.variants(op) if v.space]
    for p in sample_problems():
        for variant in REGISTRY.variants(p.op):
            reasons = variant.not_supported_reasons(p)
            assert all(isinstance(r, str) and r.strip() for r in reasons)
            expected_out = variant in triton and (p.dtype == "float64" or p.device == CPU)
            if expected_out:
                assert reasons, (variant.qualified_name, p)
    fused = REGISTRY.get("span_backward", "fused_split")
    assert any("K = 1" in r for r in fused.not_supported_reasons(problem(op="span_backward", spans=1)))
    assert any("rep = 1" in r for r in fused.not_supported_reasons(problem(op="span_backward", q_heads=8, kv_heads=8)))
    assert "serves op" in fused.not_supported_reasons(problem(op="span_forward"))[0]


def test_variant_names_and_registration_rules() -> None:
    registry = Registry()
    variant = REGISTRY.get("span_forward", "reference")
    with pytest.raises(ValueError, match="unknown op 'span_forward'"):
        registry.register(variant)  # an op is declared by its spec before its variants
    registry.add_op(REGISTRY.spec("span_forward"))
    with pytest.raises(ValueError, match="already declared"):
        registry.add_op(REGISTRY.spec("span_forward"))
    registry.register(variant)
    with pytest.raises(ValueError, match="already registered"):
        registry.register(variant)
    with pytest.raises(ValueError, match="unknown op"):
        registry.register(Variant(**{**variant.__dict__, "op": "nope"}))
    with pytest.raises(KeyError, match="span_forward has: reference"):
        registry.get("span_forward", "missing")


# Shared memory of decode kernels compiled for sm_90 (exp tool: triton.compile of the launch as a GPU
# specialises it; the H100's OutOfResources messages gave the same bytes): model M, 4K, bf16.
SM90_DECODE_SHARED = [  # (variant, masked, block_k, num_stages, compiled bytes): limit 232,448
    ("grouped", True, 64, 8, 235640), ("grouped", True, 64, 7, 202848), ("grouped", False, 128, 4, 204856),
    ("stripe_spans", True, 64, 8, 235640), ("stripe_spans", True, 16, 8, 62072),
    ("stripe_spans", False, 16, 8, 235520), ("stripe_spans", False, 32, 6, 169984),  # unmasked: 64-key window blocks
    ("group_spans", True, 64, 8, 278528), ("group_spans", True, 128, 4, 278656), ("group_spans", True, 256, 2, 278784),
    ("group_spans", True, 64, 6, 212992), ("group_spans", True, 128, 3, 213120),
]


@pytest.mark.parametrize(("name", "masked", "block_k", "stages", "compiled"), SM90_DECODE_SHARED)
def test_decode_shared_memory_estimates_follow_sm90_compiles(name, masked, block_k, stages, compiled) -> None:
    """The decode variants' static check rejects exactly the configurations whose compiled kernel
    needs more shared memory than sm_90 has (the sanitize sweep met them as OutOfResources), on 8
    warps so that no register rule decides first."""
    p = problem(op="staged_decode", device=H200, head_dim=128, dtype="bfloat16", q_heads=32, kv_heads=2, spans=3,
                queries=1, keys=4096, factors=(3.0, 1.0, 0.55))._replace(masked=masked)
    reason = REGISTRY.get("staged_decode", name).compile_check(p, KernelConfig(block_k=block_k, num_warps=8, num_stages=stages, chunk=256))
    if compiled > 232448:
        assert reason is not None and "shared memory" in reason, reason
    else:
        assert reason is None, reason
