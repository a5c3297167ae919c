"""Many writers on one store (SQLite and a real PostgreSQL server), and a writer killed mid-transaction."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ProcessPoolExecutor

from cache_helpers import make_entry, make_key, write_entries
from sqlalchemy import create_engine

from superlinear_ops.cache.store import Store, metadata

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
    script = WRITER.format(tests=os.path.dirname(__file__), path=str(path))
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
