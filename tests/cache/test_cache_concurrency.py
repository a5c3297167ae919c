"""Many writers on one store (SQLite and a real PostgreSQL server), and a writer killed mid-transaction."""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ProcessPoolExecutor

from cache_helpers import make_entry, make_key, write_entries
from sqlalchemy import create_engine

from superlinear_ops.cache.schema import SCHEMA_VERSION
from superlinear_ops.cache.store import Store, StoreError, metadata, schema_table

WORKERS, PER_WORKER = 8, 200


def hammer(url: str) -> None:
    """8 processes write 200 entries each into one store; every row must arrive."""
    Store.writer(url).close()  # create the schema once, then start the workers
    with ProcessPoolExecutor(WORKERS, mp_context=multiprocessing.get_context("spawn")) as pool:
        counts = list(pool.map(write_entries, [url] * WORKERS, range(WORKERS), [PER_WORKER] * WORKERS))
    assert counts == [PER_WORKER] * WORKERS  # a "database is locked" would have raised in a worker
    with Store.reader(url) as store:
        rows = store.entries()
    assert len(rows) == WORKERS * PER_WORKER
    assert {e.key.sw_index for e in rows} == {1000 + w for w in range(WORKERS)}


def test_eight_processes_write_into_one_sqlite_store(tmp_path) -> None:
    hammer(f"sqlite:///{tmp_path / 'shared.sqlite'}")


def test_postgresql_store_semantics_and_eight_writers(postgres_url: str) -> None:
    with Store.writer(postgres_url) as store:
        original = [make_entry(i) for i in range(5)]
        assert store.put_many(original) == 5
        assert store.entries() == sorted(original, key=lambda e: e.key_text)
        assert not store.put(make_entry(0, median_ms=9.0))
        assert store.put(make_entry(0, median_ms=0.1))
        assert store.put(make_entry(0, median_ms=9.0), force=True)
        assert store.get(make_key(0).text()).median_ms == 9.0
        assert store.delete([make_key(1).text()]) == 1
    engine = create_engine(postgres_url)
    metadata.drop_all(engine)  # the schema again from scratch, for the eight writers
    engine.dispose()
    hammer(postgres_url)


def store_one_entry(url: str, barrier=None) -> str:
    """Wait for every process (with a barrier), open ``url`` for writing, store one entry; what happened."""
    if barrier is not None:
        barrier.wait()
    try:
        with Store.writer(url) as store:
            store.put(make_entry(0))
            return f"{len(store.entries())} entry"
    except StoreError as err:
        return str(err)


def schema_rows(url: str) -> list:
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(schema_table.select()).all()
    engine.dispose()
    return rows


def test_fresh_postgresql_writers_starting_together_share_one_schema(postgres_url: str) -> None:
    with multiprocessing.get_context("spawn").Manager() as manager:
        barrier = manager.Barrier(WORKERS)
        with ProcessPoolExecutor(WORKERS, mp_context=multiprocessing.get_context("spawn")) as pool:
            outcomes = list(pool.map(store_one_entry, [postgres_url] * WORKERS, [barrier] * WORKERS))
    assert outcomes == ["1 entry"] * WORKERS
    assert schema_rows(postgres_url) == [(SCHEMA_VERSION,)]


def test_a_postgresql_writer_that_loses_the_schema_race_uses_the_winners_schema(postgres_url, monkeypatch) -> None:
    """(SQLite's writer holds its lock from its first look, so no rival gets in there.)"""
    create_all = metadata.create_all

    def rival_creates_first(conn, **kwargs) -> None:
        monkeypatch.setattr(metadata, "create_all", create_all)
        Store.writer(postgres_url).close()  # another process creates the schema after we looked, before we create
        create_all(conn, **kwargs)

    monkeypatch.setattr(metadata, "create_all", rival_creates_first)
    assert store_one_entry(postgres_url) == "1 entry"
    assert schema_rows(postgres_url) == [(SCHEMA_VERSION,)]


WRITER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from cache_helpers import make_entry, make_key
    from superlinear_ops.cache.store import Store

    def batch(n):
        for i in range(20):
            if n == 3 and i == 10:
                print("inside batch 3", flush=True)
                time.sleep(120)  # killed here, mid-transaction
            yield make_entry(n * 20 + i, key=make_key(n * 20 + i, sw_index=7))

    with Store.writer({path!r}) as store:
        for n in range(5):
            store.put_many(batch(n))
            print("committed", n, flush=True)
    """
)


def test_kill_9_mid_transaction_keeps_every_committed_entry(tmp_path) -> None:
    path = tmp_path / "killed.sqlite"
    script = WRITER.format(tests=str(pathlib.Path(__file__).resolve().parents[1]), path=str(path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    committed = []
    for line in proc.stdout:
        if line.startswith("committed"):
            committed.append(int(line.split()[1]))
        if line.startswith("inside batch 3"):
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert committed == [0, 1, 2]
    with Store.reader(path) as store:
        keys = {e.key.text() for e in store.entries()}
    assert keys == {make_key(i, sw_index=7).text() for i in range(60)}  # batches 0-2, none of batch 3
    with Store.writer(path) as store:  # and it is still writable
        assert store.put(make_entry(999, key=make_key(999, sw_index=7)))
