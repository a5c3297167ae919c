"""The ops registry: every kernel variant of every op, its tunable space, and when it applies.

A variant declares (each op's ``variants`` module under ``ops/`` holds its declarations, one block each):
- ``launch``: the callable that runs it (its signature is the op's, see the op's ``variants``); the
  code it reaches is what a tuned entry's validity follows (``code_hash``);
- ``space``: its own tunable compile-time parameters by name, each with its candidate values, and
  ``constraints`` between them; a configuration is a ``KernelConfig`` of exactly those names;
- ``reasons(problem)``: why it does not apply to a problem (empty: it applies);
- ``compile_check(problem, config)``: why a configuration cannot build or launch well on the
  problem's device (shared memory or register estimate, and for the variants ``arch_check``
  covers, the resources of the kernels compiled ahead of time for that architecture), before
  anything is launched; ``unrunnable(problem)`` lists every such configuration with its reason;
- ``default(problem)``: the heuristic configuration used when nothing tuned is known;
- ``priority``: lower is preferred when the dispatcher falls back to defaults;
- ``baseline``: kept for comparison and as a fallback where faster variants do not apply; the
  tuner searches baselines only for problems that no other variant serves;
- ``compiled_parts``: for variants whose kernels ``superlinear-ops archcheck`` compiles ahead of
  time, each kernel part (the tunables it reads are ``{part}_{name}``) and its ``KernelSpec``s.
The tuner searches what is declared here and the dispatcher chooses from it. Each op is declared
first by its spec (``ops.spec.OpSpec``, ``add_op``): what the tuner, bench, verify and warm-up know of it.
``ops.register_builtin`` declares the library's ops and variants.
"""

from __future__ import annotations

import functools
import importlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .code_hash import code_hash
from .launch import KernelConfig

if TYPE_CHECKING:  # the problem module checks ops through the registry
    from .problem import Problem


@dataclass(frozen=True)
class KernelSpec:
    """One Triton kernel of a variant's part, compiled ahead of time: its module, its name, and its
    compile-time values from the part's (block_m, block_n) and the padded head dim."""

    module: str
    name: str
    constexprs: Callable[[int, int, int], dict]  # (block_m, block_n, block_d) -> constexprs

    def kernel(self):
        """The ``triton.jit`` function."""
        return getattr(importlib.import_module(self.module), self.name)


@dataclass(frozen=True)
class Param:
    """One tunable compile-time parameter and its candidate values."""

    name: str
    values: tuple[int, ...]


@dataclass(frozen=True)
class Variant:
    """One kernel variant of one op (see the module docstring)."""

    op: str
    name: str
    launch: Callable
    space: tuple[Param, ...]
    reasons: Callable[[Problem], list[str]]
    compile_check: Callable[[Problem, KernelConfig], str | None]
    default: Callable[[Problem], KernelConfig]
    priority: int
    description: str = ""
    constraints: tuple[Callable[[KernelConfig], str | None], ...] = ()
    baseline: bool = False
    compiled_parts: dict[str, tuple[KernelSpec, ...]] = field(default_factory=dict, compare=False)

    @property
    def qualified_name(self) -> str:
        """'op/variant'."""
        return f"{self.op}/{self.name}"

    @property
    def code_hash(self) -> str:
        """Hash of the code this variant runs (comments and docstrings excluded)."""
        return _launch_hash(self.launch)

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        """Readable reasons why this variant does not apply to ``problem`` (empty: it applies)."""
        if problem.op != self.op:
            return [f"{self.qualified_name} serves op {self.op}, not {problem.op}"]
        return list(self.reasons(problem))

    def unrunnable(self, problem: Problem) -> list[tuple[KernelConfig, str]]:
        """Every declared configuration that cannot build or run on ``problem``'s GPU, with the compile
        check's reason (per architecture: the compiled table of ``arch_check`` where it covers the variant)."""
        return [(config, reason) for config in self.configs() if (reason := self.compile_check(problem, config)) is not None]

    def configs(self) -> Iterator[KernelConfig]:
        """Every configuration of the declared space that meets the declared constraints."""
        names = [p.name for p in self.space]
        for values in itertools.product(*(p.values for p in self.space)):
            config = KernelConfig(dict(zip(names, values)))
            if self.violation(config) is None:
                yield config

    def violation(self, config: KernelConfig) -> str | None:
        """Why ``config`` is not one of this variant's configurations (None when it is)."""
        names = {p.name for p in self.space}
        if set(config) != names:
            return f"parameters {sorted(config)} are not this variant's {sorted(names)}"
        for p in self.space:
            if config[p.name] not in p.values:
                return f"{p.name}={config[p.name]} is not one of {p.values}"
        for constraint in self.constraints:
            reason = constraint(config)
            if reason is not None:
                return reason
        return None

    def contains(self, config: KernelConfig) -> bool:
        """True when ``config`` is one of this variant's configurations."""
        return self.violation(config) is None


