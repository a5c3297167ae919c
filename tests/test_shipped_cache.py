"""The tuned caches shipped in the package: they load, follow the schema, and cover their workload."""

from __future__ import annotations

import pathlib

from superlinear_ops.buckets import key_of
from superlinear_ops.cache import yaml_file
from superlinear_ops.cache.layers import shipped_files
from superlinear_ops.problem import DeviceIdentity
from superlinear_ops.registry import REGISTRY
from superlinear_ops.tuner.workload import load

ROOT = pathlib.Path(__file__).resolve().parent.parent
H200 = DeviceIdentity("NVIDIA H200", "sm_90", 132)


def test_h200_cache_is_shipped_and_canonical() -> None:
    files = {p.name: p for p in shipped_files()}
    assert "nvidia-h200.yaml" in files
    path = files["nvidia-h200.yaml"]
    entries = yaml_file.read(path)  # schema: every field present and typed
    assert entries and path.read_text() == yaml_file.dumps(entries)  # canonical form, as exported
    for entry in entries:
        variant = REGISTRY.get(entry.key.op, entry.variant)
        assert variant.contains(entry.config)
        assert variant.compile_check(key_problem(entry.key), entry.config) is None
        p = entry.provenance
        assert (p.gpu_name, p.compute_capability, p.interpreter) == ("NVIDIA H200", "sm_90", False)
        assert 0 < entry.median_ms <= entry.default_ms * 1.05 and entry.max_error < 0.2


def key_problem(key):
    """A problem in the key's bucket (for the static check, which reads only exact fields)."""
    from superlinear_ops.problem import Problem

    return Problem(key.op, key.dtype, key.head_dim, key.q_heads, key.kv_heads, key.spans, key.queries, key.keys,
                   key.batch, key.masked, key.sw_index, key.power, H200, key.factors)


def test_h200_cache_covers_every_model_m_problem() -> None:
    shipped = {e.key for p in shipped_files() for e in yaml_file.read(p)}
    workload = load(ROOT / "tuning" / "superlinear-exp-v0.1.yaml")
    missing = [c.label for c in workload.cases(H200) if key_of(c.problem) not in shipped]
    assert missing == []


def test_dispatcher_serves_every_model_m_problem_from_the_shipped_file_on_an_h200() -> None:
    """What `superlinear-ops explain --workload ...` reports on an H200 with a clean user cache."""
    import pytest

    from superlinear_ops.cache.layers import YamlLayer
    from superlinear_ops.cache.provenance import major_minor, triton_version
    from superlinear_ops.dispatch import Dispatcher

    entries = yaml_file.read(ROOT / "cache" / "nvidia-h200.yaml")
    if {major_minor(e.provenance.triton_version) for e in entries} != {major_minor(triton_version())}:
        pytest.skip("the shipped entries are valid only with the Triton they were measured with")
    dispatcher = Dispatcher(REGISTRY, [YamlLayer("shipped", shipped_files, "package")])
    for case in load(ROOT / "tuning" / "superlinear-exp-v0.1.yaml").cases(H200):
        explanation = dispatcher.explain(case.problem)
        assert explanation.choice.source == "shipped", (case.label, explanation.text())
