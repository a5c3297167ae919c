"""The tuned caches shipped in the package: they load, follow the schema, and cover their workload."""

from __future__ import annotations

import pathlib

import pytest

from superlinear_ops.buckets import key_of
from superlinear_ops.cache import yaml_file
from superlinear_ops.cache.layers import YamlLayer, shipped_files
from superlinear_ops.cache.provenance import kernel_hash, major_minor, triton_version
from superlinear_ops.dispatch import Dispatcher
from superlinear_ops.problem import DeviceIdentity, Problem
from superlinear_ops.registry import REGISTRY
from superlinear_ops.tuner.workload import load

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKLOAD = ROOT / "tuning" / "superlinear-exp-v0.1.yaml"
H200 = DeviceIdentity("NVIDIA H200", "sm_90", 132)
H100 = DeviceIdentity("NVIDIA H100 80GB HBM3", "sm_90", 132)
H800 = DeviceIdentity("NVIDIA H800", "sm_90", 132)  # an sm_90 GPU with no file of its own


def shipped_by_gpu() -> dict[str, list]:
    """{GPU name: entries} of every shipped file; each file holds one GPU's entries."""
    files = {p.name: yaml_file.read(p) for p in shipped_files()}  # schema: every field present and typed
    by_gpu = {}
    for name, entries in files.items():
        gpus = {e.key.device for e in entries}
        assert len(gpus) == 1, (name, gpus)
        by_gpu[gpus.pop()] = entries
    return by_gpu


def test_shipped_files_are_canonical_current_and_measured_on_their_gpu() -> None:
    files = {p.name: p for p in shipped_files()}
    assert {"nvidia-h200.yaml", "nvidia-h100.yaml"} <= set(files)
    for name, path in files.items():
        entries = yaml_file.read(path)
        assert entries and path.read_text() == yaml_file.dumps(entries)  # canonical form, as exported
        for entry in entries:
            variant = REGISTRY.get(entry.key.op, entry.variant)
            assert variant.contains(entry.config)
            assert variant.compile_check(key_problem(entry.key), entry.config) is None
            p = entry.provenance
            assert (p.gpu_name, p.compute_capability, p.interpreter) == (entry.key.device, "sm_90", False)
            assert all(word in p.gpu_name.lower() for word in path.stem.split("-")), (name, p.gpu_name)
            assert p.kernel_hash == kernel_hash(entry.key.op, entry.variant), (name, entry.key.text())  # not stale
            assert 0 < entry.median_ms <= entry.default_ms * 1.05 and entry.max_error < 0.2


def key_problem(key) -> Problem:
    """A problem in the key's bucket (for the static check, which reads only exact fields)."""
    return Problem(key.op, key.dtype, key.head_dim, key.q_heads, key.kv_heads, key.spans, key.queries, key.keys,
                   key.batch, key.masked, key.sw_index, key.power, DeviceIdentity(key.device, key.arch, 132), key.factors)


def test_shipped_files_cover_every_model_m_problem_on_sm_90() -> None:
    """Each model-M problem has an entry of an H200 or an H100 (the other GPU borrows it)."""
    shipped = {e.key._replace(device="") for entries in shipped_by_gpu().values() for e in entries}
    missing = [c.label for c in load(WORKLOAD).cases(H200) if key_of(c.problem)._replace(device="") not in shipped]
    assert missing == []


@pytest.mark.parametrize("gpu", [H200, H100, H800], ids=["h200", "h100", "h800"])
def test_dispatcher_serves_every_model_m_problem_from_the_shipped_files(gpu: DeviceIdentity) -> None:
    """What `superlinear-ops explain --workload ...` reports on an sm_90 GPU with a clean user cache:
    its own entry where its file has one, else the one another GPU of its architecture shipped."""
    by_gpu = shipped_by_gpu()
    if {major_minor(e.provenance.triton_version) for entries in by_gpu.values() for e in entries} != {major_minor(triton_version())}:
        pytest.skip("the shipped entries are valid only with the Triton they were measured with")
    holders = {}  # key without the GPU -> the GPUs whose file holds it
    for name, entries in by_gpu.items():
        for entry in entries:
            holders.setdefault(entry.key._replace(device=""), set()).add(name)
    dispatcher = Dispatcher(REGISTRY, [YamlLayer("shipped", shipped_files, "package")])
    for case in load(WORKLOAD).cases(gpu):
        explanation = dispatcher.explain(case.problem)
        owners = holders[key_of(case.problem)._replace(device="")]
        expected = {"shipped"} if gpu.name in owners else {f"shipped, borrowed from {owner}" for owner in owners}
        assert explanation.choice.source in expected, (case.label, explanation.text())


@pytest.mark.parametrize("gpu", [H200, H100], ids=["h200", "h100"])
def test_explain_of_the_workload_finds_every_shipped_entry_current(gpu: DeviceIdentity, monkeypatch, capsys) -> None:
    """`superlinear-ops explain --workload` as an H200 or H100 with a clean user cache: every problem is
    served by a shipped entry (its GPU's own or a sibling's), none is stale."""
    from superlinear_ops import cli

    if {major_minor(e.provenance.triton_version) for entries in shipped_by_gpu().values() for e in entries} != {major_minor(triton_version())}:
        pytest.skip("the shipped entries are valid only with the Triton they were measured with")
    monkeypatch.setattr(cli, "_device", lambda args: gpu)
    assert cli.main(["explain", "--workload", str(WORKLOAD)]) == 0
    out = capsys.readouterr().out
    cases = out.count("\n== ") + out.startswith("== ")
    choices = [line for line in out.splitlines() if line.startswith("choice: ")]
    assert cases == len(load(WORKLOAD).cases(gpu)) == len(choices) > 40
    assert all("(source: shipped" in line for line in choices), [c for c in choices if "(source: shipped" not in c]
    assert "kernel source changed" not in out and "stale" not in out
