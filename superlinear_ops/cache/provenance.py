"""The measuring environment: versions, GPU, host and the kernel-source hash of each variant."""

from __future__ import annotations

import datetime
import functools
import hashlib
import importlib.metadata
import pathlib
import socket

import torch

from ..problem import DeviceIdentity
from ..registry import REGISTRY

PACKAGE_ROOT = pathlib.Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=None)
def kernel_hash(op: str, variant: str) -> str:
    """sha256 (16 hex digits) of the source files a variant declares; changes when its code does."""
    digest = hashlib.sha256()
    for name in REGISTRY.get(op, variant).source_files:
        digest.update(name.encode())
        digest.update((PACKAGE_ROOT / name).read_bytes())
    return digest.hexdigest()[:16]


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
    from .. import __version__

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
