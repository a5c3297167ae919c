"""The runtime dispatcher: which variant and configuration serve a problem, and why.

``select(problem)`` walks the lookup layers (tuned caches, in order), then falls back to the first
supported variant's heuristic default. Layers are asked for the problem's own key first, then for
keys within ``NEAREST_DISTANCE`` buckets; when none holds an entry for this GPU, the same walk
borrows entries tuned on another GPU of the same architecture.

Borrowing rule: an entry of the own key always serves. A neighbouring bucket's entry serves only
when it was tuned on the same kind of problem: masked or not (exact in every key) and the context
kind, ``FULL_CONTEXT`` (the keys are the context) or ``STATIC_CACHE`` (a cache allocation tuned over
the fills a replayed graph sees). A call cannot see how much of its cache is filled (that is on
the device), so every lookup is of a full context: a static-cache entry never serves a neighbour,
and when no same-kind entry is found the heuristic default serves. ``explain`` names the rule. Every rule consulted reads the
problem at its bucket's sizes (``bucketed``), so the answer depends on the key alone and is
memoised per key: after the first call for a key no layer, file or lock is touched, nothing
synchronises the device, and the call is safe during CUDA graph capture and from many threads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol

from .buckets import NEAREST_DISTANCE, ProblemKey, bucketed, key_of, neighbours
from .launch import KernelConfig
from .problem import Problem
from .registry import REGISTRY, Registry, Variant

HEURISTIC = "heuristic default"
FULL_CONTEXT = "full context"  # the problem's keys are its context
STATIC_CACHE = "static cache"  # a cache allocation, partly filled; tuned over several fills
CONTEXT_KINDS = (FULL_CONTEXT, STATIC_CACHE)
RULE_OWN = "own key"
RULE_NEIGHBOUR = "nearest bucket of the same kind"
RULE_HEURISTIC = "heuristic default (no entry for the own key, none of the same kind in a neighbouring bucket)"


def problem_kind(masked: bool, context: str = FULL_CONTEXT) -> str:
    """The kind of a problem or entry, e.g. 'masked full context'; ValueError for an unknown context."""
    if context not in CONTEXT_KINDS:
        raise ValueError(f"context must be one of {CONTEXT_KINDS}, got {context!r}")
    return f"{'masked' if masked else 'unmasked'} {context}"


@dataclass(frozen=True)
class TunedChoice:
    """What a layer stores for a key: a variant name, its configuration, and the context kind of the
    problem it was tuned on (``FULL_CONTEXT`` or ``STATIC_CACHE``)."""

    variant: str
    config: KernelConfig
    context: str = FULL_CONTEXT

    def __post_init__(self) -> None:
        problem_kind(False, self.context)  # ValueError naming an unknown context


@dataclass(frozen=True)
class LayerAnswer:
    """A layer's reply for one key: a choice, or None with a note saying why not."""

    choice: TunedChoice | None
    note: str
    lender: str | None = None  # the GPU an entry borrowed from another GPU of this architecture was tuned on


class Layer(Protocol):
    """A source of tuned choices (a cache store, a shipped file, ...)."""

    name: str

    def lookup(self, key: ProblemKey, borrow: bool = False) -> LayerAnswer:
        """The stored choice for ``key`` (with ``borrow``: one tuned on another GPU of the key's
        architecture), or a miss with a note."""
        ...


@dataclass(frozen=True)
class Choice:
    """The dispatcher's decision: variant, configuration, and where it came from."""

    variant: Variant
    config: KernelConfig
    source: str


@dataclass
class Explanation:
    """Everything the dispatcher considered for one problem."""

    key: ProblemKey
    variants: list[tuple[str, list[str]]] = field(default_factory=list)
    layers: list[tuple[str, str]] = field(default_factory=list)
    choice: Choice | None = None
    rule: str = ""  # which borrowing rule decided (RULE_OWN, RULE_NEIGHBOUR or RULE_HEURISTIC)

    def text(self) -> str:
        """A readable report."""
        lines = [f"key: {self.key.text()}", f"kind: {problem_kind(self.key.masked)}", "variants (in priority order):"]
        for name, reasons in self.variants:
            lines.append(f"  {name}: {'applies' if not reasons else 'not supported: ' + '; '.join(reasons)}")
        lines.append("layers consulted:")
        lines.extend(f"  {name}: {note}" for name, note in self.layers) if self.layers else lines.append("  (none)")
        if self.choice is None:
            lines.append("choice: none (no variant applies)")
        else:
            c = self.choice
            lines.append(f"choice: {c.variant.qualified_name} {c.config.text()} (source: {c.source})")
            lines.append(f"rule: {self.rule}")
        return "\n".join(lines)


def _key(problem: Problem) -> ProblemKey:
    """``key_of(problem)``; a malformed problem raises its field's ValueError/TypeError instead."""
    try:
        return key_of(problem)
    except (AttributeError, TypeError):
        problem.check()
        raise


