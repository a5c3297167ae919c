"""Caches and the CLI under bad input: imports are validated, read-only stores read, explicit
caches that cannot be used warn, and every CLI error is one line with exit status 2."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch
import yaml
from cache_helpers import make_entry

from superlinear_ops.buckets import ProblemKey
from superlinear_ops.cache import yaml_file
from superlinear_ops.cache.layers import CacheWarning, layer_for
from superlinear_ops.cache.store import Store
from superlinear_ops.cli import main


def _yaml_with(tmp_path, change) -> str:
    path = tmp_path / "in.yaml"
    yaml_file.write([make_entry(0)], path)
    document = yaml.safe_load(path.read_text())
    change(document["entries"][0])
    path.write_text(yaml.safe_dump(document))
    return str(path)


@pytest.mark.parametrize("change,message", [
    (lambda e: e["timing"].update(median_ms=-1), "timing.median_ms must be a finite time > 0"),
    (lambda e: e["timing"].update(median_ms=float("nan")), "timing.median_ms must be a finite time > 0"),
    (lambda e: e["timing"].update(default_ms=0), "timing.default_ms must be > 0"),
    (lambda e: e["key"].update(op="bogus_op"), "key.op must be one of"),
    (lambda e: e.update(variant="bogus_variant"), "not registered in this version"),
    (lambda e: e["config"].update(num_warps=3), "outside the variant's declared space"),
    (lambda e: e["search"].update(trials=0), "search.trials must be >= 1"),
])
def test_cache_import_validates_every_field_and_names_file_and_entry(tmp_path, capsys, change, message) -> None:
    store = tmp_path / "s.sqlite"
    with Store.writer(store) as s:
        s.put(make_entry(0))
    path = _yaml_with(tmp_path, change)
    assert main(["cache", "import", path, "--cache", str(store)]) == 2
    err = capsys.readouterr().err
    assert message in err and path in err and "entry 0" in err and len(err.strip().splitlines()) == 1
    with Store.reader(store) as s:
        assert s.entries() == [make_entry(0)]  # the measured winner is kept
    assert main(["show", "--cache", str(store)]) == 0
    assert main(["cache", "prune", "--cache", str(store), "--dry-run"]) == 0


def test_cache_import_of_a_binary_file_names_the_file(tmp_path, capsys) -> None:
    path = tmp_path / "blob.yaml"
    path.write_bytes(bytes(range(256)) * 4)
    assert main(["cache", "import", str(path), "--cache", str(tmp_path / "s.sqlite")]) == 2
    assert str(path) in capsys.readouterr().err


def test_a_read_only_store_is_read_as_immutable(tmp_path, monkeypatch) -> None:
    store = tmp_path / "ro" / "s.sqlite"
    with Store.writer(store) as s:
        s.put(make_entry(0))
    for leftover in store.parent.glob("s.sqlite-*"):
        leftover.unlink()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if mode == os.W_OK else real_access(p, mode))
    store.parent.chmod(0o555)
    try:
        with Store.reader(store) as s:
            assert s.entries() == [make_entry(0)]
        assert sorted(p.name for p in store.parent.iterdir()) == ["s.sqlite"]  # nothing created beside it
    finally:
        store.parent.chmod(0o755)


def test_an_explicit_cache_that_cannot_be_used_warns_once(tmp_path) -> None:
    key = ProblemKey(*make_entry(0).key)
    layer = layer_for(tmp_path / "missing.sqlite")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert layer.lookup(key).choice is None
        assert layer.lookup(key).choice is None
    assert [str(w.message) for w in caught if w.category is CacheWarning] == [
        f"superlinear-ops: tuned cache {tmp_path / 'missing.sqlite'} cannot be read (no store at "
        f"{tmp_path / 'missing.sqlite'}); using the next layer"
    ]
    with pytest.raises(TypeError, match="cache location must be a path"):
        layer_for(123)


@pytest.mark.parametrize("argv,message", [
    (["explain", "--kv-heads", "0"], "kv_heads must be a positive int"),
    (["explain", "--keys", "-5"], "keys must be a positive int"),
    (["explain", "--head-dim", "512"], "head_dim must be at most 256"),
    (["explain", "--sw-index", "-1"], "sw_index must be a non-negative int"),
    (["explain", "--span-power", "nan"], "span_power must be a finite number"),
    (["tune", "tuning/quick.yaml", "--problems", "["], "--problems is not a valid regular expression"),
    (["tune", "tuning/quick.yaml", "--storage", "bogus://x"], "cannot use that storage"),
    (["tune", "tuning/quick.yaml", "--storage", "{garbage}"], "cannot use that storage"),
])
def test_cli_errors_are_one_line_with_exit_status_2(argv, message, tmp_path) -> None:
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"not a database" * 100)
    argv = [arg.format(garbage=garbage) for arg in argv]
    root = str(pathlib.Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-m", "superlinear_ops.cli", *argv], cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in done.stderr


def test_warmup_checks_its_problems_and_device() -> None:
    from superlinear_ops import warmup
    from superlinear_ops.problem import DeviceIdentity, Problem

    good = Problem("span_forward", "float32", 16, 2, 1, 1, 4, 64, 1, False, 2, "int2", DeviceIdentity("cpu", "interpreter", 0))
    with pytest.raises(ValueError, match="op must be one of"):
        warmup([good._replace(op="bogus")], device="cpu")
    with pytest.raises(ValueError, match="dtype must be one of"):
        warmup([good._replace(dtype="int8")], device="cpu")
    with pytest.raises(TypeError, match="Problem values"):
        warmup(["span_forward"], device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no GPU"):
            warmup([good], device="cuda")
