"""Which torch device a command runs on (and, without a GPU, Triton's interpreter)."""

from __future__ import annotations

import os

import torch


def select_device(requested: str | None) -> torch.device:
    """The torch device to run on; without a GPU, switch Triton to its interpreter first."""
    if requested is None:
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda was asked for but PyTorch sees no GPU; use --device cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # Must happen before any Triton kernel module is imported.
        os.environ["TRITON_INTERPRET"] = "1"
    return device
