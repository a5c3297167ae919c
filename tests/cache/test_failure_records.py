"""Failure records in the store: the schema-2 table, its migration from a schema-1 store (SQLite and
PostgreSQL), upserts keyed by candidate and code, ``cache show`` and ``cache prune``."""

from __future__ import annotations

import dataclasses

import pytest
from cache_helpers import make_entry, make_key
from sqlalchemy import create_engine, inspect, select

from superlinear_ops.cache.entry import FailureRecord
from superlinear_ops.cache.provenance import kernel_hash, triton_version
from superlinear_ops.cache.store import SCHEMA_VERSION, Store, _row, entries_table, failures_table, resolve_url, schema_table
from superlinear_ops.cli import main
from superlinear_ops.launch import KernelConfig


def make_failure(block_k: int = 32, **changes) -> FailureRecord:
    """A current failure record of per_query_span on ``make_key()``."""
    record = FailureRecord(
        key=make_key(), variant="per_query_span", config=KernelConfig(block_k=block_k, num_warps=2, num_stages=3),
        category="illegal access / crash", message="the worker process died while running it (killed by SIGSEGV)",
        kernel_hash=kernel_hash("span_forward", "per_query_span"), triton_version=triton_version(),
        package_version="0.1.0", host="test", created_at="2026-12-01T00:00:00+00:00",
    )
    return dataclasses.replace(record, **changes)


def _schema_1_store(url: str) -> None:
    """A store as schema version 1 wrote it: the schema and entries tables, one entry, no failures table."""
    engine = create_engine(url)
    with engine.begin() as conn:
        schema_table.create(conn)
        entries_table.create(conn)
        conn.execute(schema_table.insert().values(version=1))
        conn.execute(entries_table.insert().values(**_row(make_entry())))
    engine.dispose()


def _migrates(url: str) -> None:
    _schema_1_store(url)
    with Store.reader(url) as store:  # a reader neither migrates nor fails on the old schema
        assert len(store.entries()) == 1 and store.failures() == []
    engine = create_engine(url)
    assert failures_table.name not in inspect(engine).get_table_names()
    with Store.writer(url) as store:
        assert store.entries() == [make_entry()]
        store.put_failure(make_failure())
    with engine.connect() as conn:
        assert conn.execute(select(schema_table.c.version)).scalar() == SCHEMA_VERSION == 2
    engine.dispose()
    with Store.reader(url) as store:
        assert store.failures() == [make_failure()] and store.entries() == [make_entry()]


def test_a_schema_1_sqlite_store_migrates(tmp_path) -> None:
    _migrates(resolve_url(tmp_path / "old.sqlite"))


def test_a_schema_1_postgresql_store_migrates(postgres_url) -> None:
    _migrates(postgres_url)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_failures_are_keyed_by_candidate_and_code(tmp_path, request, backend) -> None:
    url = str(tmp_path / "s.sqlite") if backend == "sqlite" else request.getfixturevalue("postgres_url")
    with Store.writer(url) as store:
        store.put_failure(make_failure())
        store.put_failure(make_failure(message="again", category="timeout"))  # same candidate, same code: replaced
        store.put_failure(make_failure(block_k=64))
        store.put_failure(make_failure(kernel_hash="0" * 16))  # other code: its own record
        store.put_failure(make_failure(key=make_key(1)))
        records = store.failures(make_key().text())
        assert len(records) == 3 and len(store.failures()) == 4
        replaced = next(r for r in records if r.config["block_k"] == 32 and r.kernel_hash != "0" * 16)
        assert (replaced.category, replaced.message) == ("timeout", "again")
        assert store.delete_failures([make_failure(block_k=64)]) == 1 and len(store.failures()) == 3
    with Store.reader(url) as store, pytest.raises(Exception, match="read-only"):
        store.put_failure(make_failure())


def test_show_lists_failures_and_prune_forgets_stale_ones(tmp_path, capsys) -> None:
    cache = str(tmp_path / "c.sqlite")
    with Store.writer(cache) as store:
        store.put(make_entry())
        store.put_failure(make_failure())
        store.put_failure(make_failure(block_k=64, kernel_hash="0" * 16, category="wrong numbers"))
    assert main(["cache", "show", "--cache", cache]) == 0
    out = capsys.readouterr().out
    assert "failed candidates (2;" in out and "killed by SIGSEGV" in out
    current = {line.split()[-1] for line in out.splitlines() if "per_query_span" in line and "|" in line}
    assert current  # both rows printed
    rows = [line for line in out.splitlines() if line.startswith("span_forward") and ("crash" in line or "wrong numbers" in line)]
    assert [" yes " in r for r in rows] == [True, False]  # ordered by config: block_k=32 (current), block_k=64 (other code)
    assert main(["cache", "prune", "--cache", cache]) == 0
    with Store.reader(cache) as store:
        assert store.failures() == [make_failure()] and len(store.entries()) == 1
    assert main(["cache", "prune", "--failures", "--cache", cache]) == 0
    with Store.reader(cache) as store:
        assert store.failures() == [] and len(store.entries()) == 1


def test_failure_records_name_bad_fields() -> None:
    with pytest.raises(ValueError, match="category must be one of"):
        make_failure(category="flaky")
    with pytest.raises(ValueError, match="key.op must be one of"):
        make_failure(key=make_key(op="nope"))
