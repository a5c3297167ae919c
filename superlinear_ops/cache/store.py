"""The tuned-entry store: SQLAlchemy 2.x over SQLite (default) or any database URL (PostgreSQL...).

- A schema-version table and a migration path (``MIGRATIONS``); a schema newer than the code, or
  one it cannot migrate, is refused. The key columns and the primary key (the key text) derive from
  one declared list, ``schema.KEY_FIELDS``, pinned to ``SCHEMA_VERSION`` by the tests.
- SQLite runs in WAL mode with a busy timeout, and write transactions take the write lock up front
  (``BEGIN IMMEDIATE``), so concurrent writers neither lose rows nor see "database is locked".
- Upserts keep the faster entry unless forced, in one atomic statement.
- Failed candidates (``FailureRecord``) live in their own table, keyed by problem key, variant,
  configuration, the variant's code hash and the Triton version, so a tune never retries them.
- Readers never create or change anything; writers never touch a store they cannot read. The
  tables may share a database with other applications' tables (e.g. Optuna's studies).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable, Iterable
from contextlib import contextmanager

import platformdirs
from sqlalchemy import (
    Boolean,
    Column,
    Connection,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    delete,
    event,
    inspect,
    or_,
    select,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, ProgrammingError, SQLAlchemyError

from ..buckets import ProblemKey
from ..launch import KernelConfig
from .entry import FailureRecord, Provenance, TunedEntry
from .schema import KEY_FIELDS, SCHEMA_VERSION

BUSY_TIMEOUT_S = 60
# What an entry was measured with: a new entry whose values differ replaces the stored one even when slower.
REMEASURED_BY = ("kernel_hash", "triton_version")
ENV_CACHE = "SUPERLINEAR_OPS_CACHE"

metadata = MetaData()
schema_table = Table("superlinear_ops_schema", metadata, Column("version", Integer, nullable=False))
_COLUMN_TYPES = {"str": lambda: String(128), "int": lambda: Integer, "bool": lambda: Boolean, "tuple[float, ...]": lambda: String(256)}
# How a key field's value is written to its column and read back, by type (other types: as they are).
_TO_COLUMN = {"tuple[float, ...]": lambda factors: ",".join(repr(f) for f in factors)}
_FROM_COLUMN = {"bool": bool, "tuple[float, ...]": lambda text: tuple(float(f) for f in text.split(",") if f)}


def _as_is(value: object) -> object:
    return value


def _key_columns() -> list[Column]:
    """One column per field of ``KEY_FIELDS`` (factors as comma-separated text)."""
    return [Column(field.name, _COLUMN_TYPES[field.type](), nullable=False) for field in KEY_FIELDS]


_PROVENANCE_COLUMNS = [
    Column(name, Boolean if name == "interpreter" else String(256), nullable=False)
    for name in Provenance.__dataclass_fields__
]
entries_table = Table(
    "superlinear_ops_entries",
    metadata,
    Column("key_text", String(512), primary_key=True),
    *_key_columns(),
    Column("variant", String(64), nullable=False),
    Column("config", Text, nullable=False),
    Column("median_ms", Float, nullable=False),
    Column("default_ms", Float, nullable=False),
    Column("max_error", Float, nullable=False),
    Column("sampler", String(32), nullable=False),
    Column("trials", Integer, nullable=False),
    Column("seed", Integer, nullable=False),
    *_PROVENANCE_COLUMNS,
)
failures_table = Table(
    "superlinear_ops_failures",
    metadata,
    Column("key_text", String(512), primary_key=True),
    Column("variant", String(64), primary_key=True),
    Column("config", String(512), primary_key=True),
    Column("kernel_hash", String(256), primary_key=True),
    Column("triton_version", String(64), primary_key=True),
    *_key_columns(),
    Column("category", String(32), nullable=False),
    Column("message", Text, nullable=False),
    Column("package_version", String(64), nullable=False),
    Column("host", String(256), nullable=False),
    Column("created_at", String(64), nullable=False),
)
_FAILURE_KEY = ("key_text", "variant", "config", "kernel_hash", "triton_version")
# MIGRATIONS[v] upgrades a store at schema version v to v + 1, inside the writer's transaction.
MIGRATIONS: dict[int, Callable[[Connection], None]] = {
    1: lambda conn: failures_table.create(conn),
}


class StoreError(RuntimeError):
    """A store cannot be opened, read or written; the message names the store and the problem."""


def user_store_path() -> pathlib.Path:
    """The user's default store: a SQLite file in the user cache directory."""
    return pathlib.Path(platformdirs.user_cache_dir("superlinear-ops")) / "tuning.sqlite"


