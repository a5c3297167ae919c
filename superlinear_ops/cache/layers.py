"""The lookup layers the dispatcher consults, in order: an explicit store (argument or
SUPERLINEAR_OPS_CACHE: a SQLite file, a YAML file or a database URL), the user's store, then the
YAML files shipped with the package. Each opens lazily on its first lookup. A layer that cannot be
read (corrupt, truncated, missing table, newer schema, unreadable folder) warns once, naming the
file and the problem, and answers misses from then on: the op always runs.

An entry's context kind (``dispatch.FULL_CONTEXT`` or ``STATIC_CACHE``, which the borrowing rule
reads) is recorded in its search label: ``search_label`` writes it, ``context_of`` reads it back.
"""

from __future__ import annotations

import importlib.resources
import os
import pathlib
import threading
import warnings
from collections.abc import Callable

from sqlalchemy.exc import SQLAlchemyError

from ..buckets import ProblemKey
from ..dispatch import DISPATCHER, FULL_CONTEXT, STATIC_CACHE, LayerAnswer, TunedChoice
from . import yaml_file
from .entry import TunedEntry
from .store import ENV_CACHE, Store, StoreError, resolve_url, sqlite_path, user_store_path
from .validity import why_unusable

SHIPPED_PACKAGE = "superlinear_ops.shipped_cache"
STATIC_CACHE_TAG = "/static-cache"  # search label suffix of an entry tuned over a static cache's fills


def search_label(sampler: str, context: str) -> str:
    """The ``sampler`` field an entry is stored with: the sampler, tagged when tuned on a static cache."""
    if context not in (FULL_CONTEXT, STATIC_CACHE):
        raise ValueError(f"context must be {FULL_CONTEXT!r} or {STATIC_CACHE!r}, got {context!r}")
    return sampler + STATIC_CACHE_TAG if context == STATIC_CACHE else sampler


def context_of(entry: TunedEntry) -> str:
    """The context kind ``entry`` was tuned on (see ``search_label``)."""
    return STATIC_CACHE if entry.sampler.endswith(STATIC_CACHE_TAG) else FULL_CONTEXT


class CacheWarning(RuntimeWarning):
    """A tuned cache could not be used; the op falls back to the next layer."""


class AbsentSource(Exception):
    """The layer's file does not exist (yet): a quiet miss, checked again on the next lookup."""


class EntryLayer:
    """A layer over a lazily loaded source of entries; subclasses say how to load and look up."""

    def __init__(self, name: str, where: str) -> None:
        self.name = name
        self.where = where
        self._lock = threading.Lock()
        self._broken: str | None = None

    def _fetch(self, key: ProblemKey) -> TunedEntry | None:
        raise NotImplementedError

    def _fetch_borrowable(self, key: ProblemKey) -> list[TunedEntry]:
        """Entries for ``key`` tuned on other GPUs of its architecture."""
        raise NotImplementedError

    def lookup(self, key: ProblemKey, borrow: bool = False) -> LayerAnswer:
        """The usable entry for ``key`` (with ``borrow``: the first usable one tuned on another GPU
        of the key's architecture), or a miss saying why."""
        found = self._read(key, borrow)
        if isinstance(found, str):
            return LayerAnswer(None, found)
        if not found:
            return LayerAnswer(None, f"no entry in {self.where}")
        reasons = []
        for entry in found:
            reason = why_unusable(entry, key)
            if reason is None:
                lender = entry.key.device if borrow else None
                return LayerAnswer(TunedChoice(entry.variant, entry.config, context_of(entry)), self.where, lender)
            reasons.append(reason if not borrow else f"{entry.key.device}: {reason}")
        return LayerAnswer(None, f"entry in {self.where} skipped: {'; '.join(reasons)}")

    def sibling_entries(self, key: ProblemKey) -> list[TunedEntry]:
        """Every entry for ``key`` tuned on another GPU of its architecture, usable here or not (a
        stale one too: the tuner measures it again), by GPU name; none where the source cannot be read."""
        found = self._read(key, borrow=True)
        return [] if isinstance(found, str) else found

    def _read(self, key: ProblemKey, borrow: bool) -> list[TunedEntry] | str:
        """The entries ``lookup`` weighs, or why the source cannot be read (a broken one warns once)."""
        with self._lock:
            if self._broken is not None:
                return f"unavailable ({self._broken})"
            try:
                found = self._fetch_borrowable(key) if borrow else [self._fetch(key)]
            except AbsentSource as absent:
                return str(absent)
            except (StoreError, SQLAlchemyError, ValueError, OSError) as err:
                self._broken = str(err)
                warnings.warn(
                    f"superlinear-ops: tuned cache {self.where} cannot be read ({err}); using the next layer",
                    CacheWarning,
                    stacklevel=3,
                )
                return f"unavailable ({err})"
        return [entry for entry in found if entry is not None]