@functools.lru_cache(maxsize=None)
def _launch_hash(launch: Callable) -> str:
    return code_hash(launch)


class Registry:
    """Op specs, and each op's variants in priority order."""

    def __init__(self) -> None:
        self._specs: dict[str, object] = {}  # op name -> its ops.spec.OpSpec
        self._variants: dict[str, dict[str, Variant]] = {}

    @property
    def ops(self) -> tuple[str, ...]:
        """The declared ops, in declaration order."""
        return tuple(self._specs)

    def add_op(self, spec) -> None:
        """Declare an op by its spec (``ops.spec.OpSpec``); its name must be new."""
        if spec.name in self._specs:
            raise ValueError(f"op {spec.name!r} is already declared")
        self._specs[spec.name] = spec
        self._variants[spec.name] = {}

    def remove_op(self, op: str) -> None:
        """Withdraw an op and its variants (tests use this to withdraw what they planted)."""
        self._check(op)
        del self._specs[op], self._variants[op]

    def spec(self, op: str):
        """The spec of ``op`` (``ops.spec.OpSpec``)."""
        self._check(op)
        return self._specs[op]

    def _check(self, op: str) -> None:
        if op not in self._specs:
            raise ValueError(f"unknown op {op!r}; ops are {self.ops}")

    def register(self, variant: Variant) -> Variant:
        """Add a variant; its op must be declared and its name new for that op."""
        self._check(variant.op)
        if variant.name in self._variants[variant.op]:
            raise ValueError(f"variant {variant.qualified_name} is already registered")
        self._variants[variant.op][variant.name] = variant
        return variant

    def unregister(self, op: str, name: str) -> None:
        """Remove a variant (tests use this to withdraw what they planted)."""
        del self._variants[op][name]

    def variants(self, op: str) -> list[Variant]:
        """The variants of ``op``, most preferred first."""
        self._check(op)
        return sorted(self._variants[op].values(), key=lambda v: (v.priority, v.name))

    def get(self, op: str, name: str) -> Variant:
        """The variant ``op/name``."""
        try:
            return self._variants[op][name]
        except KeyError:
            known = ", ".join(v.name for v in self.variants(op))
            raise KeyError(f"no variant {op}/{name}; {op} has: {known}") from None

    def fallback(self, problem: Problem) -> Variant | None:
        """The most preferred variant that applies to ``problem`` (its default serves untuned keys)."""
        return next((v for v in self.variants(problem.op) if not v.not_supported_reasons(problem)), None)

    def reference(self, op: str) -> Variant:
        """The op's PyTorch reference: the variant declared last in priority, which always applies."""
        return self.variants(op)[-1]

    def all(self) -> list[Variant]:
        """Every registered variant, op by op."""
        return [v for op in self.ops for v in self.variants(op)]


REGISTRY = Registry()