def resolve_url(location: str | os.PathLike | None) -> str:
    """A SQLAlchemy URL for a path, a URL, or None (the user's store)."""
    if location is None:
        location = user_store_path()
    text = str(location)
    if "://" in text:
        return text
    return f"sqlite:///{pathlib.Path(text).expanduser().resolve()}"


def sqlite_path(url: str) -> pathlib.Path | None:
    """The file of a SQLite URL (None for other databases)."""
    prefix = "sqlite:///"
    return pathlib.Path(url[len(prefix):]) if url.startswith(prefix) and len(url) > len(prefix) else None


def _key_values(key: ProblemKey) -> tuple:
    """The key's column values (factors as text)."""
    return tuple(_TO_COLUMN.get(field.type, _as_is)(value) for field, value in zip(KEY_FIELDS, key, strict=True))


def _row(entry: TunedEntry) -> dict:
    row = {"key_text": entry.key_text, **dict(zip(ProblemKey._fields, _key_values(entry.key)))}
    row.update(
        variant=entry.variant,
        config=json.dumps(dict(entry.config), sort_keys=True),
        median_ms=entry.median_ms,
        default_ms=entry.default_ms,
        max_error=entry.max_error,
        sampler=entry.sampler,
        trials=entry.trials,
        seed=entry.seed,
        **entry.provenance.__dict__,
    )
    return row


def _key_of_row(m) -> ProblemKey:
    return ProblemKey(*(_FROM_COLUMN.get(field.type, _as_is)(m[field.name]) for field in KEY_FIELDS))


def _failure_row(record: FailureRecord) -> dict:
    row = {"key_text": record.key_text, **dict(zip(ProblemKey._fields, _key_values(record.key)))}
    row.update({name: getattr(record, name) for name in FailureRecord.__dataclass_fields__ if name not in ("key", "config")})
    row["config"] = json.dumps(dict(record.config), sort_keys=True)
    return row


def _failure(row) -> FailureRecord:
    m = row._mapping
    values = {name: m[name] for name in FailureRecord.__dataclass_fields__ if name not in ("key", "config")}
    return FailureRecord(key=_key_of_row(m), config=KernelConfig(json.loads(m["config"])), **values)


def _entry(row) -> TunedEntry:
    m = row._mapping
    provenance = {c.name: m[c.name] for c in _PROVENANCE_COLUMNS}
    provenance["interpreter"] = bool(provenance["interpreter"])
    return TunedEntry(
        key=_key_of_row(m),
        variant=m["variant"],
        config=KernelConfig(json.loads(m["config"])),
        median_ms=m["median_ms"],
        default_ms=m["default_ms"],
        max_error=m["max_error"],
        sampler=m["sampler"],
        trials=m["trials"],
        seed=m["seed"],
        provenance=Provenance(**provenance),
    )


