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
    assert "K = 1 span slot" in text and "choice: span_backward/per_span_split" in text


def test_every_subpackage_is_packaged() -> None:
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parent.parent
    declared = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(root).parts) for p in (root / "superlinear_ops").rglob("__init__.py")
    }
    assert found <= declared, f"add to pyproject.toml [tool.setuptools] packages: {sorted(found - declared)}"
