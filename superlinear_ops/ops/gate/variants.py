"""The gate ops' variants: for each of the four gate ops (scores, gate, and their backwards) the
Triton ``row_blocks`` kernel and the PyTorch reference, with its space, checks and default.

Launch signatures: gate_scores ``launch(q1, k, anchors, config) -> scores [B, Hq, Lq, topk]``;
gate_scores_backward ``launch(q1, k, anchors, grad, config) -> (dQ1, dK)``; gate ``launch(scores,
span_out, dtype, config) -> out [B, Hq, Lq, D]``; gate_backward ``launch(scores, span_out, grad,
config) -> (d scores, d span_out)``.
"""

from __future__ import annotations

from functools import partial

from ...buckets import next_power_of_two
from ...launch import KernelConfig
from ...problem import GATE, GATE_BACKWARD, GATE_SCORES, GATE_SCORES_BACKWARD, Problem
from ...registry import Param, Variant
from ..rules import MAX_VALUES_PER_THREAD, always_applies, no_check, reference_default, triton_reasons
from . import launchers

GATE_SPACE = (Param("block_r", (8, 16, 32, 64)), Param("num_warps", (1, 2, 4, 8)))  # (b, h, q) rows per program
# Per gate op: its launchers (Triton, PyTorch) and the fp32 [block_r, D] tiles one program holds at once.
GATE_STEPS = {
    GATE_SCORES: (launchers.triton_gate_scores, launchers.torch_gate_scores, 2),  # Q1, key rows
    GATE_SCORES_BACKWARD: (launchers.triton_gate_scores_backward, launchers.torch_gate_scores_backward, 3),  # + dQ1
    GATE: (launchers.triton_gate, launchers.torch_gate, 2),  # accumulator, span output
    GATE_BACKWARD: (launchers.triton_gate_backward, launchers.torch_gate_backward, 3),  # dOut, span output, dO_j
}


def gate_default(problem: Problem) -> KernelConfig:
    """The gate kernels' default: 16 rows per program, 4 warps."""
    return KernelConfig(block_r=16, num_warps=4)


def rows_check(tiles: int, problem: Problem, config: KernelConfig) -> str | None:
    """Why a gate configuration cannot run well: registers (GPU only), ``tiles`` fp32 [block_r, D] tiles."""
    if not problem.device.is_gpu:
        return None
    per_thread = tiles * config.block_r * next_power_of_two(problem.head_dim) / (32 * config.num_warps)
    if per_thread > MAX_VALUES_PER_THREAD:
        return f"registers: about {per_thread:.0f} fp32 values per thread on {config.num_warps} warps (limit {MAX_VALUES_PER_THREAD})"
    return None


def _gate_variants(op: str) -> tuple[Variant, Variant]:
    """``op``'s Triton row-block variant and its PyTorch reference."""
    triton_launch, torch_launch, tiles = GATE_STEPS[op]
    return (
        Variant(op=op, name="row_blocks", launch=triton_launch, space=GATE_SPACE, reasons=triton_reasons,
                compile_check=partial(rows_check, tiles), default=gate_default, priority=0,
                description="Triton: block_r (b, h, q) rows per program, every slot of a row in registers, fp32"),
        Variant(op=op, name="reference", launch=torch_launch, space=(), reasons=always_applies, compile_check=no_check,
                default=reference_default, priority=100, description="PyTorch (gathers and reductions); CPU, float64 and fallback"),
    )


VARIANTS: tuple[Variant, ...] = tuple(variant for op in GATE_STEPS for variant in _gate_variants(op))
