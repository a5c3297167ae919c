"""The store's schema, declared once: the problem-key fields and the schema version they belong to.

``KEY_FIELDS`` is the one list that ``ProblemKey``'s fields, the store's key columns and the key text
(``ProblemKey.text()``, the primary key of stores and YAML files) all derive from. Changing it, or
any table of ``store``, changes the schema: bump ``SCHEMA_VERSION`` and add
``store.MIGRATIONS[previous version]``. tests/cache/test_store_schema.py pins the list and the tables to
the version, so neither can change silently.

This module imports nothing from the package: ``buckets`` builds ``ProblemKey`` from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

SCHEMA_VERSION = 2  # 1: the entries table; 2: the failures table


class KeyField(NamedTuple):
    """One key field: its name, its type as ``Problem`` annotates it, and its part of the key text."""

    name: str
    type: str  # 'str', 'int', 'bool' or 'tuple[float, ...]' (a column type of store._COLUMN_TYPES)
    text: str  # a format template for the value's text (see _TEXT_OF); separators included


# The problem's fields in its order, less the device, whose identity is flattened to its name and arch.
KEY_FIELDS: tuple[KeyField, ...] = (
    KeyField("op", "str", "{}"),
    KeyField("dtype", "str", "|{}"),
    KeyField("head_dim", "int", "|D{}"),
    KeyField("q_heads", "int", "|H{}"),
    KeyField("kv_heads", "int", "/{}"),
    KeyField("spans", "int", "|K{}"),
    KeyField("queries", "int", "|Lq{}"),
    KeyField("keys", "int", "|Lkv{}"),
    KeyField("batch", "int", "|B{}"),
    KeyField("masked", "bool", "|{}mask"),
    KeyField("sw_index", "int", "|sw{}"),
    KeyField("power", "str", "|{}"),
    KeyField("factors", "tuple[float, ...]", "|f{}"),
    KeyField("device", "str", "|{}"),
    KeyField("arch", "str", "|{}"),
)
# A value's text, by type (str() for the others): a bool is '' or 'no' ('|{}mask': 'mask' / 'nomask'); factors
# are joined by commas in '%g' form, '-' when none.
_TEXT_OF: dict[str, Callable[[Any], str]] = {
    "bool": lambda value: "" if value else "no",
    "tuple[float, ...]": lambda factors: ",".join(f"{f:g}" for f in factors) or "-",
}


def key_text(values: Sequence) -> str:
    """The key text of a key's ``values`` (one per field of ``KEY_FIELDS``, in order)."""
    return "".join(field.text.format(_TEXT_OF.get(field.type, str)(value)) for field, value in zip(KEY_FIELDS, values, strict=True))
