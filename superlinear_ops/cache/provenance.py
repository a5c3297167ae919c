"""The measuring environment: versions, GPU, host and the kernel-source hash of each variant."""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import socket

import torch

from ..problem import DeviceIdentity
from ..registry import REGISTRY
from ..version import __version__


def kernel_hash(op: str, variant: str) -> str:
    """The hash of the code ``op/variant`` runs (``code_hash``): what an entry's validity follows."""
    return REGISTRY.get(op, variant).code_hash


@functools.lru_cache(maxsize=None)
def triton_version() -> str:
    """Installed Triton version ('none' when Triton is missing)."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def major_minor(version: str) -> str:
    """'3.6' of '3.6.0'."""
    return ".".join(version.split(".")[:2])


def package_version() -> str:
    """This package's version."""
    return __version__


def _driver() -> str:
    if not torch.cuda.is_available():
        return "none"
    try:
        import pynvml  # nvidia-ml-py, present on CUDA machines

        pynvml.nvmlInit()
        return str(pynvml.nvmlSystemGetDriverVersion())
    except Exception:  # the driver version is informative only
        return "unknown"


def current_provenance(op: str, variant: str, device: DeviceIdentity):
    """Provenance for an entry measured now, here, on ``device``."""
    from .entry import Provenance

    return Provenance(
        package_version=package_version(),
        kernel_hash=kernel_hash(op, variant),
        triton_version=triton_version(),
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda or "none",
        gpu_name=device.name,
        compute_capability=device.arch,
        driver=_driver(),
        host=socket.gethostname(),
        created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        interpreter=device.interpreter,
    )
