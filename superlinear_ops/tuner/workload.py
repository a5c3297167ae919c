"""Workload files: what to tune (model heads, span settings, and decode / prefill / training problems).

A bad file raises ``WorkloadError`` naming the file, the field and its line.
"""

from __future__ import annotations

import os
import pathlib
import re
from dataclasses import dataclass

import yaml

from .. import geometry
from ..problem import SPAN_BACKWARD, SPAN_FORWARD, STAGED_DECODE, DeviceIdentity, Problem

DTYPES = ("float16", "bfloat16", "float32")
KINDS = {"decode": ("context", "cache"), "prefill": ("chunk", "prefix"), "training": ("tokens",)}


class WorkloadError(ValueError):
    """A workload file is malformed; the message names the field and its line."""


class _LineLoader(yaml.SafeLoader):
    """Records the line of every mapping so errors can point at it."""


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> dict:
    mapping = yaml.SafeLoader.construct_mapping(loader, node, deep=True)
    mapping["__line__"] = node.start_mark.line + 1
    return mapping


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


@dataclass(frozen=True)
class Case:
    """One named problem of a workload, with the sizes its inputs need."""

    label: str
    problem: Problem
    span_factors: tuple[float, float, float]  # (backward_factor, forward_factor, span_power)
    cache_fill: int | None = None  # decode in a static cache: the filled prefix length


@dataclass(frozen=True)
class Workload:
    """A parsed workload file."""

    name: str
    path: str
    model: dict
    span: dict
    entries: tuple[dict, ...]

    @property
    def params(self) -> geometry.PowerParams:
        """Search-power parameters of the workload."""
        return geometry.power_params(
            search_power=self.span.get("search_power"), inv_search_power_int=self.span.get("inv_search_power_int")
        )

    def cases(self, device: DeviceIdentity, only: str | None = None) -> list[Case]:
        """Every op problem of the workload on ``device`` (training gives a forward and a backward).

        ``only`` keeps the cases whose label matches that regular expression.
        """
        m, s = self.model, self.span
        common = dict(
            dtype=m["dtype"], head_dim=m["head_dim"], q_heads=m["q_heads"], kv_heads=m["kv_heads"],
            batch=m["batch"], sw_index=s["sw_index"], power=self.params.label, device=device,
        )
        factors = (float(s["backward_factor"]), float(s["forward_factor"]), float(s["span_power"]))
        cases = []
        for entry in self.entries:
            kind, sizes = entry["kind"], entry["sizes"]
            if kind == "decode":
                keys = sizes.get("cache") or sizes["context"]
                label = f"decode {sizes['context']}" + (f" in {keys} static cache" if sizes.get("cache") else "")
                problem = Problem(STAGED_DECODE, spans=s["topk"], queries=1, keys=keys, masked="cache" in sizes,
                                  factors=factors, **common)
                cases.append(Case(label, problem, factors, sizes["context"] if sizes.get("cache") else None))
            elif kind == "prefill":
                keys = sizes["prefix"] + sizes["chunk"]
                problem = Problem(SPAN_FORWARD, spans=s["topk"], queries=sizes["chunk"], keys=keys, masked=False, **common)
                cases.append(Case(f"prefill {sizes['chunk']} over {sizes['prefix']}", problem, factors))
            else:
                n = sizes["tokens"]
                for op, what in ((SPAN_FORWARD, "forward"), (SPAN_BACKWARD, "backward")):
                    problem = Problem(op, spans=s["topk"], queries=n, keys=n, masked=False, **common)
                    cases.append(Case(f"training {n} {what}", problem, factors))
        return [c for c in cases if only is None or re.search(only, c.label)]


def _fail(path: str, line: int | None, message: str) -> WorkloadError:
    return WorkloadError(f"{path}:{line if line else '?'}: {message}")


def _int(path, section: dict, name: str, minimum: int = 1) -> int:
    value = section.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(path, section.get("__line__"), f"'{name}' must be an integer >= {minimum}, got {value!r}")
    return value


def _number(path, section: dict, name: str, low: float, high: float | None = None) -> float:
    value = section.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise _fail(path, section.get("__line__"), f"'{name}' must be a number {bound}, got {value!r}")
    return float(value)


def _section(path, document: dict, name: str) -> dict:
    section = document.get(name)
    if not isinstance(section, dict):
        raise _fail(path, document.get("__line__"), f"missing mapping '{name}'")
    return section


def load(path: str | os.PathLike) -> Workload:
    """Parse and check a workload file."""
    path = str(path)
    try:
        document = yaml.load(pathlib.Path(path).read_text(encoding="utf-8"), Loader=_LineLoader)  # noqa: S506
    except yaml.YAMLError as err:
        raise WorkloadError(f"{path}: not valid YAML: {err}") from err
    except OSError as err:
        raise WorkloadError(f"{path}: cannot read: {err}") from err
    if not isinstance(document, dict):
        raise _fail(path, 1, "the file must be a mapping with 'name', 'model', 'span' and 'problems'")
    name = document.get("name")
    if not isinstance(name, str) or not name:
        raise _fail(path, document.get("__line__"), "'name' must be a non-empty string")
    model = _section(path, document, "model")
    for field in ("batch", "q_heads", "kv_heads", "head_dim"):
        _int(path, model, field)
    if model["q_heads"] % model["kv_heads"]:
        raise _fail(path, model["__line__"], "'q_heads' must be a multiple of 'kv_heads'")
    if model["head_dim"] > 256:
        raise _fail(path, model["__line__"], "'head_dim' must be <= 256")
    if model.get("dtype") not in DTYPES:
        raise _fail(path, model["__line__"], f"'dtype' must be one of {DTYPES}, got {model.get('dtype')!r}")
    span = _section(path, document, "span")
    _int(path, span, "sw_index", minimum=0)
    _int(path, span, "topk")
    _number(path, span, "span_power", 1e-9, 1.0)
    _number(path, span, "backward_factor", 0.0)
    _number(path, span, "forward_factor", 0.0)
    try:
        geometry.power_params(search_power=span.get("search_power"), inv_search_power_int=span.get("inv_search_power_int"))
    except (TypeError, ValueError) as err:
        raise _fail(path, span["__line__"], str(err)) from err
    problems = document.get("problems")
    if not isinstance(problems, list) or not problems:
        raise _fail(path, document.get("__line__"), "'problems' must be a non-empty list")
    entries = []
    for item in problems:
        line = item.get("__line__") if isinstance(item, dict) else None
        kinds = [k for k in (item if isinstance(item, dict) else {}) if k != "__line__"]
        if len(kinds) != 1 or kinds[0] not in KINDS or not isinstance(item[kinds[0]], dict):
            raise _fail(path, line, f"each problem must be one of {sorted(KINDS)} with a mapping of sizes, got {item!r}")
        kind, sizes = kinds[0], item[kinds[0]]
        allowed = KINDS[kind]
        unknown = [k for k in sizes if k not in allowed and k != "__line__"]
        if unknown:
            raise _fail(path, sizes["__line__"], f"{kind}: unknown field(s) {unknown}; allowed: {list(allowed)}")
        for field in allowed:
            if field in sizes or field != "cache":
                _int(path, sizes, field)
        if kind == "decode" and sizes.get("cache") and sizes["cache"] < sizes["context"]:
            raise _fail(path, sizes["__line__"], "decode: 'cache' must be >= 'context'")
        entries.append({"kind": kind, "sizes": {k: v for k, v in sizes.items() if k != "__line__"}})
    strip = lambda d: {k: v for k, v in d.items() if k != "__line__"}  # noqa: E731
    return Workload(name, path, strip(model), strip(span), tuple(entries))
