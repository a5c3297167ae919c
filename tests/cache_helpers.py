"""Tuned entries for the cache tests, valid on the machine running them unless changed."""

from __future__ import annotations

import dataclasses

from superlinear_ops.buckets import ProblemKey
from superlinear_ops.cache.entry import Provenance, TunedEntry
from superlinear_ops.cache.provenance import kernel_hash, triton_version
from superlinear_ops.launch import KernelConfig


def make_key(index: int = 0, **changes) -> ProblemKey:
    """A span-forward key on the CPU interpreter; ``index`` varies the key count."""
    base = ProblemKey(
        op="span_forward", dtype="float32", head_dim=16, q_heads=4, kv_heads=2, spans=2, queries=4,
        keys=64 << (index % 20), batch=1 + index // 20, masked=False, sw_index=2, power="int2", factors=(),
        device="cpu", arch="interpreter",
    )
    return base._replace(**changes)


def make_entry(index: int = 0, *, key: ProblemKey | None = None, **changes) -> TunedEntry:
    """An entry for ``make_key(index)`` with provenance matching this machine's code and Triton."""
    key = key or make_key(index)
    variant = changes.pop("variant", "per_query_span")
    provenance = Provenance(
        package_version="0.1.0", kernel_hash=kernel_hash(key.op, variant), triton_version=triton_version(),
        torch_version="2.13.0", cuda_version="none", gpu_name=key.device, compute_capability=key.arch,
        driver="none", host="test", created_at="2026-11-30T00:00:00+00:00", interpreter=key.arch == "interpreter",
    )
    provenance = dataclasses.replace(provenance, **changes.pop("provenance", {}))
    entry = TunedEntry(
        key=key, variant=variant, config=KernelConfig(block_k=32, num_warps=2, num_stages=3),
        median_ms=1.0 + index / 1000, default_ms=2.5, max_error=1.5e-6, sampler="tpe", trials=40, seed=index,
        provenance=provenance,
    )
    return dataclasses.replace(entry, **changes)


def write_entries(url: str, worker: int, count: int) -> int:
    """Worker process body: open the store and put ``count`` entries of its own, one per transaction."""
    from superlinear_ops.cache.store import Store

    with Store.writer(url) as store:
        for i in range(count):
            key = make_key(i, sw_index=1000 + worker)
            assert store.put(make_entry(i, key=key))
    return count
