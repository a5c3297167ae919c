"""Tuned-result caches: entries with provenance, the SQLAlchemy store, the YAML shipping format,
validity rules, and the lookup layers the dispatcher consults."""

from .entry import Provenance, TunedEntry
from .store import Store, StoreError, resolve_url

__all__ = ["Provenance", "Store", "StoreError", "TunedEntry", "resolve_url"]
