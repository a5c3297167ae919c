"""Per-architecture limits, and which declared configurations cannot run on which GPU generation.

The shipped table (``arch_table.json``, written by ``superlinear-ops archcheck``, see
``arch_compile``) holds, per covered variant, kernel part, tile configuration and architecture,
the resources of the compiled kernel. ``compiled_reason`` turns it into a reason when a
configuration exceeds its architecture's limits; a variant whose code hash differs from the
table's is stale: a warning (once per variant) and the static estimates alone decide.

Limits (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability"; the
opt-in maximum shared memory per block, what Triton's launcher compares against): sm_80 and
sm_87 163 KB, sm_86 / sm_89 / sm_120 99 KB, sm_90 and sm_100 227 KB; 64K 32-bit registers per SM
and per block, 255 per thread; 512 tensor-memory columns per SM on sm_100.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import resources

log = logging.getLogger(__name__)

TABLE_FORMAT = 1
TABLE_FILE = "arch_table.json"
REGISTERS_PER_THREAD = 255
REGISTERS_PER_BLOCK = 65536
TMEM_COLUMNS = 512
SPILL_LIMIT_BYTES = 1024  # spill stores per thread above which a configuration runs too slowly to try


@dataclass(frozen=True)
class ArchLimits:
    """What one thread block may use on an architecture."""

    shared_bytes: int
    tmem_columns: int = 0


ARCH_LIMITS: dict[str, ArchLimits] = {
    "sm_80": ArchLimits(166912), "sm_86": ArchLimits(101376), "sm_89": ArchLimits(101376),
    "sm_90": ArchLimits(232448), "sm_100": ArchLimits(232448, TMEM_COLUMNS), "sm_120": ArchLimits(101376),
}


@dataclass(frozen=True)
class Resources:
    """A compiled kernel's resources (or its compile error)."""

    shared: int = 0
    registers: int = 0
    spills: int = 0
    tmem: int = 0
    threads: int = 0
    error: str | None = None

    def encode(self) -> list | str:
        """The table's form: [shared, registers, spills, tmem, threads], or the error."""
        return self.error if self.error is not None else [self.shared, self.registers, self.spills, self.tmem, self.threads]

    @classmethod
    def decode(cls, value: list | str) -> "Resources":
        """Inverse of ``encode``."""
        if isinstance(value, str):
            return cls(error=value)
        return cls(*value)

    def misfit(self, arch: str) -> str | None:
        """Why this kernel cannot run (or runs far too slowly) on ``arch``; None when it fits."""
        if self.error is not None:
            return f"does not compile: {self.error}"
        limits = ARCH_LIMITS[arch]
        if self.shared > limits.shared_bytes:
            return f"needs {self.shared} bytes of shared memory > {limits.shared_bytes} per block"
        if self.tmem > limits.tmem_columns and self.tmem:
            return f"needs {self.tmem} tensor-memory columns > {limits.tmem_columns}"
        if self.registers * self.threads > REGISTERS_PER_BLOCK:
            return f"needs {self.registers} registers x {self.threads} threads > {REGISTERS_PER_BLOCK} per block"
        if self.spills > SPILL_LIMIT_BYTES:
            return f"spills {self.spills} bytes per thread ({self.registers} registers; limit {SPILL_LIMIT_BYTES})"
        return None


def table_key(dtype: str, block_d: int) -> str:
    """The problem class a table serves: element size and padded head dim, e.g. '16bit/d128'."""
    return f"{'32' if dtype == 'float32' else '16'}bit/d{block_d}"


@functools.lru_cache(maxsize=None)
def shipped_table() -> dict:
    """The table shipped in the package (empty when it is missing or unreadable: static checks only)."""
    try:
        text = resources.files(__package__).joinpath(TABLE_FILE).read_text(encoding="utf-8")
        table = json.loads(text)
    except (OSError, ValueError) as err:
        log.warning("no usable per-architecture table (%s): static resource estimates only", err)
        return {}
    return table if table.get("format") == TABLE_FORMAT else {}


_TABLE: list[dict | None] = [None]  # an override (tests); None: the shipped table
_STALE_WARNED: set[str] = set()


def use_table(table: dict | None) -> None:
    """Check against ``table`` instead of the shipped one (None: the shipped one again)."""
    _TABLE[0] = table
    _STALE_WARNED.clear()
    _current_entry.cache_clear()


def _table() -> dict:
    return _TABLE[0] if _TABLE[0] is not None else shipped_table()


@functools.lru_cache(maxsize=None)
def _current_entry(variant: str, code_hash: str) -> dict | None:
    entry = _table().get("variants", {}).get(variant)
    if entry is None:
        return None
    if entry.get("code_hash") != code_hash:
        if variant not in _STALE_WARNED:
            _STALE_WARNED.add(variant)
            warnings.warn(
                f"the per-architecture table is stale for {variant} (code hash {entry.get('code_hash')}, the code is "
                f"{code_hash}): static resource estimates only; regenerate it with `superlinear-ops archcheck`",
                RuntimeWarning, stacklevel=3,
            )
        return None
    return entry


