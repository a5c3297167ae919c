"""The Optuna search for one problem: a conditional space (variant, then its parameters) taken from
the registry, uncompilable configurations pruned before launch, every candidate checked and timed
by an ``evaluate`` callable (a worker process: ``worker.CandidateWorker``), the heuristic default
always measured, no configuration benchmarked twice, known failures not retried, resumable studies.
A failed trial carries user attributes ``failure`` (the message) and ``failure_category``."""

from __future__ import annotations

import hashlib
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import optuna
from optuna.trial import TrialState
from sqlalchemy.exc import IntegrityError, OperationalError

from ..buckets import ProblemKey
from ..launch import KernelConfig
from ..problem import Problem
from ..registry import REGISTRY, Variant
from .faults import Failure, Outcome
from .runner import CandidateFailed

log = logging.getLogger(__name__)
SAMPLERS = ("tpe", "random", "exhaustive")
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
INTERRUPTED = "interrupted"  # user attribute of a trial stopped by Ctrl-C: no result, measured again
REFUSED = "pruned"  # trial attribute: why the static check refused the configuration (it never ran)
REFUSALS_PER_TRIAL = 3  # refused configurations a search may draw per counted trial before it stops
EARLIER = "earlier_winner"  # study attribute: the trial parameters of the winner stored when the study began
SIBLING = "sibling_winner"  # study attribute: those of a sibling GPU's winner, measured where EARLIER is None


@dataclass(frozen=True)
class SearchSettings:
    """How hard to search one problem."""

    trials: int | None = 24  # finished trials per problem, not counting refused ones (None: until the space is exhausted)
    timeout_s: float | None = None
    sampler: str = "tpe"
    seed: int = 0
    candidate_timeout_s: float = 300.0  # per candidate (check + time) in the worker; past it the worker is killed

    def __post_init__(self) -> None:
        if not self.candidate_timeout_s > 0:
            raise ValueError(f"candidate_timeout_s must be > 0, got {self.candidate_timeout_s!r}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {self.sampler!r}")
        if self.trials is not None and self.trials < 1:
            raise ValueError(f"trials must be >= 1, got {self.trials}")


def tunable_variants(problem: Problem) -> list[Variant]:
    """The variants that apply to ``problem`` and have something to tune: the non-baseline ones, or
    the baselines when no other variant applies."""
    applicable = [v for v in REGISTRY.variants(problem.op) if v.space and not v.not_supported_reasons(problem)]
    return [v for v in applicable if not v.baseline] or applicable


def params_of(variant: Variant, config: KernelConfig) -> dict:
    """The trial parameters that select ``variant`` with ``config``."""
    return {"variant": variant.name, **{f"{variant.name}.{p.name}": config[p.name] for p in variant.space}}


def default_params(problem: Problem) -> dict:
    """The trial parameters of ``problem``'s default: the fallback variant at its default configuration."""
    variant = REGISTRY.fallback(problem)
    return params_of(variant, variant.default(problem))


def in_space(variant: Variant, values) -> bool:
    """Whether every tunable of ``variant`` takes a value its declared space holds."""
    return all(values.get(p.name) in p.values for p in variant.space)


def variant_default_params(problem: Problem, variants: list[Variant]) -> list[dict]:
    """The trial parameters of each of ``variants``' default configuration that lies in its
    declared space: a short search still measures each variant's heuristic once."""
    defaults = [(v, v.default(problem)) for v in variants]
    return [params_of(v, config) for v, config in defaults if in_space(v, config)]


def earlier_winner_params(problem: Problem, variant_name: str, config: KernelConfig) -> dict | None:
    """The trial parameters of a winner stored for ``problem`` before (perhaps by an older version
    of its code), so that a re-tune measures it again: tunables added since take their default
    values; None when its variant is no longer tunable here or a value left the declared space."""
    variant = next((v for v in tunable_variants(problem) if v.name == variant_name), None)
    if variant is None:
        return None
    values = {**variant.default(problem), **config}
    if not in_space(variant, values):
        return None
    return params_of(variant, KernelConfig({p.name: values[p.name] for p in variant.space}))


