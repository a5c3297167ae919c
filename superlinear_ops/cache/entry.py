"""A tuned entry: the winner for one problem key, how it was found, and where it was measured; and a
failure record: a candidate that failed on a key, why, and with what code."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from ..buckets import ProblemKey
from ..launch import KernelConfig
from ..registry import REGISTRY


@dataclass(frozen=True)
class Provenance:
    """Where and with what an entry was measured."""

    package_version: str
    kernel_hash: str  # hash of the code the variant runs (code_hash: comments and docstrings excluded)
    triton_version: str
    torch_version: str
    cuda_version: str
    gpu_name: str
    compute_capability: str  # 'sm_90', or 'interpreter' / 'reference' on the CPU
    driver: str
    host: str
    created_at: str  # ISO 8601, UTC
    interpreter: bool  # measured under Triton's CPU interpreter


@dataclass(frozen=True)
class TunedEntry:
    """The chosen variant and configuration for one key, with its measurements."""

    key: ProblemKey
    variant: str
    config: KernelConfig
    median_ms: float  # the winner's median time
    default_ms: float  # the heuristic default's median time on the same inputs (inf: it failed)
    max_error: float  # the winner's max |error| against the reference
    sampler: str
    trials: int
    seed: int
    provenance: Provenance

    def __post_init__(self) -> None:
        if self.key.op not in REGISTRY.ops:
            raise ValueError(f"key.op must be one of {REGISTRY.ops}, got {self.key.op!r}")
        if not (math.isfinite(self.median_ms) and self.median_ms > 0):
            raise ValueError(f"timing.median_ms must be a finite time > 0, got {self.median_ms!r}")
        if not self.default_ms > 0:  # inf: the default failed
            raise ValueError(f"timing.default_ms must be > 0 (inf when the default failed), got {self.default_ms!r}")
        if not (self.max_error >= 0 or math.isnan(self.max_error)):
            raise ValueError(f"timing.max_error must be >= 0, got {self.max_error!r}")
        if self.trials < 1:
            raise ValueError(f"search.trials must be >= 1, got {self.trials!r}")

    @property
    def key_text(self) -> str:
        """The key's stable text form (the primary key in stores and files)."""
        return self.key.text()

    def to_dict(self) -> dict:
        """A nested plain mapping in canonical field order (the YAML form)."""
        return {
            "key": {name: (list(value) if name == "factors" else value) for name, value in self.key._asdict().items()},
            "variant": self.variant,
            "config": dict(self.config),
            "timing": {"median_ms": self.median_ms, "default_ms": self.default_ms, "max_error": self.max_error},
            "search": {"sampler": self.sampler, "trials": self.trials, "seed": self.seed},
            "provenance": asdict(self.provenance),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "TunedEntry":
        """Inverse of ``to_dict``; raises ValueError naming what is missing or malformed."""
        try:
            key_data = dict(data["key"])
            key_data["factors"] = tuple(float(f) for f in key_data["factors"])
            missing = set(ProblemKey._fields) - set(key_data)
            if missing:
                raise ValueError(f"key lacks {sorted(missing)}")
            provenance = data["provenance"]
            expected = {f.name for f in fields(Provenance)}
            if set(provenance) != expected:
                raise ValueError(f"provenance must have exactly {sorted(expected)}")
            return cls(
                key=ProblemKey(**{name: key_data[name] for name in ProblemKey._fields}),
                variant=str(data["variant"]),
                config=KernelConfig(data["config"]),
                median_ms=float(data["timing"]["median_ms"]),
                default_ms=float(data["timing"]["default_ms"]),
                max_error=float(data["timing"]["max_error"]),
                sampler=str(data["search"]["sampler"]),
                trials=int(data["search"]["trials"]),
                seed=int(data["search"]["seed"]),
                provenance=Provenance(**provenance),
            )
        except (KeyError, TypeError) as err:
            raise ValueError(f"malformed tuned entry: {err!r}") from err


FAILURE_CATEGORIES = ("compile error", "resource limit", "illegal access / crash", "timeout", "wrong numbers")


@dataclass(frozen=True)
class FailureRecord:
    """A candidate (variant + configuration) that failed on one key; it is not retried while the
    variant's code hash and the Triton version are the ones it failed with."""

    key: ProblemKey
    variant: str
    config: KernelConfig
    category: str  # one of FAILURE_CATEGORIES
    message: str
    kernel_hash: str
    triton_version: str
    package_version: str
    host: str
    created_at: str  # ISO 8601, UTC

    def __post_init__(self) -> None:
        if self.category not in FAILURE_CATEGORIES:
            raise ValueError(f"category must be one of {FAILURE_CATEGORIES}, got {self.category!r}")
        if self.key.op not in REGISTRY.ops:
            raise ValueError(f"key.op must be one of {REGISTRY.ops}, got {self.key.op!r}")

    @property
    def key_text(self) -> str:
        """The key's stable text form."""
        return self.key.text()