def _block_d(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


TC_TUNABLES = ("block_m", "block_n", "warps", "stages")  # what each part of a covered variant reads: f"{part}_{name}"


def config_key(tiles: Iterable[object]) -> str:
    """'64/64/4/3': a part's (block_m, block_n, warps, stages) as the table keys them."""
    return "/".join(map(str, tiles))


def part_tiles(part: str, config: Mapping[str, int]) -> str:
    """``config_key`` of ``part``'s tiles in ``config``."""
    return config_key(config.get(f"{part}_{name}") for name in TC_TUNABLES)


def compiled_reason(variant, problem, config: Mapping[str, int], parts: tuple[str, ...] | None = None) -> str | None:
    """Why ``config`` of ``variant`` cannot run on ``problem``'s GPU, from the compiled table (only
    ``parts`` when given); None when it fits, or when the table does not cover this arch, problem
    class, variant or code."""
    arch = problem.device.arch
    if not covers(variant, problem):
        return None
    for part, data in _current_entry(variant.qualified_name, variant.code_hash)["parts"].items():
        if parts is not None and part not in parts:
            continue
        tiles = part_tiles(part, config)
        for kernel, value in zip(data["kernels"], data["results"].get(arch, {}).get(tiles) or ()):
            misfit = Resources.decode(value).misfit(arch)
            if misfit is not None:
                return f"{arch}: {part} tiles {tiles}: {kernel} {misfit} (compiled ahead of time)"
    return None


def compiled_part_reason(variant_name: str, part: str, problem, config: Mapping[str, int]) -> str | None:
    """``compiled_reason`` for one part of the variant named ``variant_name`` ('op/name'; '' for none)."""
    if not variant_name or not problem.device.is_gpu:
        return None
    from .registry import REGISTRY

    op, name = variant_name.split("/")
    return compiled_reason(REGISTRY.get(op, name), problem, config, (part,))


def covers(variant, problem) -> bool:
    """True when the compiled table decides for ``variant`` on ``problem``'s arch and problem class."""
    table = _table()
    return (problem.device.arch in ARCH_LIMITS and problem.device.arch in table.get("archs", ())
            and table.get("key") == table_key(problem.dtype, _block_d(problem.head_dim))
            and _current_entry(variant.qualified_name, variant.code_hash) is not None)


def with_compiled(static: Callable, variant_name: str, problem, config: Mapping[str, int]) -> str | None:
    """A compile check: the compiled table's verdict for ``variant_name`` ('op/name') on the problem's
    arch (named in its reason), else the static estimate ``static(problem, config)``; a configuration
    runs only when both accept it."""
    reason = static(problem, config)
    if not problem.device.is_gpu:
        return reason
    from .registry import REGISTRY

    op, name = variant_name.split("/")
    return compiled_reason(REGISTRY.get(op, name), problem, config) or reason


def summary(variant, problem) -> list[str]:
    """Readable lines: how many of ``variant``'s declared configurations cannot run on ``problem``'s
    GPU, grouped by cause in plain words, each with one real reason as its example; empty when all
    can (or the variant has no space)."""
    if not variant.space:
        return []
    bad = variant.unrunnable(problem)
    if not bad:
        return []
    total = sum(1 for _ in variant.configs())
    source = "compiled ahead of time" if covers(variant, problem) else "static estimates"
    causes: dict[str, list[str]] = {}
    for config, reason in bad:
        reason = reason.split(" (compiled")[0]
        causes.setdefault(cause_of(reason), []).append(reason)
    lines = [f"{len(bad)} of {total} declared configurations cannot run on {problem.device.arch} ({source}):"]
    for cause, reasons in sorted(causes.items(), key=lambda item: (-len(item[1]), item[0])):
        lines.append(f"  {len(reasons)}: {cause}; e.g. {min(reasons)}")
    return lines


CAUSES = (  # (words in a reason, its cause in plain words): the first match names it
    ("does not compile", "the kernel does not compile"),
    ("spills", "the compiled kernel spills registers to local memory"),
    ("tensor-memory", "the compiled kernel needs more tensor-memory columns than the GPU has"),
    ("registers x", "the compiled kernel needs more registers than a thread block has"),
    ("bytes of shared memory", "the compiled kernel needs more shared memory than a thread block has"),
    ("shared memory", "its tiles would need more shared memory than a thread block has"),
    ("registers", "its tiles would hold more values per thread than fit in registers"),
    ("tensor-core dot needs", "its dot would have fewer than 16 rows or columns"),
    ("heads already fill", "it takes several queries where 16 heads already fill the dot"),
    ("query heads of a KV group", "it takes more heads than a KV group has"),
    ("a merge program holds", "it splits the keys more ways than one merge program holds"),
)


def cause_of(reason: str) -> str:
    """A reason's cause in plain words, naming the kernel part (window, span) it concerns; a reason
    of no known kind is its own cause."""
    words = next((cause for key, cause in CAUSES if key in reason), reason)
    part = re.match(r"(?:sm_\w+: )?(window|span) ", reason)
    return f"{part[1]} part: {words}" if part and words != reason else words