def _engine(url: str, writer: bool) -> Engine:
    if not url.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True)
    engine = create_engine(url, connect_args={"timeout": BUSY_TIMEOUT_S, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:
        dbapi_connection.isolation_level = None  # transactions are begun below, not by the driver
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_S * 1000}")
        if writer:
            cursor.execute("PRAGMA journal_mode = WAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("write") else "BEGIN")

    return engine


class Store:
    """One store of tuned entries; open it with ``Store.reader`` or ``Store.writer``."""

    def __init__(self, url: str, engine: Engine, writable: bool) -> None:
        self.url = url
        self.writable = writable
        self._engine = engine
        self._has_failures = True  # False for an older store opened read-only (no failures table yet)

    @classmethod
    def reader(cls, location: str | os.PathLike | None = None) -> "Store":
        """Open for reading only; raises StoreError (creates nothing) when it cannot be read."""
        url = resolve_url(location)
        path = sqlite_path(url)
        if path is not None and not path.is_file():
            raise StoreError(f"no store at {path}")
        engine_url = url
        if path is not None and not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)):
            # Read-only media or folder: SQLite could not even create its lock files; read it as immutable.
            engine_url = f"sqlite:///file:{path}?mode=ro&immutable=1&uri=true"
        store = cls(url, _engine(engine_url, writer=False), writable=False)
        store._check_schema(create=False)
        return store

    @classmethod
    def writer(cls, location: str | os.PathLike | None = None) -> "Store":
        """Open for writing, creating an empty store if needed; never touches one it cannot read."""
        url = resolve_url(location)
        path = sqlite_path(url)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise StoreError(f"cannot create the folder of store {path}: {err}") from err
            if path.is_file() and path.stat().st_size:
                cls._probe_sqlite(url)
        store = cls(url, _engine(url, writer=True), writable=True)
        try:
            try:
                store._check_schema(create=True)
            except StoreError as lost:
                if not isinstance(lost.__cause__, (IntegrityError, ProgrammingError)):
                    raise
                # Another process created the schema between our look and our create (PostgreSQL: a unique
                # violation, or "already exists"): look again once, now at its tables.
                store._check_schema(create=True)
        except BaseException:
            store.close()
            raise
        return store

    @classmethod
    def _probe_sqlite(cls, url: str) -> None:
        """Refuse a damaged, foreign or newer SQLite file before a writer's first write (the WAL switch)."""
        probe = cls(url, _engine(url, writer=False), writable=False)
        try:
            with probe._transaction(write=False) as conn:
                verdict = conn.exec_driver_sql("PRAGMA quick_check").scalar()
                ours = {schema_table.name, entries_table.name} & set(inspect(conn).get_table_names())
            if verdict != "ok":
                raise StoreError(f"store {url} is damaged ({verdict}); refusing to write to it")
            if ours:
                probe._check_schema(create=False)
        finally:
            probe.close()

    def close(self) -> None:
        """Release the store's connections."""
        self._engine.dispose()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextmanager
    def _transaction(self, write: bool):
        try:
            with self._engine.connect().execution_options(write=write) as conn, conn.begin():
                yield conn
        except SQLAlchemyError as err:
            cause = getattr(err, "orig", None) or err
            raise StoreError(f"store {self.url}: {cause.__class__.__name__}: {cause}") from err

    def _check_schema(self, create: bool) -> None:
        with self._transaction(write=create) as conn:
            tables = set(inspect(conn).get_table_names())
            if schema_table.name not in tables:
                if not create:
                    raise StoreError(f"store {self.url} has no {schema_table.name} table (not a superlinear-ops store)")
                if entries_table.name in tables:
                    raise StoreError(f"store {self.url} has an entries table but no schema table; refusing to write to it")
                # Beside any other application's tables, which stay untouched; a rival's tables, created since
                # we looked, make this fail rather than be skipped (Store.writer then looks again).
                metadata.create_all(conn, tables=[t for t in metadata.sorted_tables if t.name not in tables],
                                    checkfirst=False)
                conn.execute(schema_table.insert().values(version=SCHEMA_VERSION))
                return
            version = conn.execute(select(schema_table.c.version)).scalar()
            if version is None:
                raise StoreError(f"store {self.url} has an empty schema table")
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"store {self.url} has schema version {version}, newer than this package's {SCHEMA_VERSION}; "
                    "upgrade superlinear-ops to use it"
                )
            if entries_table.name not in tables:
                raise StoreError(f"store {self.url} lacks its {entries_table.name} table")
            if any(step not in MIGRATIONS for step in range(version, SCHEMA_VERSION)):
                raise StoreError(
                    f"store {self.url} has schema version {version}, which this package ({SCHEMA_VERSION}) cannot migrate; "
                    "export its entries with the superlinear-ops that wrote it (superlinear-ops cache export), then "
                    "delete the store and import them (superlinear-ops cache import), or delete it and re-tune"
                )
            if version < SCHEMA_VERSION and create:
                for step in range(version, SCHEMA_VERSION):
                    MIGRATIONS[step](conn)
                conn.execute(schema_table.update().values(version=SCHEMA_VERSION))
                return
            self._has_failures = failures_table.name in tables
            if version == SCHEMA_VERSION and not self._has_failures:
                raise StoreError(f"store {self.url} lacks its {failures_table.name} table")

    def get(self, key_text: str) -> TunedEntry | None:
        """The entry stored under ``key_text``, if any."""
        with self._transaction(write=False) as conn:
            row = conn.execute(select(entries_table).where(entries_table.c.key_text == key_text)).first()
        return None if row is None else _entry(row)

    def entries_for_arch(self, key: ProblemKey) -> list[TunedEntry]:
        """Entries for ``key`` measured on other GPUs of the same architecture, by GPU name."""
        match = [c == value for c, value in zip(
            (entries_table.c[name] for name in ProblemKey._fields), _key_values(key)) if c.name != "device"]
        with self._transaction(write=False) as conn:
            rows = conn.execute(
                select(entries_table).where(*match, entries_table.c.device != key.device).order_by(entries_table.c.device)
            ).all()
        return [_entry(r) for r in rows]

    def entries(self) -> list[TunedEntry]:
        """Every entry, ordered by key text."""
        with self._transaction(write=False) as conn:
            rows = conn.execute(select(entries_table).order_by(entries_table.c.key_text)).all()
        return [_entry(r) for r in rows]

    def put(self, entry: TunedEntry, *, force: bool = False) -> bool:
        """Store ``entry``; an existing entry for its key is replaced by a faster one, by one measured
        with other code or another Triton (the stored one is stale for it: its time no longer
        compares), or when forced.

        Returns True when ``entry`` was written.
        """
        return self.put_many([entry], force=force) == 1

    def put_many(self, entries: Iterable[TunedEntry], *, force: bool = False) -> int:
        """``put`` for many entries in one transaction; returns how many were written."""
        if not self.writable:
            raise StoreError(f"store {self.url} was opened read-only")
        written = 0
        with self._transaction(write=True) as conn:
            for entry in entries:
                written += self._upsert(conn, _row(entry), force)
        return written

    def _upsert(self, conn: Connection, row: dict, force: bool) -> int:
        dialect = conn.dialect.name
        if dialect in ("sqlite", "postgresql"):
            insert = (sqlite if dialect == "sqlite" else postgresql).insert(entries_table).values(**row)
            updates = {name: insert.excluded[name] for name in row if name != "key_text"}
            where = None if force else or_(
                insert.excluded.median_ms < entries_table.c.median_ms,
                *(insert.excluded[name] != entries_table.c[name] for name in REMEASURED_BY),
            )
            statement = insert.on_conflict_do_update(index_elements=["key_text"], set_=updates, where=where)
            return len(conn.execute(statement.returning(entries_table.c.key_text)).all())
        columns = [entries_table.c.median_ms, *(entries_table.c[name] for name in REMEASURED_BY)]
        current = conn.execute(
            select(*columns).where(entries_table.c.key_text == row["key_text"]).with_for_update()
        ).first()
        if current is None:
            conn.execute(entries_table.insert().values(**row))
            return 1
        median, *measured_with = current
        if force or row["median_ms"] < median or tuple(measured_with) != tuple(row[name] for name in REMEASURED_BY):
            conn.execute(entries_table.update().where(entries_table.c.key_text == row["key_text"]).values(**row))
            return 1
        return 0

    def delete(self, key_texts: Iterable[str]) -> int:
        """Remove the entries under ``key_texts``; returns how many were removed."""
        if not self.writable:
            raise StoreError(f"store {self.url} was opened read-only")
        keys = list(key_texts)
        if not keys:
            return 0
        with self._transaction(write=True) as conn:
            return conn.execute(delete(entries_table).where(entries_table.c.key_text.in_(keys))).rowcount

    def put_failure(self, record: FailureRecord) -> None:
        """Record a failed candidate (replacing an earlier record of the same candidate and code)."""
        if not self.writable:
            raise StoreError(f"store {self.url} was opened read-only")
        row = _failure_row(record)
        with self._transaction(write=True) as conn:
            dialect = conn.dialect.name
            if dialect in ("sqlite", "postgresql"):
                insert = (sqlite if dialect == "sqlite" else postgresql).insert(failures_table).values(**row)
                updates = {name: insert.excluded[name] for name in row if name not in _FAILURE_KEY}
                conn.execute(insert.on_conflict_do_update(index_elements=list(_FAILURE_KEY), set_=updates))
                return
            conn.execute(delete(failures_table).where(*(failures_table.c[name] == row[name] for name in _FAILURE_KEY)))
            conn.execute(failures_table.insert().values(**row))

    def failures(self, key_text: str | None = None) -> list[FailureRecord]:
        """The recorded failures (of ``key_text`` only, when given), by key, variant and configuration."""
        if not self._has_failures:
            return []
        query = select(failures_table).order_by(*(failures_table.c[name] for name in _FAILURE_KEY))
        if key_text is not None:
            query = query.where(failures_table.c.key_text == key_text)
        with self._transaction(write=False) as conn:
            return [_failure(r) for r in conn.execute(query).all()]

    def delete_failures(self, records: Iterable[FailureRecord]) -> int:
        """Remove these failure records (so the candidates are tried again); returns how many went."""
        if not self.writable:
            raise StoreError(f"store {self.url} was opened read-only")
        removed = 0
        with self._transaction(write=True) as conn:
            for row in map(_failure_row, records):
                removed += conn.execute(
                    delete(failures_table).where(*(failures_table.c[name] == row[name] for name in _FAILURE_KEY))).rowcount
        return removed
