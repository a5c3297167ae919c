"""The superlinear-ops command: help text and the demonstration run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from superlinear_ops.cli import main


@pytest.mark.parametrize("args", [["--help"], ["demo", "--help"]])
def test_help(args: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "superlinear_ops.cli", *args], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "usage: superlinear-ops" in result.stdout


def test_demo_runs_and_checks_against_reference(capsys) -> None:
    assert main(["demo", "--device", "cpu", "--seed", "3"]) == 0
    table = capsys.readouterr().out
    for step in ("span forward", "span backward", "staged decode"):
        assert step in table
    assert "FAIL" not in table


def test_cache_commands_round_trip(tmp_path, capsys) -> None:
    from cache_helpers import make_entry

    from superlinear_ops.cache.store import Store

    store = tmp_path / "s.sqlite"
    with Store.writer(store) as s:
        s.put_many([make_entry(i) for i in range(3)])
        s.put(make_entry(7, provenance={"kernel_hash": "stale0123456789a"}))
    assert main(["show", "--cache", str(store)]) == 0
    shown = capsys.readouterr().out
    assert shown.count("span_forward|") == 4 and "kernel source changed" in shown
    assert main(["cache", "export", "--cache", str(store), "-o", str(tmp_path / "e.yaml")]) == 0
    assert main(["cache", "prune", "--cache", str(store), "--dry-run"]) == 0
    assert len(Store.reader(store).entries()) == 4
    assert main(["cache", "prune", "--cache", str(store)]) == 0
    assert len(Store.reader(store).entries()) == 3
    assert main(["cache", "import", str(tmp_path / "e.yaml"), "--cache", str(tmp_path / "new.sqlite")]) == 0
    assert len(Store.reader(tmp_path / "new.sqlite").entries()) == 4
    assert main(["show", "--cache", str(tmp_path / "missing.sqlite")]) == 2
    assert "no store at" in capsys.readouterr().err


def test_variants_and_explain_commands(capsys) -> None:
    assert main(["variants"]) == 0
    listing = capsys.readouterr().out
    for name in ("span_forward/per_query_span", "span_backward/fused_split", "staged_decode/staged"):
        assert name in listing
    assert main(["explain", "--op", "span_backward", "--spans", "1", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "fused_split: not supported: K = 1 span slot" in text and "choice: span_backward/tc_tiles" in text
    assert main(["explain", "--op", "attention_layer", "--queries", "8192", "--keys", "139264", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "key: attention_layer|" in text and "|f3,1,0.55|" in text and "choice: attention_layer/" in text


def test_every_subpackage_is_packaged() -> None:
    import pathlib

    import tomllib

    root = pathlib.Path(__file__).resolve().parents[2]
    declared = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(root).parts) for p in (root / "superlinear_ops").rglob("__init__.py")
    }
    assert found <= declared, f"add to pyproject.toml [tool.setuptools] packages: {sorted(found - declared)}"


def _subcommands() -> list[list[str]]:
    import argparse

    from superlinear_ops.cli import build_parser

    def walk(parser, prefix):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield [*prefix, name]
                    yield from walk(sub, [*prefix, name])

    return list(walk(build_parser(), []))


def test_every_command_has_help(capsys) -> None:
    commands = _subcommands()
    assert {"demo", "variants", "explain", "tune", "verify", "bench", "show", "cache"} <= {c[0] for c in commands}
    assert ["cache", "import"] in commands
    for command in commands:
        with pytest.raises(SystemExit) as done:
            main([*command, "--help"])
        assert done.value.code == 0, command
        assert f"usage: superlinear-ops {' '.join(command)}" in capsys.readouterr().out, command


def test_version(capsys) -> None:
    import superlinear_ops

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"superlinear-ops {superlinear_ops.__version__}"


def test_variants_op_lists_only_that_op(capsys) -> None:
    from superlinear_ops.registry import REGISTRY

    assert main(["variants", "--op", "staged_decode"]) == 0
    listing = capsys.readouterr().out
    names = [line.split()[0] for line in listing.splitlines() if not line.startswith(" ")]
    assert names == [v.qualified_name for v in REGISTRY.variants("staged_decode")]


def test_explain_workload_explains_every_problem(capsys) -> None:
    import pathlib

    import torch

    from superlinear_ops.problem import device_identity
    from superlinear_ops.tuner.workload import load

    quick = pathlib.Path(__file__).resolve().parents[2] / "tuning" / "quick.yaml"
    assert main(["explain", "--workload", str(quick), "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    labels = [c.label for c in load(quick).cases(device_identity(torch.device("cpu")))]
    assert [line[3:] for line in text.splitlines() if line.startswith("== ")] == labels
    # One choice per problem, and one per part its op runs with (the layer's span attention and gates).
    from superlinear_ops.registry import REGISTRY

    cases = load(quick).cases(device_identity(torch.device("cpu")))
    assert text.count("choice: ") == sum(1 + len(REGISTRY.spec(c.problem.op).parts(c.problem)) for c in cases)
    assert text.count("part gate_scores (gate_scores):") == sum(c.problem.op == "attention_layer" for c in cases) > 0


def test_cache_import_force_replaces_faster_entries(tmp_path) -> None:
    from cache_helpers import make_entry

    from superlinear_ops.cache import yaml_file
    from superlinear_ops.cache.store import Store

    store = tmp_path / "s.sqlite"
    with Store.writer(store) as s:
        s.put(make_entry(1, median_ms=0.5))
    slower = tmp_path / "slower.yaml"
    yaml_file.write([make_entry(1, median_ms=0.9)], slower)
    assert main(["cache", "import", str(slower), "--cache", str(store)]) == 0
    assert [e.median_ms for e in Store.reader(store).entries()] == [0.5]  # the faster entry stays
    assert main(["cache", "import", str(slower), "--cache", str(store), "--force"]) == 0
    assert [e.median_ms for e in Store.reader(store).entries()] == [0.9]


def test_warmup_runs_every_problem_once_so_later_calls_resolve_nothing(capsys) -> None:
    """``warmup`` runs each unique problem of a workload once (the dispatcher's choice, resolved and
    memoised): the same calls afterwards resolve no choice. A bad workload is an error, exit 2."""
    import pathlib

    import torch

    from superlinear_ops import dispatch
    from superlinear_ops.precompile import warmup_problem
    from superlinear_ops.problem import device_identity
    from superlinear_ops.tuner.tune import unique_cases
    from superlinear_ops.tuner.workload import load

    quick = pathlib.Path(__file__).resolve().parents[2] / "tuning" / "quick.yaml"
    assert main(["warmup", str(quick), "--device", "cpu", "--no-progress", "--problems", "^(decode|training)"]) == 0
    cases = unique_cases(load(quick).cases(device_identity(torch.device("cpu")), "^(decode|training)"))
    assert f"warmed up {len(cases)} problems on cpu" in capsys.readouterr().out and len(cases) == 3
    before = dispatch.DISPATCHER.resolutions
    for case in cases:
        warmup_problem(case.problem, torch.device("cpu"))
    assert dispatch.DISPATCHER.resolutions == before, "a choice was resolved again after warmup"
    assert main(["warmup", str(quick.with_name("missing.yaml")), "--device", "cpu"]) == 2
    assert "missing.yaml" in capsys.readouterr().err
