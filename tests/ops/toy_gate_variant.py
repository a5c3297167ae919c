"""A variant added in one file, as a plugin (``SUPERLINEAR_OPS_PLUGINS=toy_gate_variant``): the gate
O = sum_j softmax(v)_j O_j in PyTorch, ``rows`` (b, h, q) rows at a time."""

from __future__ import annotations

import torch

from superlinear_ops.launch import KernelConfig
from superlinear_ops.problem import GATE
from superlinear_ops.registry import Param, Variant


def gate_in_row_chunks(scores: torch.Tensor, span_out: torch.Tensor, dtype: torch.dtype, config: KernelConfig) -> torch.Tensor:
    """The gate over scores [B, Hq, Lq, topk] and span outputs [B, Hq, Lq, topk, D], ``config.rows`` rows at a time."""
    rows = scores.reshape(-1, scores.shape[-1])
    outputs = span_out.reshape(-1, *span_out.shape[-2:])
    pieces = []
    for start in range(0, rows.shape[0], config.rows):
        gate = torch.softmax(rows[start:start + config.rows].to(torch.float32), dim=-1)
        pieces.append((gate[..., None] * outputs[start:start + config.rows].to(torch.float32)).sum(dim=1))
    return torch.cat(pieces).reshape(span_out.shape[:3] + span_out.shape[4:]).to(dtype)


TOY_GATE = Variant(
    op=GATE, name="toy_row_chunks", launch=gate_in_row_chunks, space=(Param("rows", (1, 4, 16)),),
    reasons=lambda problem: [] if problem.dtype != "float64" else ["float64 runs the reference"],
    compile_check=lambda problem, config: None, default=lambda problem: KernelConfig(rows=4), priority=50,
    description="PyTorch: the gate a chunk of rows at a time (a plugin's variant)",
)

VARIANTS = (TOY_GATE,)