class NoVariantError(ValueError):
    """No registered variant applies to a problem."""


class Dispatcher:
    """Chooses variants for problems; see the module docstring."""

    def __init__(self, registry: Registry = REGISTRY, layers: list[Layer] | None = None) -> None:
        self.registry = registry
        self.layers: list[Layer] = list(layers or [])
        self.resolutions = 0  # slow-path resolutions (memo misses), for tests and logs
        self._memo: dict[ProblemKey, Choice] = {}
        self._lock = threading.Lock()

    def select(self, problem: Problem) -> Choice:
        """The variant and configuration for ``problem`` (memoised per key)."""
        key = _key(problem)
        choice = self._memo.get(key)
        if choice is None:
            with self._lock:
                choice = self._memo.get(key)
                if choice is None:
                    choice = self._resolve(bucketed(problem.check()), key, Explanation(key)).choice
                    self.resolutions += 1
                    self._memo[key] = choice
        return choice

    def explain(self, problem: Problem) -> Explanation:
        """What ``select`` would decide for ``problem`` and why (consults the layers afresh)."""
        key = _key(problem)
        try:
            return self._resolve(bucketed(problem.check()), key, Explanation(key))
        except NoVariantError as err:
            return err.args[1]

    def set_layers(self, layers: list[Layer]) -> None:
        """Replace the lookup layers and forget every memoised choice."""
        with self._lock:
            self.layers = list(layers)
            self._memo.clear()

    def clear(self) -> None:
        """Forget every memoised choice (after the registry or the layers changed)."""
        with self._lock:
            self._memo.clear()

    def _resolve(self, problem: Problem, key: ProblemKey, trace: Explanation) -> Explanation:
        supported: dict[str, Variant] = {}
        for variant in self.registry.variants(problem.op):
            reasons = variant.not_supported_reasons(problem)
            trace.variants.append((variant.name, reasons))
            if not reasons:
                supported[variant.name] = variant
        if not supported:
            details = "; ".join(f"{name}: {', '.join(r)}" for name, r in trace.variants)
            raise NoVariantError(f"no {problem.op} variant applies to this input ({details})", trace)
        candidates = [(0, key)] + neighbours(key, NEAREST_DISTANCE)
        wanted = problem_kind(key.masked)
        for borrow in (False, True):
            for layer in self.layers:
                for distance, candidate in candidates:
                    answer = layer.lookup(candidate, borrow=borrow)
                    where = "own key" if distance == 0 else f"nearest bucket {candidate.text()} (distance {distance})"
                    if borrow:
                        where += f", other {key.arch} GPUs"
                    if answer.choice is None:
                        if distance == 0:
                            trace.layers.append((layer.name, f"miss ({where}): {answer.note}"))
                        continue
                    problem_with_it = self._usable(answer.choice, supported, problem)
                    kind = problem_kind(candidate.masked, answer.choice.context)
                    if problem_with_it is None and distance and kind != wanted:
                        problem_with_it = f"an entry of a {kind} problem is not borrowed for a {wanted} one"
                    if problem_with_it is not None:
                        trace.layers.append((layer.name, f"skipped {where}: {problem_with_it}"))
                        continue
                    source = layer.name if distance == 0 else f"{layer.name}, {where}"
                    if answer.lender is not None:
                        source += f", borrowed from {answer.lender}"
                    trace.layers.append((layer.name, f"hit ({where}): {answer.choice.variant} ({kind} entry)"))
                    trace.choice = Choice(supported[answer.choice.variant], answer.choice.config, source)
                    trace.rule = RULE_OWN if distance == 0 else f"{RULE_NEIGHBOUR} ({kind}, distance {distance})"
                    if borrow:
                        trace.rule += f", tuned on {answer.lender}"
                    return trace
        variant = next(iter(supported.values()))
        trace.choice = Choice(variant, variant.default(problem), HEURISTIC)
        trace.rule = RULE_HEURISTIC
        return trace

    @staticmethod
    def _usable(choice: TunedChoice, supported: dict[str, Variant], problem: Problem) -> str | None:
        variant = supported.get(choice.variant)
        if variant is None:
            return f"variant {choice.variant} is not registered or does not apply"
        return variant.violation(choice.config) or variant.compile_check(problem, choice.config)


DISPATCHER = Dispatcher()


def select(problem: Problem, block_k: int | None = None) -> Choice:
    """The default dispatcher's choice for ``problem``; ``block_k`` (when given) forces the key-block
    size of variants that have one (a hint: others ignore it)."""
    choice = DISPATCHER.select(problem)
    if block_k is None or choice.config.get("block_k", block_k) == block_k:
        return choice
    return Choice(choice.variant, choice.config.replace(block_k=block_k), f"{choice.source}, block_k forced")


def explain(problem: Problem) -> Explanation:
    """The default dispatcher's explanation for ``problem``."""
    return DISPATCHER.explain(problem)
