"""Tuning cache: round trips, upserts, validity, layer order and every fault case."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch
from cache_helpers import make_entry, make_key
from helpers import assert_close

import superlinear_ops
from superlinear_ops import dispatch, fused_span_attention_gqa
from superlinear_ops.cache import yaml_file
from superlinear_ops.cache.layers import CacheWarning, StoreLayer, YamlLayer, default_layers
from superlinear_ops.cache.store import SCHEMA_VERSION, Store, StoreError
from superlinear_ops.cache.validity import why_unusable
from superlinear_ops.dispatch import HEURISTIC, Dispatcher
from superlinear_ops.launch import KernelConfig
from superlinear_ops.ops.span_attention.reference import span_forward_reference
from superlinear_ops.problem import Problem, device_identity
from superlinear_ops.registry import REGISTRY


def entries(n: int = 12):
    varied = [make_entry(i) for i in range(n)]
    varied.append(make_entry(99, key=make_key(99, op="staged_decode", queries=1, factors=(3.0, 1.0, 0.55),
                                              power="float0.55"), variant="staged"))
    return varied


def test_round_trip_sqlite_yaml_sqlite_is_identical(tmp_path) -> None:
    original = entries()
    with Store.writer(tmp_path / "a.sqlite") as a:
        assert a.put_many(original) == len(original)
        from_a = a.entries()
    assert from_a == sorted(original, key=lambda e: e.key_text)
    yaml_file.write(from_a, tmp_path / "a.yaml")
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "a.yaml").stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600
    text = (tmp_path / "a.yaml").read_text()
    from_yaml = yaml_file.read(tmp_path / "a.yaml")
    assert from_yaml == from_a
    assert yaml_file.dumps(from_yaml) == text  # canonical: a second export is byte-identical
    with Store.writer(tmp_path / "b.sqlite") as b:
        b.put_many(from_yaml)
        assert b.entries() == from_a


def test_yaml_keeps_one_entry_per_key_in_stable_order(tmp_path) -> None:
    slow, fast = make_entry(3, median_ms=5.0), make_entry(3, median_ms=0.5)
    yaml_file.write([slow, make_entry(1), fast], tmp_path / "c.yaml")
    loaded = yaml_file.read(tmp_path / "c.yaml")
    assert [e.median_ms for e in loaded if e.key == fast.key] == [0.5]
    assert [e.key_text for e in loaded] == sorted(e.key_text for e in loaded)


def test_upsert_keeps_the_faster_entry_unless_forced(tmp_path) -> None:
    with Store.writer(tmp_path / "s.sqlite") as store:
        assert store.put(make_entry(0, median_ms=2.0))
        assert not store.put(make_entry(0, median_ms=3.0))
        assert store.get(make_key(0).text()).median_ms == 2.0
        assert store.put(make_entry(0, median_ms=1.0))
        assert store.get(make_key(0).text()).median_ms == 1.0
        assert store.put(make_entry(0, median_ms=4.0), force=True)
        assert store.get(make_key(0).text()).median_ms == 4.0
        assert len(store.entries()) == 1


def test_a_fresh_measurement_replaces_a_stale_entry_even_when_slower(tmp_path) -> None:
    """An entry measured with other kernel code or another Triton no longer compares: a re-tune's
    entry replaces it even when its time is higher (a re-tune used to keep the stale, faster one)."""
    with Store.writer(tmp_path / "s.sqlite") as store:
        assert store.put(make_entry(0, median_ms=1.0, provenance={"kernel_hash": "0123456789abcdef"}))
        assert store.put(make_entry(0, median_ms=3.0))
        assert store.get(make_key(0).text()).median_ms == 3.0
        assert store.put(make_entry(0, median_ms=2.0, provenance={"triton_version": "9.9.0"}))
        assert not store.put(make_entry(0, median_ms=2.5, provenance={"triton_version": "9.9.0"}))
        assert store.get(make_key(0).text()).provenance.triton_version == "9.9.0"


GPU_KEY = make_key(0, device="NVIDIA H200", arch="sm_90")


@pytest.mark.parametrize(
    "entry,wanted,reason",
    [
        (make_entry(key=GPU_KEY, provenance={"compute_capability": "sm_80"}), GPU_KEY, "measured on sm_80"),
        (make_entry(key=GPU_KEY, provenance={"compute_capability": "sm_90", "interpreter": True}), GPU_KEY, "interpreter"),
        (make_entry(0, provenance={"kernel_hash": "0123456789abcdef"}), None, "kernel source changed"),
        (make_entry(0, provenance={"triton_version": "2.3.1"}), None, "Triton 2.3.1"),
        (dataclasses.replace(make_entry(0), variant="gone"), None, "not registered"),
        (make_entry(0, config=KernelConfig(block_k=512, num_warps=4, num_stages=2)), None, "outside the variant's declared space"),
    ],
    ids=["gpu-arch", "interpreter-timing-on-gpu", "kernel-hash", "triton-major-minor", "variant", "config-space"],
)
def test_validity_rules_one_per_field(entry, wanted, reason) -> None:
    assert reason in why_unusable(entry, wanted)


def test_valid_entry_is_usable_and_triton_patch_versions_do_not_matter() -> None:
    entry = make_entry(0)
    assert why_unusable(entry) is None
    major, minor, *_ = entry.provenance.triton_version.split(".")
    assert why_unusable(make_entry(0, provenance={"triton_version": f"{major}.{minor}.99"})) is None


def _problem() -> Problem:
    return Problem("span_forward", "float32", 16, 4, 2, 2, 4, 64, 1, False, 2, "int2", device_identity(torch.device("cpu")))


def test_layer_order_explicit_then_user_then_shipped(tmp_path) -> None:
    key = make_key(0)
    with Store.writer(tmp_path / "explicit.sqlite") as s:
        s.put(make_entry(0, config=KernelConfig(block_k=16, num_warps=4, num_stages=2)))
    with Store.writer(tmp_path / "user.sqlite") as s:
        s.put(make_entry(0, config=KernelConfig(block_k=64, num_warps=4, num_stages=2)))
    yaml_file.write([make_entry(0, config=KernelConfig(block_k=128, num_warps=4, num_stages=2))], tmp_path / "shipped.yaml")
    layers = [
        StoreLayer("explicit", tmp_path / "explicit.sqlite"),
        StoreLayer("user", tmp_path / "user.sqlite"),
        YamlLayer("shipped", lambda: [tmp_path / "shipped.yaml"], "shipped.yaml"),
    ]
    problem = _problem()
    assert dispatch.key_of(problem) == key
    for expected_block, source in ((16, "explicit"), (64, "user"), (128, "shipped")):
        choice = Dispatcher(REGISTRY, layers).select(problem)
        assert (choice.config.block_k, choice.source) == (expected_block, source)
        layers = layers[1:]
    assert Dispatcher(REGISTRY, layers).select(problem).source == HEURISTIC


def test_default_layers_follow_the_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SUPERLINEAR_OPS_CACHE", str(tmp_path / "x.yaml"))
    names = [(layer.name, type(layer).__name__) for layer in default_layers()]
    assert names == [("explicit", "YamlLayer"), ("user", "StoreLayer"), ("shipped", "YamlLayer")]
    monkeypatch.setenv("SUPERLINEAR_OPS_CACHE", "postgresql+psycopg://u@127.0.0.1/db")
    assert type(default_layers()[0]).__name__ == "StoreLayer"


# --- faults: the op still runs, right, and warns once ------------------------------------------


def _sql(path, statement: str) -> None:
    """Run one statement and leave the file checkpointed, with no WAL beside it."""
    db = sqlite3.connect(path)
    db.execute(statement)
    db.commit()
    db.execute("PRAGMA journal_mode = DELETE")
    db.close()


def _corrupt(path):
    path.write_bytes(b"this is not a database" * 200)


def _truncated(path):
    with Store.writer(path) as s:
        s.put_many(entries(40))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


def _malformed_yaml(path):
    path.write_text("format: superlinear-ops-tuning\nversion: 1\nentries: [ {key: oops\n")


def _missing_table(path):
    with Store.writer(path) as s:
        s.put(make_entry(0))
    _sql(path, "DROP TABLE superlinear_ops_entries")


def _newer_schema(path):
    with Store.writer(path) as s:
        s.put(make_entry(0))
    _sql(path, f"UPDATE superlinear_ops_schema SET version = {SCHEMA_VERSION + 1}")


def _unmigratable_schema(path):
    with Store.writer(path) as s:
        s.put(make_entry(0))
    _sql(path, "UPDATE superlinear_ops_schema SET version = 0")  # no migration leads from it


FAULTS = {
    "corrupt.sqlite": _corrupt,
    "truncated.sqlite": _truncated,
    "malformed.yaml": _malformed_yaml,
    "missing-table.sqlite": _missing_table,
    "newer-schema.sqlite": _newer_schema,
    "unmigratable-schema.sqlite": _unmigratable_schema,
}


@pytest.fixture
def restore_cache():
    yield
    superlinear_ops.use_cache()


def _span_call(gen, lq: int):
    q = torch.randn(1, 4, lq, 16, generator=gen)
    k = torch.randn(1, 2, 64, 16, generator=gen)
    v = torch.randn(1, 2, 64, 16, generator=gen)
    spans = torch.tensor([2, 7]).expand(1, 4, lq, 2).contiguous()
    ends = torch.tensor([5, 12]).expand(1, 4, lq, 2).contiguous()
    cp = torch.arange(64 - lq, 64)
    out = fused_span_attention_gqa(q, k, v, spans, ends, cp, None, 2)
    expected = span_forward_reference(q.double(), k.double(), v.double(), spans, ends, cp, None, 8)
    assert_close(out, expected, torch.float32, 64, "out")


@pytest.mark.parametrize("name", list(FAULTS))
def test_faulty_cache_warns_once_and_the_op_still_runs(name, tmp_path, gen, restore_cache) -> None:
    path = tmp_path / name
    FAULTS[name](path)
    before = path.read_bytes()
    superlinear_ops.use_cache(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _span_call(gen, 4)
        _span_call(gen, 16)  # a second key: the broken layer is not read again
    cache_warnings = [w for w in caught if issubclass(w.category, CacheWarning)]
    assert len(cache_warnings) == 1, [str(w.message) for w in caught]
    assert name in str(cache_warnings[0].message)
    assert path.read_bytes() == before  # readers never change a store


@pytest.mark.parametrize("name", ["corrupt.sqlite", "truncated.sqlite", "newer-schema.sqlite"])
def test_writers_refuse_stores_they_cannot_read(name, tmp_path) -> None:
    path = tmp_path / name
    FAULTS[name](path)
    before = path.read_bytes()
    with pytest.raises(StoreError, match=str(path.name).split(".")[0] if "schema" not in name else "newer"):
        Store.writer(path)
    assert path.read_bytes() == before


def test_writer_adds_its_tables_beside_others_and_refuses_half_a_store(tmp_path) -> None:
    path = tmp_path / "shared.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE notes (x)")
        db.execute("INSERT INTO notes VALUES (42)")
    with Store.writer(path) as store:
        store.put(make_entry(0))
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT x FROM notes").fetchall() == [(42,)]
        db.execute("DROP TABLE superlinear_ops_schema")
    with pytest.raises(StoreError, match="no schema table|superlinear-ops store"):
        Store.writer(path)


def test_read_only_directory_warns_at_most_once_and_the_op_still_runs() -> None:
    """Run as an unprivileged user (root ignores directory permissions)."""
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot drop privileges")
    base = tempfile.mkdtemp(prefix="slops-ro-", dir="/tmp")
    try:
        folder = os.path.join(base, "ro")
        store_path = os.path.join(folder, "store.sqlite")
        home = os.path.join(base, "home")
        os.makedirs(home)
        with Store.writer(store_path) as s:
            s.put(make_entry(0))
        os.chmod(base, 0o755)
        os.chmod(home, 0o777)
        os.chmod(store_path, 0o444)
        os.chmod(folder, 0o555)
        script = (
            "import os, warnings, torch\n"
            "os.environ['TRITON_INTERPRET'] = '1'\n"
            "import superlinear_ops as so\n"
            "from superlinear_ops.cache import Store, StoreError\n"
            "from superlinear_ops.cache.layers import CacheWarning\n"
            f"so.use_cache({store_path!r})\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    for lq in (4, 16):\n"
            "        q = torch.randn(1, 4, lq, 16); k = torch.randn(1, 2, 64, 16)\n"
            "        s = torch.full((1, 4, lq, 2), -1)\n"
            "        out = so.fused_span_attention_gqa(q, k, k, s, s, torch.arange(64 - lq, 64), None, 2)\n"
            "        assert torch.isfinite(out).all()\n"
            "print('cache warnings', sum(issubclass(x.category, CacheWarning) for x in w))\n"
            "print([str(x.message) for x in w if issubclass(x.category, CacheWarning)])\n"
            "try:\n"
            f"    Store.writer({store_path!r}).put_many([])\n"
            "    print('writer opened')\n"
            "except StoreError as err:\n"
            "    print('writer refused:', err)\n"
        )
        command = [sys.executable, "-c", script]
        if os.geteuid() == 0:
            command = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *command]
        env = {**os.environ, "HOME": home, "XDG_CACHE_HOME": home}
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        warned = int(result.stdout.split("cache warnings ")[1].split()[0])
        assert warned <= 1, result.stdout
        assert "writer refused" in result.stdout, result.stdout
        with Store.reader(store_path) as s:  # nothing was lost
            assert len(s.entries()) == 1
    finally:
        os.chmod(os.path.join(base, "ro"), 0o755)
        shutil.rmtree(base)
