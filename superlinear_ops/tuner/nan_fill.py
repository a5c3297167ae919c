"""NaN-prefilled outputs for the candidate checks: while ``nan_prefilled()`` is active, every floating
tensor a launcher allocates uninitialised (``torch.empty`` and its relatives) starts as NaN, so an
output element (or scratch value) the kernel never writes, or reads before writing, shows as NaN
instead of passing by luck on memory that happened to hold the right numbers."""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

UNINITIALISED = {
    torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty, torch.Tensor.new_empty_strided,
}


class NaNPrefill(TorchFunctionMode):
    """Fills the floating results of ``UNINITIALISED`` allocations with NaN (counted in ``filled``)."""

    def __init__(self) -> None:
        super().__init__()
        self.filled = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in UNINITIALISED and isinstance(result, torch.Tensor) and result.is_floating_point():
            result.fill_(float("nan"))
            self.filled += 1
        return result


@contextlib.contextmanager
def nan_prefilled():
    """Run the block with ``NaNPrefill`` active; yields the mode (its ``filled`` count)."""
    with NaNPrefill() as mode:
        yield mode
