"""Every shape-bucketing rule: how a Problem becomes the key that tuned results are stored under.

Rules:
- query count Lq: decode (Lq = 1) is its own bucket; otherwise the next power of two >= Lq;
- key count Lkv: the next power of two >= Lkv;
- batch: the next power of two >= B;
- dtype, head dim, heads, span slots, mask or not, sw_index and power path (which fix the
  window), decode factors and the
  device identity: exact.
Two keys are ``distance`` buckets apart when they differ only in bucketed sizes, by that many
factors of two in total; the dispatcher may borrow a tuned result from a key within
``NEAREST_DISTANCE``.
"""

from __future__ import annotations

from itertools import product
from typing import NamedTuple

from .cache.schema import KEY_FIELDS, key_text
from .problem import Problem

NEAREST_DISTANCE = 1


def next_power_of_two(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def query_bucket(queries: int) -> int:
    """Bucket of the query count (1 stays 1: decode)."""
    return next_power_of_two(queries)


# The key's fields are the problem's, with the device identity flattened to its name and arch; they,
# the key text and the store's columns come from one declared list, cache.schema.KEY_FIELDS.
# Types are given as their names.
KEY_FIELD_TYPES: dict[str, str] = {field.name: field.type for field in KEY_FIELDS}
_KeyFields = NamedTuple("_KeyFields", list(KEY_FIELD_TYPES.items()))


class ProblemKey(_KeyFields):
    """The bucketed identity of a Problem: what tuned entries are stored and found under."""

    __slots__ = ()

    def text(self) -> str:
        """A stable one-line rendering (the store's primary key; used in tables, logs and as a study name)."""
        return key_text(self)


def key_of(problem: Problem) -> ProblemKey:
    """The key a problem is stored and looked up under."""
    p = problem
    return ProblemKey(
        p.op, p.dtype, p.head_dim, p.q_heads, p.kv_heads, p.spans, query_bucket(p.queries),
        next_power_of_two(p.keys), next_power_of_two(p.batch), p.masked, p.sw_index, p.power, p.factors,
        p.device.name, p.device.arch,
    )


def bucketed(problem: Problem) -> Problem:
    """``problem`` with its sizes at their bucket's upper end: what every rule that picks a
    variant or a configuration reads, so that all problems of one key get the same answer."""
    return problem._replace(
        queries=query_bucket(problem.queries), keys=next_power_of_two(problem.keys), batch=next_power_of_two(problem.batch)
    )


def _shifted(value: int, steps: int) -> int | None:
    shifted = value << steps if steps >= 0 else value >> -steps
    return shifted if shifted >= 1 and (steps >= 0 or value >> -steps << -steps == value) else None


def neighbours(key: ProblemKey, distance: int = NEAREST_DISTANCE) -> list[tuple[int, ProblemKey]]:
    """Keys 1..distance buckets away (Lq, Lkv, B moved by factors of two), nearest first.

    Decode keys keep Lq = 1 and other keys never move to Lq = 1.
    """
    found: dict[ProblemKey, int] = {}
    moves = range(-distance, distance + 1)
    for dq, dk, db in product(moves, moves, moves):
        steps = abs(dq) + abs(dk) + abs(db)
        if not 0 < steps <= distance or (key.queries == 1 and dq):
            continue
        queries, keys, batch = _shifted(key.queries, dq), _shifted(key.keys, dk), _shifted(key.batch, db)
        if None in (queries, keys, batch) or (key.queries != 1 and queries == 1):
            continue
        other = key._replace(queries=queries, keys=keys, batch=batch)
        found.setdefault(other, steps)
    return sorted(((steps, k) for k, steps in found.items()), key=lambda item: (item[0], item[1].text()))
