"""When a stored entry may serve here: same GPU architecture, kernel source and Triton major.minor,
and never an interpreter timing on a GPU. Stale entries (code changed) serve nowhere: prune them."""

from __future__ import annotations

from ..buckets import ProblemKey
from ..registry import REGISTRY
from .entry import FailureRecord, TunedEntry
from .provenance import kernel_hash, major_minor, triton_version


def why_stale(entry: TunedEntry) -> str | None:
    """Why no machine can use ``entry`` with this version of the package (None when some can)."""
    op = entry.key.op
    try:
        variant = REGISTRY.get(op, entry.variant)
    except (KeyError, ValueError):  # unknown variant, or unknown op
        return f"variant {op}/{entry.variant} is not registered in this version"
    current = kernel_hash(op, entry.variant)
    if entry.provenance.kernel_hash != current:
        return f"kernel source changed (entry {entry.provenance.kernel_hash}, code {current})"
    outside = variant.violation(entry.config)
    if outside is not None:
        return f"configuration {entry.config.text()} is outside the variant's declared space: {outside}"
    return None


def why_unusable(entry: TunedEntry, wanted: ProblemKey | None = None) -> str | None:
    """Why ``entry`` cannot serve on this machine (None when it can).

    ``wanted`` is the key being looked up (its device arch is the GPU's here).
    """
    key = entry.key
    prov = entry.provenance
    arch = wanted.arch if wanted is not None else key.arch
    if prov.compute_capability != arch:
        return f"measured on {prov.compute_capability}, this device is {arch}"
    if prov.interpreter and arch.startswith("sm_"):
        return "measured under Triton's CPU interpreter; never used on a GPU"
    stale = why_stale(entry)
    if stale is not None:
        return stale
    if major_minor(prov.triton_version) != major_minor(triton_version()):
        return f"measured with Triton {prov.triton_version}, installed {triton_version()}"
    return None


def failure_is_current(record: FailureRecord) -> bool:
    """True while ``record`` holds: its variant exists with the code and Triton it failed with."""
    try:
        return (record.kernel_hash, record.triton_version) == (kernel_hash(record.key.op, record.variant), triton_version())
    except (KeyError, ValueError):
        return False
