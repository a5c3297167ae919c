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
