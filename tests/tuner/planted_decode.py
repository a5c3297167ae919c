"""A staged-decode variant whose configuration names a fault to plant, for the tuner's fault tests:
its space, registration and the correct decode its launches fall back to."""

from __future__ import annotations

from superlinear_ops.launch import KernelConfig
from superlinear_ops.ops.rules import no_check, triton_reasons
from superlinear_ops.ops.span_attention.variants import triton_forward
from superlinear_ops.ops.staged_decode.variants import staged_decode_with
from superlinear_ops.problem import STAGED_DECODE
from superlinear_ops.registry import REGISTRY, Param, Variant

_decode = staged_decode_with(triton_forward)


def correct_decode(q1, q2, k, v, cache_position, mask, settings, config):
    """The staged decode at ``config``'s block_k (4 warps, 2 stages): what a planted launch returns without a fault."""
    return _decode(q1, q2, k, v, cache_position, mask, settings,
                   KernelConfig(block_k=config["block_k"], num_warps=4, num_stages=2))


def planted_decode_variant(name: str, launch, faults: tuple[int, ...]) -> Variant:
    """A staged-decode variant tuned over block_k (16, 32) and ``faults`` (the first: no fault, the default)."""
    return Variant(
        op=STAGED_DECODE, name=name, launch=launch,
        space=(Param("block_k", (16, 32)), Param("fault", faults), Param("num_warps", (4,)), Param("num_stages", (2,))),
        reasons=triton_reasons, compile_check=no_check,
        default=lambda problem: KernelConfig(block_k=16, fault=faults[0], num_warps=4, num_stages=2), priority=-1,
    )


def register_once(variant: Variant) -> None:
    """Register ``variant`` unless a variant of its name is registered already (workers call this at setup)."""
    if variant.name not in {v.name for v in REGISTRY.variants(variant.op)}:
        REGISTRY.register(variant)