def candidate_of(params: dict) -> tuple[str, KernelConfig]:
    """Inverse of ``params_of``: (variant name, configuration)."""
    name = params["variant"]
    values = {k.split(".", 1)[1]: v for k, v in params.items() if k.startswith(f"{name}.")}
    return name, KernelConfig(values)


def make_sampler(settings: SearchSettings) -> optuna.samplers.BaseSampler:
    """The sampler named in ``settings``, seeded."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if settings.sampler == "tpe":
            # Few random start-up trials and more EI candidates suit these small discrete spaces
            # (replayed against exhaustive sweeps: benchmarks/tpe_vs_exhaustive.py).
            return optuna.samplers.TPESampler(
                seed=settings.seed, multivariate=True, group=True, constant_liar=True, n_startup_trials=5,
                n_ei_candidates=48,
            )
        if settings.sampler == "random":
            return optuna.samplers.RandomSampler(seed=settings.seed)
        return optuna.samplers.BruteForceSampler(seed=settings.seed)


def space_fingerprint(op: str) -> str:
    """8 hex digits naming the op's searchable variants as they are now (names, spaces, kernel sources)."""
    digest = hashlib.sha256()
    for variant in REGISTRY.variants(op):
        if variant.space:
            digest.update(f"{variant.name}:{variant.code_hash}:{variant.space};".encode())
    return digest.hexdigest()[:8]


def study_name(key: ProblemKey, settings: SearchSettings) -> str:
    """One study per key and sampler (exhaustive and TPE sweeps of a key stay apart) and per search
    space: a changed kernel or a new variant starts a fresh study instead of resuming stale trials."""
    return f"{key.text()}#{settings.sampler}#{space_fingerprint(key.op)}"


def open_study(storage, key: ProblemKey, settings: SearchSettings, retries: int = 8) -> optuna.Study:
    """Create or load the key's study; tolerant of fresh workers racing to create it."""
    name = study_name(key, settings)
    for attempt in range(retries):
        try:
            return optuna.create_study(
                study_name=name, storage=storage, sampler=make_sampler(settings), direction="minimize",
                load_if_exists=True,
            )
        except (optuna.exceptions.DuplicatedStudyError, IntegrityError, OperationalError) as err:  # creation race
            if attempt == retries - 1:
                raise
            log.debug("study %s: creation raced (%s); retrying", name, err)
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def finished_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Trials that ended (complete, pruned or failed)."""
    return study.get_trials(deepcopy=False, states=FINISHED)


def counted_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The finished trials that count against ``SearchSettings.trials``: all but the configurations
    the static check refused, which cost no GPU time, and the trials Ctrl-C stopped, which measured
    nothing (a resumed run measures them again)."""
    return [t for t in finished_trials(study) if not {REFUSED, INTERRUPTED} & set(t.user_attrs)]


def _stop_after(trials: int) -> Callable[[optuna.Study, optuna.trial.FrozenTrial], None]:
    """An Optuna callback that stops the study (every worker on its storage) at ``trials`` counted trials."""
    def stop(study: optuna.Study, _trial: optuna.trial.FrozenTrial) -> None:
        if len(counted_trials(study)) >= trials:
            study.stop()
    return stop


def _same_params(study: optuna.Study, params: dict, number: int) -> optuna.trial.FrozenTrial | None:
    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)):
        if trial.number != number and trial.params == params and not {"duplicate_of", INTERRUPTED} & set(trial.user_attrs):
            return trial
    return None


def baseline_candidate(study: optuna.Study, problem: Problem) -> tuple[str, KernelConfig] | None:
    """The candidate a resumed study's real-size results compare against: the default when it
    completed, else the first completed trial's (None in a fresh study)."""
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if "duplicate_of" not in t.user_attrs]
    default = default_params(problem)
    chosen = next((t for t in complete if t.params == default), complete[0] if complete else None)
    return None if chosen is None else candidate_of(chosen.params)


def _fail(trial: optuna.Trial, failure: Failure, known: bool = False) -> None:
    """Record ``failure`` on the trial and fail it."""
    trial.set_user_attr("failure", failure.message)
    trial.set_user_attr("failure_category", failure.category)
    if known:
        trial.set_user_attr("known_failure", True)
    raise CandidateFailed(failure.message, failure.category)


