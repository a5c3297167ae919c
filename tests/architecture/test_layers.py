"""The package's layers point one way: base -> ops -> stores -> dispatcher -> torch ops -> public
API -> CLI and tuner. Every import counts, at module level or inside a function (only imports for
type checking are left out); a module imports from its own layer or below, and no import cycle exists."""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = "superlinear_ops"
LAYERS = (  # lowest first; a module belongs to the first layer one of whose prefixes it matches
    ("base", ("version", "problem", "registry", "launch", "code_hash", "geometry", "settings", "buckets", "devices",
              "validation", "arch_check", "cache.schema")),
    ("ops", ("ops",)),
    ("stores", ("cache.entry", "cache.store", "cache.yaml_file", "cache.provenance", "cache.validity")),
    ("dispatcher", ("dispatch", "cache.layers")),
    ("torch ops", ("torch_ops",)),
    ("public API", ("api", "layer_api", "patch", "precompile", "")),  # "": the package itself
    ("CLI and tuner", ("cli", "tuner", "arch_compile", "demo", "cache.commands", "cache")),
)


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        parts = path.relative_to(ROOT / PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _layer(module: str) -> int:
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or (prefix and module.startswith(prefix + ".")):
                return index
    raise AssertionError(f"{PACKAGE}.{module} belongs to no layer: add it to LAYERS")


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, child.end_lineno + 1))
    return lines


def _imports(module: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The package modules ``module`` imports (a name imported from a package counts as its submodule
    where there is one, else as the package)."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_lines(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if node.lineno in skipped if hasattr(node, "lineno") else False:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == PACKAGE or node.module.startswith(PACKAGE + ".")):
                target = node.module.removeprefix(PACKAGE).lstrip(".")
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}".lstrip(".")
                found.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    found.add(alias.name.removeprefix(PACKAGE + "."))
    return found - {module}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_nothing_imports_from_a_higher_layer() -> None:
    upward = sorted(
        f"{module} ({LAYERS[_layer(module)][0]}) imports {target} ({LAYERS[_layer(target)][0]})"
        for module, targets in _graph().items() for target in targets if _layer(target) > _layer(module)
    )
    assert not upward, "\n".join(upward)


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join(trail[trail.index(target):] + [node, target]) if target in trail else f"{node} -> {target}")
            elif target not in state:
                visit(target, trail + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("module", sorted(_modules()))
def test_modules_stay_readable_in_one_sitting(module: str) -> None:
    lines = len(_modules()[module].read_text().splitlines())
    assert lines <= 450, f"{module}: {lines} lines"


def test_the_check_finds_a_planted_upward_import_and_cycle(tmp_path, monkeypatch) -> None:
    """The walk sees imports inside function bodies: a planted one from the ops up to the dispatcher
    is both an upward import and a cycle (the dispatcher imports the registry, the registry is filled from the ops)."""
    planted = tmp_path / PACKAGE
    for path in (ROOT / PACKAGE).rglob("*.py"):
        target = planted / path.relative_to(ROOT / PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    rules = planted / "ops" / "rules.py"
    rules.write_text(rules.read_text() + "\n\ndef planted() -> None:\n    from ..dispatch import select  # noqa: F401\n")
    dispatch = planted / "dispatch.py"
    dispatch.write_text(dispatch.read_text() + "\n\ndef planted() -> None:\n    from .ops import rules  # noqa: F401\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="ops.rules .ops. imports dispatch .dispatcher."):
        test_nothing_imports_from_a_higher_layer()
    with pytest.raises(AssertionError, match="dispatch -> ops.rules"):
        test_no_import_cycles()
