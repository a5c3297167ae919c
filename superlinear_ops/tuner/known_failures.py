"""The tuner's memory of failed candidates: each failure goes to the store as it happens, and a later
tune skips a candidate the store says failed with the same variant code and Triton version."""

from __future__ import annotations

import datetime
import socket

from ..buckets import ProblemKey
from ..cache.entry import FailureRecord
from ..cache.provenance import kernel_hash, package_version, triton_version
from ..cache.store import Store
from ..cache.validity import failure_is_current
from ..launch import KernelConfig
from .faults import Failure


class FailureLog:
    """Failed candidates of the problems being tuned, read from and written to ``store`` (None: kept
    in memory only)."""

    def __init__(self, store: Store | None) -> None:
        self.store = store

    def known(self, key: ProblemKey) -> dict[tuple[str, str], Failure]:
        """The stored failures of ``key`` that still hold here, by (variant, configuration text)."""
        if self.store is None:
            return {}
        known = {}
        for record in self.store.failures(key.text()):
            if failure_is_current(record):  # same variant code and Triton as when it failed
                message = f"failed before ({record.created_at}), not retried: {record.message}"
                known[(record.variant, record.config.text())] = Failure(record.category, message)
        return known

    def record(self, key: ProblemKey, variant: str, config: KernelConfig, failure: Failure) -> None:
        """Store ``failure`` of ``variant``/``config`` on ``key`` with the code and Triton it ran with."""
        if self.store is None:
            return
        self.store.put_failure(FailureRecord(
            key=key, variant=variant, config=config, category=failure.category, message=failure.message[:2000],
            kernel_hash=kernel_hash(key.op, variant), triton_version=triton_version(),
            package_version=package_version(), host=socket.gethostname(),
            created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        ))
