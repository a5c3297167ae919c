"""The shipping format: one canonical YAML file of tuned entries (stable order, one entry per key,
exact round trip, diff-friendly)."""

from __future__ import annotations

import os
import pathlib
import tempfile
from collections.abc import Iterable

import yaml

from .entry import TunedEntry

FORMAT = "superlinear-ops-tuning"
FORMAT_VERSION = 1


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def canonical(entries: Iterable[TunedEntry]) -> list[TunedEntry]:
    """One entry per key (the faster when two share a key), ordered by key text."""
    best: dict[str, TunedEntry] = {}
    for entry in entries:
        held = best.get(entry.key_text)
        if held is None or entry.median_ms < held.median_ms:
            best[entry.key_text] = entry
    return [best[k] for k in sorted(best)]


def dumps(entries: Iterable[TunedEntry]) -> str:
    """The canonical YAML text of ``entries``."""
    document = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "entries": [e.to_dict() for e in canonical(entries)],
    }
    return yaml.safe_dump(document, sort_keys=False, default_flow_style=False, width=1000, allow_unicode=True)


def write(entries: Iterable[TunedEntry], path: str | os.PathLike) -> int:
    """Write ``entries`` to ``path`` atomically (a temporary file, then a rename); returns the count."""
    entries = canonical(entries)
    text = dumps(entries)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual permissions
    os.replace(tmp, path)
    return len(entries)


def read(path: str | os.PathLike) -> list[TunedEntry]:
    """The entries of a YAML file; ValueError naming the file and the entry when it is malformed."""
    path = pathlib.Path(path)
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a YAML text file: {err}") from err
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} file (top-level 'format: {FORMAT}' missing)")
    if document.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format version {document.get('version')!r}, this package reads {FORMAT_VERSION}")
    items = document.get("entries")
    if not isinstance(items, list):
        raise ValueError(f"{path}: 'entries' must be a list")
    entries = []
    for index, item in enumerate(items):
        try:
            entries.append(TunedEntry.from_dict(item))
        except ValueError as err:
            raise ValueError(f"{path}: entry {index}: {err}") from err
    return entries