def run_search(
    study: optuna.Study,
    problem: Problem,
    evaluate: Callable[[str, KernelConfig], Outcome],
    settings: SearchSettings,
    known: dict[tuple[str, str], Failure] | None = None,
    on_failure: Callable[[str, KernelConfig, Failure], None] | None = None,
    on_trial: Callable[[optuna.trial.FrozenTrial], None] | None = None,
    earlier: dict | None = None,
    sibling: dict | None = None,
) -> None:
    """Run (or resume) the search of one problem until it has ``settings.trials`` counted trials
    (``counted_trials``: a configuration the static check refuses does not count, up to
    ``REFUSALS_PER_TRIAL`` of them per trial still to run).

    The default runs first, then ``earlier`` (trial parameters of a winner stored before, kept on
    the study as ``EARLIER`` when the study begins), then ``sibling`` (a winner measured on another
    GPU of the architecture, stale or not: kept as ``SIBLING``), then every other variant's default,
    each once per study (a queued trial counts). ``known`` failures (by variant and configuration
    text) are recorded failed without running; ``on_failure`` hears of every new failure.
    """
    variants = {v.name: v for v in tunable_variants(problem)}
    if not variants:
        return
    # EARLIER and SIBLING are recorded once, as the study begins (None too): on a resumed run the store may hold
    # this study's own unconfirmed best (an interrupted run stores it), which must not pass for a winner stored before.
    if EARLIER not in study.user_attrs and not study.get_trials(deepcopy=False):
        study.set_user_attr(SIBLING, sibling)
        study.set_user_attr(EARLIER, earlier)  # last: its presence says both are recorded
    # Queued in that order while the trial budget has room: no queued trial outlives this run.
    room = None if settings.trials is None else settings.trials - len(counted_trials(study))
    for params in (default_params(problem), earlier, sibling, *variant_default_params(problem, list(variants.values()))):
        trials = study.get_trials(deepcopy=False)
        if room is not None and sum(t.state == TrialState.WAITING for t in trials) >= room:
            break
        if params is not None and not any(t.system_attrs.get("fixed_params", t.params) == params and INTERRUPTED not in t.user_attrs
                                          for t in trials):
            study.enqueue_trial(params)

    def objective(trial: optuna.Trial) -> float:
        name = trial.suggest_categorical("variant", list(variants))
        variant = variants[name]
        config = KernelConfig({p.name: trial.suggest_categorical(f"{name}.{p.name}", list(p.values)) for p in variant.space})
        reason = variant.violation(config) or variant.compile_check(problem, config)
        if reason is not None:
            trial.set_user_attr(REFUSED, reason)
            raise optuna.TrialPruned(reason)
        earlier = _same_params(study, trial.params, trial.number)
        if earlier is not None:
            trial.set_user_attr("duplicate_of", earlier.number)
            if earlier.state == TrialState.COMPLETE:
                return earlier.value
            raise optuna.TrialPruned(f"same configuration as trial {earlier.number}")
        if (name, config.text()) in (known or {}):
            _fail(trial, known[(name, config.text())], known=True)
        try:
            outcome = evaluate(name, config)
        except KeyboardInterrupt:
            trial.set_user_attr(INTERRUPTED, True)  # Optuna records it FAIL: this marks it as no result
            raise
        if outcome.failure is not None:
            if on_failure is not None:
                on_failure(name, config, outcome.failure)
            _fail(trial, outcome.failure)
        trial.set_user_attr("max_error", outcome.max_error)
        return outcome.milliseconds

    callbacks = []
    if settings.trials is not None:
        remaining = settings.trials - len(counted_trials(study))
        if remaining <= 0:
            return
        callbacks.append(_stop_after(settings.trials))
        remaining *= 1 + REFUSALS_PER_TRIAL  # the most this run draws: each refused draw is one more
    else:
        remaining = None
    if on_trial is not None:
        callbacks.append(lambda _study, trial: on_trial(trial))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study.optimize(objective, n_trials=remaining, timeout=settings.timeout_s, catch=(CandidateFailed,), callbacks=callbacks)
