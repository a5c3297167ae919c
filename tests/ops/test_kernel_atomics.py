"""Source checks of the Triton kernels' atomics (no GPU, no interpreter: the interpreter ignores memory orders)."""

from __future__ import annotations

import ast
from pathlib import Path

import superlinear_ops

PACKAGE = Path(superlinear_ops.__file__).parent
ATOMICS = {"atomic_add", "atomic_max", "atomic_min", "atomic_xchg", "atomic_cas", "atomic_and", "atomic_or", "atomic_xor"}


def atomic_calls() -> list[tuple[str, int, dict[str, str]]]:
    """(file, line, {keyword: source}) of every ``tl.atomic_*`` call in the package."""
    calls = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ATOMICS:
                keywords = {k.arg: ast.get_source_segment(source, k.value) for k in node.keywords}
                calls.append((str(path.relative_to(PACKAGE)), node.lineno, keywords))
    return calls


def test_every_triton_atomic_names_its_memory_order() -> None:
    """Triton's default order is acquire-release, which an fp32 sum never needs and which costs
    several times the relaxed order's time. Each
    atomic says its order; only a counter that publishes other programs' writes may ask for more."""
    calls = atomic_calls()
    assert len(calls) >= 8, f"expected the package's atomics, found {len(calls)}"
    unnamed = [f"{f}:{line}" for f, line, kw in calls if "sem" not in kw]
    assert not unnamed, f"atomics without sem= (Triton's default is acq_rel): {unnamed}"
    ordered = [(f, kw["sem"]) for f, _, kw in calls if kw["sem"] != '"relaxed"']
    assert ordered == [("ops/staged_decode/grouped_kernels.py", '"acq_rel"'), ("ops/staged_decode/split_keys_kernels.py", '"acq_rel"')], (
        f"only the decodes' finished-program counters order memory (acq_rel); found {ordered}")
