"""The store's schema cannot change silently: the declared key fields and the tables are pinned to the
schema version, the key fields are the problem's, the key text is unchanged, and a store of schema 1
(built here from its own SQL) migrates with its entries intact; one of an unknown version is refused."""

from __future__ import annotations

import hashlib
import sqlite3

import pytest
from cache_helpers import make_entry, make_key

from superlinear_ops.buckets import bucketed, key_of
from superlinear_ops.cache.layers import StoreLayer
from superlinear_ops.cache.schema import KEY_FIELDS, SCHEMA_VERSION
from superlinear_ops.cache.store import MIGRATIONS, Store, StoreError, _row, failures_table, metadata
from superlinear_ops.problem import DeviceIdentity, Problem

_BUMP = ("bump SCHEMA_VERSION (superlinear_ops/cache/schema.py), add MIGRATIONS[{old}] (cache/store.py) "
         "and pin the new version here")
# The declared key fields of each schema version (schema 1 had the same): name, type, key-text template.
KEY_FIELDS_OF_VERSION = {
    2: (
        ("op", "str", "{}"), ("dtype", "str", "|{}"), ("head_dim", "int", "|D{}"), ("q_heads", "int", "|H{}"),
        ("kv_heads", "int", "/{}"), ("spans", "int", "|K{}"), ("queries", "int", "|Lq{}"), ("keys", "int", "|Lkv{}"),
        ("batch", "int", "|B{}"), ("masked", "bool", "|{}mask"), ("sw_index", "int", "|sw{}"), ("power", "str", "|{}"),
        ("factors", "tuple[float, ...]", "|f{}"), ("device", "str", "|{}"), ("arch", "str", "|{}"),
    ),
}
# sha256 of every table's columns (name, type, nullable, primary key), per schema version.
TABLES_OF_VERSION = {2: "032b14df5b06de50"}
# The schema-1 store as the first release wrote it (its own column widths), and how it recorded its version.
SCHEMA_1_SQL = """
CREATE TABLE superlinear_ops_schema (version INTEGER NOT NULL);
INSERT INTO superlinear_ops_schema (version) VALUES (1);
CREATE TABLE superlinear_ops_entries (
    key_text VARCHAR(512) NOT NULL, op VARCHAR(32) NOT NULL, dtype VARCHAR(16) NOT NULL, head_dim INTEGER NOT NULL,
    q_heads INTEGER NOT NULL, kv_heads INTEGER NOT NULL, spans INTEGER NOT NULL, queries INTEGER NOT NULL,
    keys INTEGER NOT NULL, batch INTEGER NOT NULL, masked BOOLEAN NOT NULL, sw_index INTEGER NOT NULL,
    power VARCHAR(64) NOT NULL, factors VARCHAR(256) NOT NULL, device VARCHAR(128) NOT NULL, arch VARCHAR(32) NOT NULL,
    variant VARCHAR(64) NOT NULL, config TEXT NOT NULL, median_ms FLOAT NOT NULL, default_ms FLOAT NOT NULL,
    max_error FLOAT NOT NULL, sampler VARCHAR(32) NOT NULL, trials INTEGER NOT NULL, seed INTEGER NOT NULL,
    package_version VARCHAR(256) NOT NULL, kernel_hash VARCHAR(256) NOT NULL, triton_version VARCHAR(256) NOT NULL,
    torch_version VARCHAR(256) NOT NULL, cuda_version VARCHAR(256) NOT NULL, gpu_name VARCHAR(256) NOT NULL,
    compute_capability VARCHAR(256) NOT NULL, driver VARCHAR(256) NOT NULL, host VARCHAR(256) NOT NULL,
    created_at VARCHAR(256) NOT NULL, interpreter BOOLEAN NOT NULL, PRIMARY KEY (key_text)
);
"""


def _old_entries() -> list:
    """A span entry and a masked decode entry (with factors)."""
    decode_key = make_key(99, op="staged_decode", queries=1, masked=True, factors=(3.0, 1.0, 0.55), power="float0.55")
    return [make_entry(0), make_entry(99, key=decode_key, variant="staged")]


def _tables_fingerprint() -> str:
    columns = [(t.name, [(c.name, str(c.type), c.nullable, c.primary_key) for c in t.columns]) for t in metadata.sorted_tables]
    return hashlib.sha256(repr(columns).encode()).hexdigest()[:16]


