"""A variant added in one file (``toy_gate_variant``, a plugin named in SUPERLINEAR_OPS_PLUGINS) is
listed, explained, tuned, verified and swept for memory errors by the same code as the library's own,
in this process and in the worker and sanitizer processes it starts."""

from __future__ import annotations

import importlib
import os
import pathlib

import pytest
import torch

import superlinear_ops
from superlinear_ops import dispatch
from superlinear_ops.cli import main
from superlinear_ops.ops import register_plugin
from superlinear_ops.problem import GATE
from superlinear_ops.registry import REGISTRY
from superlinear_ops.tuner.sanitize import sanitize
from superlinear_ops.tuner.search import SearchSettings
from superlinear_ops.tuner.tune import tune

HERE = pathlib.Path(__file__).resolve().parent
CPU = torch.device("cpu")
WORKLOAD = """\
name: toy
model: {batch: 1, q_heads: 2, kv_heads: 1, head_dim: 16, dtype: float32}
span: {sw_index: 3, inv_search_power_int: 2, span_power: 0.5, backward_factor: 2.0, forward_factor: 1.0, topk: 2}
problems:
  - op: {name: gate, queries: 8, keys: 32}
"""
PROBLEM_FLAGS = ["--op", GATE, "--queries", "8", "--keys", "32", "--q-heads", "2", "--kv-heads", "1", "--head-dim", "16",
                 "--dtype", "float32", "--spans", "2", "--sw-index", "0", "--inv-search-power-int", "2", "--device", "cpu"]


@pytest.fixture
def plugin(monkeypatch):
    """The plugin registered here and named for every process this test starts."""
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("SUPERLINEAR_OPS_PLUGINS", "toy_gate_variant")
    register_plugin(REGISTRY, importlib.import_module("toy_gate_variant"))
    yield
    REGISTRY.unregister(GATE, "toy_row_chunks")
    superlinear_ops.use_cache()
    dispatch.DISPATCHER.clear()


def test_a_variant_in_one_file_is_listed_explained_tuned_verified_and_swept(tmp_path, capsys, plugin) -> None:
    workload, cache = tmp_path / "toy.yaml", tmp_path / "cache.sqlite"
    workload.write_text(WORKLOAD)

    assert main(["variants", "--op", GATE]) == 0
    assert "gate/toy_row_chunks" in capsys.readouterr().out

    results = tune(str(workload), settings=SearchSettings(trials=6, seed=0), storage=str(tmp_path / "s.sqlite"),
                   cache=str(cache), device=CPU, progress=False)
    assert [r.variant for r in results] == ["toy_row_chunks"], results  # PyTorch beats the interpreted kernel

    # Checked against the reference; the timing margin is left wide: CPU timings under a loaded test run are noise.
    assert main(["verify", str(workload), "--cache", str(cache), "--device", "cpu", "--require-all", "--threshold", "10"]) == 0
    capsys.readouterr()
    superlinear_ops.use_cache(cache)
    assert main(["explain", *PROBLEM_FLAGS]) == 0
    explained = capsys.readouterr().out
    assert "toy_row_chunks: applies" in explained and "choice: gate/toy_row_chunks rows=" in explained

    rows = sanitize(str(workload), "cpu", progress_bar=False)
    toy = [r for r in rows if r.variant == "gate/toy_row_chunks"]
    assert sorted(r.config for r in toy) == ["rows=1", "rows=16", "rows=4"] and all(r.clean for r in toy), toy