class StoreLayer(EntryLayer):
    """A SQLAlchemy store (opened read-only on first use). A missing ``required`` store (one the user
    named) warns once; a missing optional one (the user's store before any tuning) is a quiet miss."""

    def __init__(self, name: str, location: str | os.PathLike | None, required: bool = False) -> None:
        super().__init__(name, str(location if location is not None else user_store_path()))
        self._location = location
        self._required = required
        self._store: Store | None = None

    def _fetch(self, key: ProblemKey) -> TunedEntry | None:
        if self._store is None:
            path = sqlite_path(resolve_url(self._location))
            if path is not None and not path.exists():
                if self._required:
                    raise StoreError(f"no store at {path}")
                raise AbsentSource(f"no store at {path}")
            self._store = Store.reader(self._location)
        return self._store.get(key.text())

    def _fetch_borrowable(self, key: ProblemKey) -> list[TunedEntry]:
        self._fetch(key)  # opens the store (or says it is absent)
        return self._store.entries_for_arch(key)


class YamlLayer(EntryLayer):
    """One or more YAML files, read in full on first use."""

    def __init__(self, name: str, paths: Callable[[], list[pathlib.Path]], where: str) -> None:
        super().__init__(name, where)
        self._paths = paths
        self._entries: dict[str, TunedEntry] | None = None
        self._by_arch: dict[ProblemKey, list[TunedEntry]] = {}

    def _fetch(self, key: ProblemKey) -> TunedEntry | None:
        if self._entries is None:
            loaded: dict[str, TunedEntry] = {}
            by_arch: dict[ProblemKey, list[TunedEntry]] = {}
            for path in self._paths():
                for entry in yaml_file.read(path):
                    if loaded.setdefault(entry.key_text, entry) is entry:
                        by_arch.setdefault(entry.key._replace(device=""), []).append(entry)
            self._entries, self._by_arch = loaded, by_arch
        return self._entries.get(key.text())

    def _fetch_borrowable(self, key: ProblemKey) -> list[TunedEntry]:
        self._fetch(key)
        others = self._by_arch.get(key._replace(device=""), [])
        return sorted((e for e in others if e.key.device != key.device), key=lambda e: e.key.device)


def shipped_files() -> list[pathlib.Path]:
    """The YAML caches shipped inside the package (or, run from a source checkout, its cache/ folder)."""
    try:
        root = pathlib.Path(str(importlib.resources.files(SHIPPED_PACKAGE)))
    except ModuleNotFoundError:
        root = pathlib.Path(__file__).resolve().parents[2] / "cache"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.endswith((".yaml", ".yml")))


def layer_for(location: str | os.PathLike, name: str = "explicit") -> EntryLayer:
    """A layer for a SQLite file, a YAML file or a database URL."""
    if not isinstance(location, (str, os.PathLike)):
        raise TypeError(f"a cache location must be a path or a database URL string, got {location!r}")
    text = str(location)
    if text.endswith((".yaml", ".yml")) and "://" not in text:
        path = pathlib.Path(text).expanduser()
        return YamlLayer(name, lambda: [path], str(path))
    return StoreLayer(name, location, required=True)


def default_layers(explicit: str | os.PathLike | None = None) -> list[EntryLayer]:
    """Explicit store (argument, else SUPERLINEAR_OPS_CACHE) > user store > shipped files."""
    explicit = explicit if explicit is not None else os.environ.get(ENV_CACHE) or None
    layers: list[EntryLayer] = [layer_for(explicit)] if explicit else []
    layers.append(StoreLayer("user", None))
    layers.append(YamlLayer("shipped", shipped_files, f"package {SHIPPED_PACKAGE}"))
    return layers


def use_cache(location: str | os.PathLike | None = None) -> None:
    """Point the dispatcher at an explicit cache (None: back to SUPERLINEAR_OPS_CACHE and defaults).

    Forgets memoised choices, so later calls consult the new layers.
    """
    DISPATCHER.set_layers(default_layers(location))