def test_the_declared_key_fields_are_pinned_to_the_schema_version() -> None:
    assert SCHEMA_VERSION in KEY_FIELDS_OF_VERSION, _BUMP.format(old=SCHEMA_VERSION - 1)
    assert KEY_FIELDS == KEY_FIELDS_OF_VERSION[SCHEMA_VERSION], (
        f"schema.KEY_FIELDS changed without a schema version bump: {_BUMP.format(old=SCHEMA_VERSION)}")


def test_the_tables_are_pinned_to_the_schema_version() -> None:
    assert _tables_fingerprint() == TABLES_OF_VERSION.get(SCHEMA_VERSION), (
        f"the store's tables changed without a schema version bump: {_BUMP.format(old=SCHEMA_VERSION)}")


def test_every_older_schema_version_has_a_migration() -> None:
    assert sorted(MIGRATIONS) == list(range(1, SCHEMA_VERSION))


def _annotation(kind) -> str:
    return getattr(kind, "__forward_arg__", kind)


def test_the_key_fields_are_the_problems() -> None:
    """Every problem field but the device is a key field, in order and of its type; the device is its name and arch."""
    problem_fields = [(name, _annotation(kind)) for name, kind in Problem.__annotations__.items() if name != "device"]
    assert problem_fields == [(f.name, f.type) for f in KEY_FIELDS if f.name not in ("device", "arch")]
    assert [(f.name, f.type) for f in KEY_FIELDS[-2:]] == [("device", "str"), ("arch", "str")]
    assert {"name", "arch"} <= set(DeviceIdentity._fields)
    problem = Problem("staged_decode", "bfloat16", 64, 8, 2, 4, 1, 1000, 3, True, 5, "float0.55",
                      DeviceIdentity("NVIDIA H200", "sm_90", 132), (3.0, 1.0, 0.55))
    exact = bucketed(problem)._asdict()
    assert key_of(problem)._asdict() == {**exact, "device": "NVIDIA H200", "arch": "sm_90"}


def test_the_key_text_of_existing_keys_is_unchanged() -> None:
    assert [e.key.text() for e in _old_entries()] == [
        "span_forward|float32|D16|H4/2|K2|Lq4|Lkv64|B1|nomask|sw2|int2|f-|cpu|interpreter",
        "staged_decode|float32|D16|H4/2|K2|Lq1|Lkv33554432|B5|mask|sw2|float0.55|f3,1,0.55|cpu|interpreter",
    ]


def _schema_1_store(path) -> None:
    db = sqlite3.connect(path)
    db.executescript(SCHEMA_1_SQL)
    for entry in _old_entries():
        row = _row(entry)
        db.execute(f"INSERT INTO superlinear_ops_entries ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                   list(row.values()))
    db.commit()
    db.close()


def _tables_and_version(path) -> tuple[set[str], int]:
    db = sqlite3.connect(path)
    tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    version = db.execute("SELECT version FROM superlinear_ops_schema").fetchone()[0]
    db.close()
    return tables, version


def test_a_schema_1_store_is_read_as_it_is_and_migrated_by_a_writer(tmp_path) -> None:
    path = tmp_path / "schema-1.sqlite"
    _schema_1_store(path)
    old = _old_entries()
    layer = StoreLayer("explicit", path, required=True)
    assert layer.lookup(old[0].key).choice is not None  # the dispatcher finds it before any migration
    with Store.reader(path) as store:
        assert store.entries() == old and store.failures() == []
    assert _tables_and_version(path) == ({"superlinear_ops_schema", "superlinear_ops_entries"}, 1)  # readers change nothing
    with Store.writer(path) as store:
        assert store.entries() == old
    tables, version = _tables_and_version(path)
    assert failures_table.name in tables and version == SCHEMA_VERSION
    with Store.reader(path) as store:
        assert store.entries() == old and store.get(old[1].key_text) == old[1]


@pytest.mark.parametrize("open_store", [Store.reader, Store.writer])
def test_a_store_of_a_version_with_no_migration_is_refused_untouched(tmp_path, open_store) -> None:
    path = tmp_path / "schema-0.sqlite"
    _schema_1_store(path)
    db = sqlite3.connect(path)
    db.execute("UPDATE superlinear_ops_schema SET version = 0")
    db.commit()
    db.close()
    before = path.read_bytes()
    with pytest.raises(StoreError, match="schema version 0, which this package .* cannot migrate; export its entries") as err:
        open_store(path)
    assert "superlinear-ops cache export" in str(err.value) and "superlinear-ops cache import" in str(err.value)
    assert path.read_bytes() == before  # nothing stored is lost
