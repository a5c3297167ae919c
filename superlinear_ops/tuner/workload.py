"""Workload files: what to tune (model heads, span settings, and decode / prefill / training problems).

A decode problem is ``decode: {context: N}``, with optional fields ``cache`` (a static cache of that
many keys filled to ``context``: tuned over ``STATIC_FILLS`` fills from ``context`` to ``cache``, the
fills a replayed graph sees), ``batch`` (instead of the model's) and ``mask`` (a full context with
an attention mask: one of ``MASK_KINDS`` or a list of them; every kind has the same key, so the
problem is tuned for the mean time over them). ``op: {name: OP, queries: N, keys: M}`` names one
problem of any declared op directly (a plugin's too; ``batch`` optional). A bad file raises
``WorkloadError`` naming the file, the field and its line.
"""

from __future__ import annotations

import math
import os
import pathlib
import re
from dataclasses import dataclass

import yaml

from .. import geometry
from ..dispatch import FULL_CONTEXT, STATIC_CACHE
from ..problem import ATTENTION_LAYER, SPAN_BACKWARD, SPAN_FORWARD, STAGED_DECODE, DeviceIdentity, Problem
from ..registry import REGISTRY

DTYPES = ("float16", "bfloat16", "float32")
KINDS = {
    "decode": ("context", "cache", "batch", "mask"), "prefill": ("chunk", "prefix"), "training": ("tokens",),
    "layer_prefill": ("chunk", "keys"), "layer_training": ("tokens",),  # the whole layer (search, spans, gate)
    "op": ("name", "queries", "keys", "batch"),  # one problem of any declared op
}
TOP_FIELDS = ("name", "model", "span", "problems")
MODEL_FIELDS = ("batch", "q_heads", "kv_heads", "head_dim", "dtype")
SPAN_FIELDS = ("sw_index", "topk", "span_power", "backward_factor", "forward_factor", "search_power",
               "inv_search_power_int")
OPTIONAL_SIZES = ("cache", "batch", "mask")
TEXT_SIZES = ("name",)
MASK_KINDS = ("ones", "holes", "left_padding")  # all keys; 10% holes; row b left-padded by 100 (b + 1) keys
STATIC_FILLS = 3


