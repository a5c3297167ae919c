"""Ops as specs: an op declared in a test (its spec and one variant, nothing else changed) is tuned,
verified, benched, explained and listed by the same code as the library's own ops; and every
built-in op has its spec."""

from __future__ import annotations

import json

import pytest
import torch

import superlinear_ops
from superlinear_ops import dispatch
from superlinear_ops.cli import main
from superlinear_ops.launch import KernelConfig
from superlinear_ops.ops.spec import DenseCalls, OpSpec
from superlinear_ops.problem import OPS, device_identity
from superlinear_ops.registry import REGISTRY, Param, Variant
from superlinear_ops.tuner.search import SearchSettings
from superlinear_ops.tuner.tune import tune
from superlinear_ops.tuner.workload import load

CPU = torch.device("cpu")
TOY = "toy_double"
WORKLOAD = f"""\
name: toy
model: {{batch: 1, q_heads: 2, kv_heads: 1, head_dim: 16, dtype: float32}}
span: {{sw_index: 3, inv_search_power_int: 2, span_power: 0.5, backward_factor: 2.0, forward_factor: 1.0, topk: 2}}
problems:
  - op: {{name: {TOY}, queries: 8, keys: 32}}
"""
PROBLEM_FLAGS = ["--op", TOY, "--queries", "8", "--keys", "32", "--q-heads", "2", "--kv-heads", "1", "--head-dim", "16",
                 "--dtype", "float32", "--spans", "2", "--sw-index", "3", "--inv-search-power-int", "2", "--device", "cpu"]


class ToyDouble(OpSpec):
    """2 Q, in chunks of query rows: an op with no dense counterpart and no parts."""

    name = TOY

    def run(self, variant, config, problem, x, parts):
        return (variant.launch(x.q, config),)

    def traffic(self, case, timed):
        p = case.problem
        return 2.0 * p.batch * p.q_heads * p.queries * p.head_dim * p.torch_dtype.itemsize, 0.0

    def dense(self, case, x):
        return DenseCalls("no dense counterpart", ())

    def warmup(self, problem, device, public):
        variant = REGISTRY.reference(TOY)
        variant.launch(torch.zeros(problem.batch, problem.q_heads, problem.queries, problem.head_dim), variant.default(problem))


def double_in_chunks(q: torch.Tensor, config: KernelConfig) -> torch.Tensor:
    return torch.cat([rows * 2 for rows in q.split(config["chunk"], dim=2)], dim=2)


TOY_VARIANT = Variant(
    op=TOY, name="chunked", launch=double_in_chunks, space=(Param("chunk", (1, 2, 4)),), reasons=lambda p: [],
    compile_check=lambda p, c: None, default=lambda p: KernelConfig(chunk=1), priority=0,
    description="2 Q, a chunk of query rows at a time",
)


def register_toy() -> None:
    """Declare the toy op and its variant (also the worker process's setup)."""
    if TOY not in REGISTRY.ops:
        REGISTRY.add_op(ToyDouble())
        REGISTRY.register(TOY_VARIANT)


@pytest.fixture
def toy_op():
    register_toy()
    yield
    REGISTRY.remove_op(TOY)
    superlinear_ops.use_cache()
    dispatch.DISPATCHER.clear()


def test_a_new_op_is_tuned_verified_benched_explained_and_listed_through_its_spec(tmp_path, capsys, toy_op) -> None:
    workload, cache = tmp_path / "toy.yaml", tmp_path / "cache.sqlite"
    workload.write_text(WORKLOAD)
    results = tune(str(workload), settings=SearchSettings(trials=3, seed=0), storage=str(tmp_path / "s.sqlite"),
                   cache=str(cache), device=CPU, progress=False, worker_setup=register_toy)
    assert [(r.label, r.variant) for r in results] == [(f"{TOY} 8 over 32", "chunked")]
    assert 0 < results[0].best_ms < float("inf")

    assert main(["verify", str(workload), "--cache", str(cache), "--device", "cpu", "--threshold", "10", "--require-all"]) == 0
    assert f"{TOY} 8 over 32" in capsys.readouterr().out
    out = tmp_path / "bench.json"
    assert main(["bench", str(workload), "--cache", str(cache), "--device", "cpu", "-o", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["op"] == TOY and row["tuned_source"] == "explicit" and row["tuned_choice"].startswith("chunked chunk=")
    assert row["sdpa_kind"].startswith("no dense counterpart") and row["lower_bound_ms"] != 0

    superlinear_ops.use_cache(cache)
    capsys.readouterr()
    assert main(["explain", *PROBLEM_FLAGS]) == 0
    explained = capsys.readouterr().out
    assert "chunked" in explained and "explicit" in explained
    assert main(["variants", "--op", TOY]) == 0
    assert f"{TOY}/chunked" in capsys.readouterr().out
    problem = load(workload).cases(device_identity(CPU))[0].problem
    assert superlinear_ops.warmup([problem], "cpu") == 1


def test_unknown_ops_are_refused_by_name(capsys) -> None:
    assert main(["explain", *PROBLEM_FLAGS]) == 2
    assert f"unknown op '{TOY}'" in capsys.readouterr().err


def test_every_built_in_op_has_its_spec_and_a_reference() -> None:
    assert REGISTRY.ops[: len(OPS)] == OPS
    for op in REGISTRY.ops:
        spec = REGISTRY.spec(op)
        assert spec.name == op and REGISTRY.variants(op)
        assert REGISTRY.reference(op).name.endswith("reference")
