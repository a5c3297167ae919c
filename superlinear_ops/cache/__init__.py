"""Tuned-result caches: entries with provenance, the SQLAlchemy store and its declared schema, the YAML
shipping format, validity rules, and the lookup layers the dispatcher consults.

The names below load on first use: ``buckets`` imports ``cache.schema``, which must not pull in the
modules that build on ``buckets``.
"""

from __future__ import annotations

import importlib

_HOMES = {"Provenance": "entry", "TunedEntry": "entry", "Store": "store", "StoreError": "store", "resolve_url": "store"}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    """The public name ``name``, from the module that defines it."""
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