def static_cache_fills(first: int, size: int, count: int = STATIC_FILLS) -> tuple[int, ...]:
    """``count`` evenly spaced fills from ``first`` to ``size`` (both included, no repeats)."""
    if count < 2 or not 1 <= first <= size:
        raise ValueError(f"need count >= 2 and 1 <= first <= size, got count={count}, first={first}, size={size}")
    return tuple(sorted({first + (size - first) * i // (count - 1) for i in range(count)}))


class WorkloadError(ValueError):
    """A workload file is malformed; the message names the field and its line."""


class _LineLoader(yaml.SafeLoader):
    """Records the line of every mapping and of each of its keys so errors can point at them."""


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> dict:
    mapping = yaml.SafeLoader.construct_mapping(loader, node, deep=True)
    mapping["__lines__"] = {
        loader.construct_object(key): key.start_mark.line + 1 for key, _ in node.value if isinstance(key, yaml.ScalarNode)
    }
    mapping["__line__"] = node.start_mark.line + 1
    return mapping


def _line(section: dict, name: str | None = None) -> int | None:
    """The line of field ``name`` of ``section`` (of the section itself without a name)."""
    return section.get("__lines__", {}).get(name) or section.get("__line__")


def _strip(section: dict) -> dict:
    return {k: v for k, v in section.items() if k not in ("__line__", "__lines__")}


def _known_fields(path, section: dict, where: str, allowed: tuple[str, ...]) -> None:
    """Reject a field of ``section`` that is not in ``allowed``, naming it and its line."""
    for name in _strip(section):
        if name not in allowed:
            raise _fail(path, _line(section, name), f"{where}: unknown field {name!r}; allowed: {list(allowed)}")


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


@dataclass(frozen=True)
class Case:
    """One named problem of a workload, with the sizes its inputs need."""

    label: str
    problem: Problem
    span_factors: tuple[float, float, float]  # (backward_factor, forward_factor, span_power)
    cache_fill: int | None = None  # decode in a static cache: the filled prefix length
    mask_kinds: tuple[str, ...] = ()  # decode over a full context with these masks (MASK_KINDS)

    @property
    def context(self) -> str:
        """``STATIC_CACHE`` for decode in a static cache, else ``FULL_CONTEXT``."""
        return STATIC_CACHE if self.cache_fill is not None else FULL_CONTEXT

    @property
    def fills(self) -> tuple[int | None, ...]:
        """The fills the case is timed at (None: the keys are the context)."""
        return (None,) if self.cache_fill is None else static_cache_fills(self.cache_fill, self.problem.keys)

    def timed_inputs(self) -> list[tuple[int | None, str | None]]:
        """Every (fill, mask kind) the case is timed on; its time is the mean over them."""
        return [(fill, kind) for fill in self.fills for kind in (self.mask_kinds or (None,))]


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
        """Every op problem of the workload on ``device`` (training gives a forward and a backward; the
        layer kinds give the whole-layer problem, whose span parts use the span ops' entries).

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
                masks = sizes.get("mask", ())
                label = f"decode {sizes['context']}" + (f" in {keys} static cache" if sizes.get("cache") else "")
                label += (f", B={sizes['batch']}" if "batch" in sizes else "") + (f", mask {'/'.join(masks)}" if masks else "")
                problem = Problem(STAGED_DECODE, spans=s["topk"], queries=1, keys=keys,
                                  masked="cache" in sizes or bool(masks), factors=factors,
                                  **{**common, "batch": sizes.get("batch", common["batch"])})
                cases.append(Case(label, problem, factors, sizes["context"] if sizes.get("cache") else None, masks))
            elif kind.startswith("layer"):
                queries, keys = (sizes["chunk"], sizes["keys"]) if kind == "layer_prefill" else (sizes["tokens"],) * 2
                label = f"layer prefill {queries} over {keys}" if kind == "layer_prefill" else f"layer training {keys}"
                problem = Problem(ATTENTION_LAYER, spans=s["topk"], queries=queries, keys=keys, masked=False,
                                  factors=factors, **common)
                cases.append(Case(label, problem, factors))
                cases.extend(Case(f"{label}: {name}", part, factors)
                             for name, part in REGISTRY.spec(ATTENTION_LAYER).companions(problem).items())
            elif kind == "op":
                spec = REGISTRY.spec(sizes["name"])
                queries = 1 if spec.single_query else sizes["queries"]
                problem = spec.canonical(Problem(spec.name, spans=s["topk"], queries=queries, keys=sizes["keys"], masked=False,
                                                 factors=factors if spec.searching else (),
                                                 **{**common, "batch": sizes.get("batch", common["batch"])}))
                cases.append(Case(f"{spec.name} {queries} over {sizes['keys']}", problem, factors))
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
        raise _fail(path, _line(section, name), f"'{name}' must be an integer >= {minimum}, got {value!r}")
    return value


def _mask_kinds(path, sizes: dict) -> tuple[str, ...]:
    """The decode problem's mask kinds (one name or a non-empty list of distinct names)."""
    value = sizes["mask"]
    kinds = [value] if isinstance(value, str) else value
    if not isinstance(kinds, list) or not kinds or len(set(map(str, kinds))) != len(kinds) or any(k not in MASK_KINDS for k in kinds):
        raise _fail(path, _line(sizes, "mask"), f"'mask' must be one of {list(MASK_KINDS)} or a list of distinct ones, got {value!r}")
    return tuple(kinds)


def _op_name(path, section: dict, name: str) -> None:
    """``section[name]`` must name a declared op."""
    value = section.get(name)
    if value not in REGISTRY.ops:
        raise _fail(path, _line(section, name), f"'{name}' must be a declared op, one of {list(REGISTRY.ops)}; got {value!r}")


def _number(path, section: dict, name: str, low: float, high: float | None = None) -> float:
    value = section.get(name)
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    if bad or value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise _fail(path, _line(section, name), f"'{name}' must be a finite number {bound}, got {value!r}")
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
    _known_fields(path, document, "workload", TOP_FIELDS)
    name = document.get("name")
    if not isinstance(name, str) or not name:
        raise _fail(path, _line(document, "name"), "'name' must be a non-empty string")
    model = _section(path, document, "model")
    _known_fields(path, model, "model", MODEL_FIELDS)
    for field in ("batch", "q_heads", "kv_heads", "head_dim"):
        _int(path, model, field)
    if model["q_heads"] % model["kv_heads"]:
        raise _fail(path, _line(model, "q_heads"), "'q_heads' must be a multiple of 'kv_heads'")
    if model["head_dim"] > 256:
        raise _fail(path, _line(model, "head_dim"), "'head_dim' must be <= 256")
    if model.get("dtype") not in DTYPES:
        raise _fail(path, _line(model, "dtype"), f"'dtype' must be one of {DTYPES}, got {model.get('dtype')!r}")
    span = _section(path, document, "span")
    _known_fields(path, span, "span", SPAN_FIELDS)
    _int(path, span, "sw_index", minimum=0)
    _int(path, span, "topk")
    _number(path, span, "span_power", 1e-9, 1.0)
    _number(path, span, "backward_factor", 0.0)
    _number(path, span, "forward_factor", 0.0)
    try:
        geometry.power_params(search_power=span.get("search_power"), inv_search_power_int=span.get("inv_search_power_int"))
    except (TypeError, ValueError) as err:
        field = "search_power" if "search_power" in span else "inv_search_power_int"
        raise _fail(path, _line(span, field), str(err)) from err
    problems = document.get("problems")
    if not isinstance(problems, list) or not problems:
        raise _fail(path, _line(document, "problems"), "'problems' must be a non-empty list")
    entries = []
    for item in problems:
        line = item.get("__line__") if isinstance(item, dict) else None
        kinds = list(_strip(item)) if isinstance(item, dict) else []
        if len(kinds) != 1 or kinds[0] not in KINDS or not isinstance(item[kinds[0]], dict):
            raise _fail(path, line, f"each problem must be one of {sorted(KINDS)} with a mapping of sizes, got {item!r}")
        kind, sizes = kinds[0], item[kinds[0]]
        allowed = KINDS[kind]
        _known_fields(path, sizes, kind, allowed)
        for field in allowed:
            if field == "mask" and field in sizes:
                sizes[field] = _mask_kinds(path, sizes)
            elif field in TEXT_SIZES:
                _op_name(path, sizes, field)
            elif field in sizes or field not in OPTIONAL_SIZES:
                _int(path, sizes, field)
        if kind == "layer_prefill" and sizes["chunk"] > sizes["keys"]:
            raise _fail(path, _line(sizes, "chunk"), "layer_prefill: 'chunk' must be <= 'keys' (the chunk's keys are among them)")
        if kind == "decode" and sizes.get("cache") and sizes["cache"] < sizes["context"]:
            raise _fail(path, _line(sizes, "cache"), "decode: 'cache' must be >= 'context'")
        if kind == "decode" and "cache" in sizes and "mask" in sizes:
            raise _fail(path, _line(sizes, "mask"), "decode: 'mask' is for a full context; a static cache's mask is its filled prefix")
        entries.append({"kind": kind, "sizes": _strip(sizes)})
    return Workload(name, path, _strip(model), _strip(span), tuple(entries))
