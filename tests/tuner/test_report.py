"""The per-GPU benchmark report: its tables from a results file, and the checked-in reports never drifting from their JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from superlinear_ops.cli import main
from superlinear_ops.tuner.report import render, write_report

BENCHMARKS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"

SMALL = {
    "schema": 1,
    "device": "NVIDIA Test GPU",
    "arch": "sm_90",
    "title": "superlinear-ops on a test GPU",
    "setup": "Two made-up rows.",
    "tables": [
        {
            "title": "Decode step",
            "date": "2026-01-02",
            "commit": "abc1234",
            "command": "python3 benchmarks/decode_masks.py",
            "units": "us",
            "dense_backend": "cuDNN",
            "bound": "bytes / 3.0 TB/s",
            "columns": {"variant": "variant"},
            "notes": ["A note."],
            "rows": [
                {"case": "4K, no mask", "ours": 15.49, "bound": 1.4, "dense": 13.22, "variant": "stripe_spans"},
                {"case": "1M, no mask", "ours": 151.1, "bound": 135.3, "dense": 1360.7, "variant": None},
            ],
        },
        {
            "title": "Training",
            "date": "2026-01-05",
            "commit": "def5678",
            "command": "superlinear-ops bench",
            "units": "ms",
            "dense_backend": "flash",
            "bound": "FLOPs / 790 TFLOP/s",
            "rows": [{"case": "64K", "ours": 76.59, "bound": 25.83, "dense": None}],
        },
    ],
}


def test_report_tables_name_backend_bound_and_provenance():
    text = render(SMALL, source="small.json")
    lines = text.splitlines()
    assert lines[0] == "# superlinear-ops on a test GPU"
    assert "GPU: NVIDIA Test GPU (sm_90). Latest measurement: 2026-01-05." in text
    assert "Measured 2026-01-02 at commit `abc1234` with `python3 benchmarks/decode_masks.py`. Times in us." in text
    assert "Dense: `scaled_dot_product_attention`, backend cuDNN. Lower bound: bytes / 3.0 TB/s." in text
    assert "| case | ours (us) | lower bound | dense (cuDNN) | dense / ours | variant |" in lines
    assert "| 4K, no mask | 15.49 | 1.40 | 13.22 | 0.85x | stripe_spans |" in lines
    assert "| 1M, no mask | 151.1 | 135.3 | 1,361 | 9.01x | - |" in lines
    assert "- A note." in lines
    assert "Measured 2026-01-05 at commit `def5678`" in text
    assert "| case | ours (ms) | lower bound | dense (flash) | dense / ours |" in lines
    assert "| 64K | 76.59 | 25.83 | - | - |" in lines
    assert text.endswith("\n") and not text.endswith("\n\n")


def test_report_refuses_a_table_without_provenance():
    broken = json.loads(json.dumps(SMALL))
    del broken["tables"][1]["commit"]
    with pytest.raises(ValueError, match=r"tables\[1\] \(Training\): missing field 'commit'"):
        render(broken)


def test_bench_report_command_writes_the_report(tmp_path, capsys):
    results = tmp_path / "small.json"
    results.write_text(json.dumps(SMALL), encoding="utf-8")
    assert main(["bench", "--report", str(results)]) == 0
    assert (tmp_path / "small.md").read_text(encoding="utf-8") == render(SMALL, source="small.json")
    out = tmp_path / "elsewhere.md"
    assert main(["bench", "--report", str(results), "--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == render(SMALL, source="small.json")
    assert f"wrote {out}" in capsys.readouterr().out


@pytest.mark.parametrize("gpu", ["h200", "h100"])
def test_checked_in_report_equals_what_its_json_generates(gpu, tmp_path):
    generated = write_report(BENCHMARKS / f"{gpu}.json", tmp_path / f"{gpu}.md").read_text(encoding="utf-8")
    checked_in = (BENCHMARKS / f"{gpu}.md").read_text(encoding="utf-8")
    assert checked_in == generated, f"docs/benchmarks/{gpu}.md is stale: run superlinear-ops bench --report docs/benchmarks/{gpu}.json"
