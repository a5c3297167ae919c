"""The hash a tuned entry's validity follows: the code a variant actually runs.

Starting from a variant's launcher, every function, class and Triton kernel of this package that
it reaches (by name, attribute of a package module, import inside a function body, closure cell or
``functools.partial``) is hashed as its source tokens without comments, docstrings and whitespace,
together with the package-level constants it reads. Comments, docstrings and formatting do not
change the hash, and neither does the Python version (the shipped caches are tuned under one and
used under others); any change to code that runs does, and only for the variants that reach it.
Where the code lives does not enter it: no module name, and an ``import`` inside a function body
counts by the names it binds, not the module it reads them from, so moving code between modules
keeps every tuned entry current.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import io
import re
import textwrap
import tokenize
import types
from collections.abc import Iterator

PACKAGE = __name__.split(".")[0]
_CONSTANTS = (int, float, str, bool, bytes, tuple, frozenset, type(None))


def _in_package(obj: object) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module == PACKAGE or module.startswith(PACKAGE + ".")


def _python_function(obj: object) -> object:
    """The Python function behind a Triton JIT function (or ``obj`` itself)."""
    return getattr(obj, "fn", obj) if type(obj).__module__.startswith("triton") else obj


_SKIPPED_TOKENS = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                   tokenize.ENCODING, tokenize.ENDMARKER}


def _docstring_starts(tree: ast.AST) -> set[tuple[int, int]]:
    starts = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                starts.add((first.lineno, first.col_offset))
    return starts


def _import_paths(tree: ast.AST) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Where each ``from MODULE import`` of ``tree`` names its module: from ``from`` up to ``import``."""
    return [((node.lineno, node.col_offset), (node.lineno, node.col_offset + len("from") + 1 + node.level + len(node.module or "")))
            for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]


@functools.lru_cache(maxsize=None)
def _source(obj: object) -> tuple[str, ast.AST]:
    """(normalised source, syntax tree) of ``obj``: its tokens' text without comments, docstrings
    and any whitespace."""
    source = textwrap.dedent(inspect.getsource(obj))
    tree = ast.parse(source)
    docstrings = _docstring_starts(tree)
    import_paths = _import_paths(tree)
    lines = source.splitlines(keepends=True)
    kept = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in _SKIPPED_TOKENS or (token.type == tokenize.STRING and token.start in docstrings):
            continue
        if any(start <= token.start < end for start, end in import_paths):
            continue
        (row, col), (end_row, end_col) = token.start, token.end
        text = lines[row - 1][col:end_col] if row == end_row else (
            lines[row - 1][col:] + "".join(lines[row:end_row - 1]) + lines[end_row - 1][:end_col])
        kept.append(text)
    return re.sub(r"\s+", "", "".join(kept)), tree


def _namespace(obj: object) -> dict:
    return getattr(obj, "__globals__", None) or vars(inspect.getmodule(obj))


def _imported(node: ast.ImportFrom, obj: object) -> Iterator[object]:
    """The objects an ``import`` inside a function body brings in."""
    base = inspect.getmodule(obj).__name__.rsplit(".", 1)[0] if node.level else ""
    for _ in range(max(node.level - 1, 0)):
        base = base.rsplit(".", 1)[0]
    name = ".".join(part for part in (base, node.module) if part)
    if name.split(".")[0] != PACKAGE:
        return
    module = importlib.import_module(name)
    for alias in node.names:
        yield getattr(module, alias.name, None) or importlib.import_module(f"{name}.{alias.name}")


def _references(obj: object) -> Iterator[object]:
    """What ``obj``'s code names: globals, attributes of package modules, in-body imports, closures.
    A name an in-body import binds is that import's object, never a module global of the same name."""
    namespace = _namespace(obj)
    tree = _source(obj)[1]
    imported = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in namespace and node.id not in imported:
            yield namespace[node.id]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module = namespace.get(node.value.id)
            if isinstance(module, types.ModuleType) and module.__name__.startswith(PACKAGE):
                yield getattr(module, node.attr, None)
        elif isinstance(node, ast.ImportFrom):
            yield from _imported(node, obj)
    for cell in getattr(obj, "__closure__", None) or ():
        yield cell.cell_contents


def _digest_into(digest, obj: object, seen: set[int]) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, functools.partial):
        for name, arg in (*enumerate(obj.args), *sorted(obj.keywords.items())):
            digest.update(repr(name).encode())
            if isinstance(arg, _CONSTANTS):
                digest.update(repr(arg).encode())
            else:
                _digest_into(digest, arg, seen)
        _digest_into(digest, obj.func, seen)
        return
    target = _python_function(obj)
    if not (inspect.isfunction(target) or inspect.isclass(target)) or not _in_package(target):
        return
    digest.update(_source(target)[0].encode())
    for ref in _references(target):
        if isinstance(ref, _CONSTANTS):
            digest.update(repr(ref).encode())
        elif not isinstance(ref, types.ModuleType):
            _digest_into(digest, ref, seen)


def code_hash(*entry_points: object) -> str:
    """sha256 (16 hex digits) of the package code reachable from ``entry_points`` (see the module)."""
    digest = hashlib.sha256()
    seen: set[int] = set()
    for obj in entry_points:
        _digest_into(digest, obj, seen)
    return digest.hexdigest()[:16]
