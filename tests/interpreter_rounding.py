"""Triton's interpreter made to round fp32 to bf16 as the GPU does.

Triton 3.6's interpreter converts fp32 to bf16 by truncation in ``InterpreterBuilder.cast_impl``
(``x.to(tl.bfloat16)`` and a store of fp32 values into bf16 memory), where the GPU rounds to nearest
even. Truncation biases every bf16 result low by up to one unit in the last place, and a kernel that
rounds twice (probabilities before a dot, then its output) drifts about half a percent low: enough
to fail a tight scale check under some seeds, and enough to hide part of a planted error of the
opposite sign. ``round_bf16_to_nearest`` replaces that one conversion with PyTorch's round-to-nearest-
even (NaN, infinities and overflow included); every other conversion is the interpreter's own.
"""

from __future__ import annotations

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter


def _interpreter_truncates() -> bool:
    """Whether the interpreter's fp32 -> bf16 cast truncates (1 + 2**-8 + 2**-9 must round up)."""
    value = interpreter.TensorHandle(np.array([1.0 + 2.0**-8 + 2.0**-9], dtype=np.float32), tl.float32)
    got = interpreter.InterpreterBuilder.cast_impl(None, value, tl.bfloat16).data.view(np.uint16)[0]
    return int(got) != torch.tensor([1.0 + 2.0**-8 + 2.0**-9]).to(torch.bfloat16).view(torch.int16).item()


def round_bf16_to_nearest() -> bool:
    """Patch the interpreter's fp32 -> bf16 cast to round to nearest even, if it truncates; returns
    whether it patched (a later Triton that rounds correctly is left alone)."""
    if not _interpreter_truncates():
        return False
    truncating = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            values = torch.from_numpy(np.array(src.data, dtype=np.float32, ndmin=1))
            bits = values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(np.shape(src.data))
            return interpreter.TensorHandle(bits, dst_type.scalar)
        return truncating(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl
    return True
