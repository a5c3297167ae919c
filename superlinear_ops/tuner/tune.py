"""``tune``: search every problem of a workload, then store each winner with its provenance.

Studies live in an Optuna storage (``--storage``: a database URL, a SQLite file, or a journal
file ending in .log/.journal), so an interrupted run resumes where it stopped and several workers
(``--workers N`` locally, one per GPU, or ``tune`` on several machines) share the work. Studies are
created once before workers start; first-time storage creation is serialised (a lock file beside a
SQLite file, retries for database URLs), so runs started at once never race on Optuna's schema.

Candidates run in a worker process (``worker.CandidateWorker``: one per tune process, so one per
GPU with ``--workers``); this process only drives Optuna. Every failure is recorded in the study
and in the store (``--cache``), and a candidate the store says failed (same variant code, same
Triton) is recorded failed again without running. A winner other than the default is timed again
beside the default (``confirm_winner``) and stored only when it is clearly faster there (or, when it
won a search before, when it is faster there at all: the winner stored as its study began, measured
again after a change of code, or, with none, the one another GPU of its architecture won); a run
interrupted before its confirmation stores its best trial as measured. A problem with no winner of its
own measures, after the default, that sibling GPU's winner (``sibling_winner``: what the dispatcher
would borrow while it is current), so a new GPU's search starts from it.

Ctrl-C stops a run cleanly: the trial it interrupts is marked ``interrupted`` (no result; it runs
again on resume), the winners found so far are stored, and a one-line message replaces the
traceback (exit status 130).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import optuna
import platformdirs
import torch
from optuna.trial import TrialState
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError
from tqdm import tqdm

from ..buckets import ProblemKey, key_of
from ..cache.entry import TunedEntry
from ..cache.layers import SHIPPED_PACKAGE, YamlLayer, search_label, shipped_files
from ..cache.provenance import current_provenance
from ..cache.store import Store, sqlite_path
from ..launch import KernelConfig
from ..problem import device_identity
from ..registry import REGISTRY
from .faults import Outcome
from .known_failures import FailureLog
from .search import (
    EARLIER,
    INTERRUPTED,
    REFUSED,
    SIBLING,
    SearchSettings,
    baseline_candidate,
    candidate_of,
    counted_trials,
    default_params,
    earlier_winner_params,
    finished_trials,
    open_study,
    run_search,
    tunable_variants,
)
from .worker import CandidateWorker
from .workload import Case, load

log = logging.getLogger(__name__)


def default_storage() -> str:
    """Optuna storage used when none is given: a SQLite file beside the user's tuned store."""
    path = pathlib.Path(platformdirs.user_cache_dir("superlinear-ops")) / "studies.sqlite"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


SCHEMA_RACE_RETRIES = 8


@contextlib.contextmanager
def _file_lock(path: pathlib.Path):
    """An exclusive ``flock`` on ``path`` (created if missing) for the duration of the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _rdb_storage(url: str):
    """An RDBStorage whose first-time schema creation never races another process: a lock file
    beside a SQLite file serialises it; other databases retry Optuna's creation-race errors."""
    engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    sqlite_file = sqlite_path(url.split("?", 1)[0])
    if sqlite_file is not None:
        with _file_lock(sqlite_file.with_name(sqlite_file.name + ".lock")):
            return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
    for attempt in range(SCHEMA_RACE_RETRIES):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
        except (IntegrityError, OperationalError, ProgrammingError) as err:  # alembic_version created twice
            if attempt == SCHEMA_RACE_RETRIES - 1:
                raise
            log.debug("storage %s: schema creation raced (%s); retrying", url, err)
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def open_storage(location: str | None):
    """An Optuna storage for a URL, a SQLite file or a journal file (.log / .journal)."""
    location = location or default_storage()
    if "://" in location:
        return _rdb_storage(location)
    if location.endswith((".log", ".journal")):
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(location))
    return _rdb_storage(f"sqlite:///{pathlib.Path(location).resolve()}")


class _InterruptRecords(logging.Filter):
    """Drops Optuna's report (a warning with a traceback, then "failed with value None") of a trial
    that Ctrl-C stopped: ``tune`` prints its own one-line message instead."""

    def __init__(self) -> None:
        super().__init__()
        self.trials: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        number = message.split()[1] if message.startswith("Trial ") else None
        if record.exc_info and issubclass(record.exc_info[0], KeyboardInterrupt):
            self.trials.add(number)
            return False
        return not (number in self.trials and "failed with value" in message)


@contextlib.contextmanager
def _quiet_interrupts():
    """``_InterruptRecords`` on Optuna's trial logger for the duration of the block."""
    logger, records = logging.getLogger("optuna.study._optimize"), _InterruptRecords()
    logger.addFilter(records)
    try:
        yield
    finally:
        logger.removeFilter(records)


def _interrupted(what: str) -> SystemExit:
    """The one-line report of a Ctrl-C, as the exit of the command (status 130)."""
    print(f"superlinear-ops tune: interrupted; {what}. Run the same command again to resume.", file=sys.stderr)
    return SystemExit(130)


@dataclass(frozen=True)
class Result:
    """What tuning found for one problem."""

    label: str
    key_text: str
    default_ms: float
    best_ms: float
    variant: str
    config: str
    trials: int
    failed: int
    pruned: int

    @property
    def speedup(self) -> float:
        """Default time over best time."""
        return self.default_ms / self.best_ms if self.best_ms > 0 else float("nan")


def unique_cases(cases: list[Case]) -> list[Case]:
    """One case per problem key (the first), so no key is tuned twice."""
    seen, unique = set(), []
    for case in cases:
        key = key_of(case.problem)
        if key not in seen:
            seen.add(key)
            unique.append(case)
    return unique


@dataclass(frozen=True)
class Winner:
    """The best completed trial of a study."""

    variant: str
    config: KernelConfig
    median_ms: float
    default_ms: float  # inf when the default did not complete
    max_error: float


CONFIRM_ROUNDS = 3  # interleaved re-timings of a study's winner and the default before the winner is stored
CONFIRM_MARGIN = 0.05  # how much faster than the default a winner must be there (verify's default threshold)
CONFIRMED = "confirmed"  # study attribute: the confirmation's candidate and medians


def summarise(case: Case, study: optuna.Study) -> tuple[Result, Winner | None]:
    """The study's outcome: a result row, and the winner to store (None when nothing completed, or
    when the default is not measured yet: an interrupted run stores no winner without its baseline;
    a default that failed its check gives default_ms = inf). Where the winner was confirmed
    (``confirm_winner``), the confirmation's medians replace the trials' times, and a winner not
    ``CONFIRM_MARGIN`` faster than the default there gives way to the default (timings of small
    kernels vary by more than that between runs, so a smaller gain is not one). A configuration
    that won a search before needs no margin, only to be faster side by side: the winner stored
    before (the study's ``EARLIER``: a re-tune after a change of code keeps it while it is still
    faster, instead of flipping to the default on a small gap) or, with none, a sibling GPU's
    winner (``SIBLING``: the same compiled code won on the same architecture; the margin would
    hand a new GPU the default where the sibling's choice is measured faster)."""
    trials = finished_trials(study)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    failed = sum(t.state == TrialState.FAIL and INTERRUPTED not in t.user_attrs for t in trials)
    pruned = sum(t.state == TrialState.PRUNED for t in trials)
    key_text = key_of(case.problem).text()
    if not complete:
        return Result(case.label, key_text, math.nan, math.nan, "-", "-", len(trials), failed, pruned), None
    wanted = default_params(case.problem)
    default = next((t for t in complete if t.params == wanted), None)
    default_failed = any(t.state == TrialState.FAIL and "failure" in t.user_attrs and t.params == wanted
                         for t in trials)
    best = min(complete, key=lambda t: t.value)
    name, config = candidate_of(best.params)
    if default is None and not default_failed:
        return Result(case.label, key_text, math.nan, best.value, name, config.text(), len(trials), failed, pruned), None
    winner = Winner(name, config, best.value, default.value if default is not None else math.inf,
                    float(best.user_attrs.get("max_error", math.nan)))
    confirmed = study.user_attrs.get(CONFIRMED)
    if default is not None and confirmed is not None and confirmed["params"] == best.params:
        won_before = confirmed["params"] in (study.user_attrs.get(EARLIER), study.user_attrs.get(SIBLING))
        margin = 0.0 if won_before else CONFIRM_MARGIN
        if confirmed["median_ms"] < confirmed["default_ms"] * (1.0 - margin):
            winner = dataclasses.replace(winner, median_ms=confirmed["median_ms"], default_ms=confirmed["default_ms"])
        else:
            name, config = candidate_of(default.params)
            winner = Winner(name, config, confirmed["default_ms"], confirmed["default_ms"],
                            float(default.user_attrs.get("max_error", math.nan)))
    return Result(case.label, key_text, winner.default_ms, winner.median_ms, name, config.text(), len(trials), failed, pruned), winner


def confirm_winner(case: Case, study: optuna.Study, evaluate: Callable[[str, KernelConfig], Outcome]) -> None:
    """Time the study's best trial and the default again, interleaved in ``CONFIRM_ROUNDS`` rounds
    (as ``verify`` does), and record both medians on the study, so that one trial's noisy time (a
    default timed first, on a cold GPU) never makes the winner. Nothing is recorded when the best is
    the default, the default did not complete, or a re-run fails."""
    complete = [t for t in finished_trials(study) if t.state == TrialState.COMPLETE]
    default = default_params(case.problem)
    if not complete or not any(t.params == default for t in complete):
        return
    best = min(complete, key=lambda t: t.value)
    if best.params == default:
        return
    times: dict[str, list[float]] = {"default_ms": [], "median_ms": []}
    for _ in range(CONFIRM_ROUNDS):
        for label, params in (("default_ms", default), ("median_ms", best.params)):
            outcome = evaluate(*candidate_of(params))
            if outcome.failure is not None:
                log.warning("%s: re-timing %s failed (%s); the trials' times stand", case.label, params, outcome.failure.message)
                return
            times[label].append(outcome.milliseconds)
    study.set_user_attr(CONFIRMED, {"params": best.params, **{k: statistics.median(v) for k, v in times.items()}})


def tune(
    workload_path: str,
    *,
    settings: SearchSettings,
    storage: str | None = None,
    cache: str | None = None,
    device: torch.device,
    workers: int = 1,
    progress: bool = True,
    only: str | None = None,
    worker_setup: Callable[[], None] | None = None,
) -> list[Result]:
    """Tune every problem of the workload (or those whose label matches ``only``); one result per key.

    ``worker_setup`` (a picklable callable, e.g. one that registers extra variants) runs first in
    every worker process; with ``workers > 1`` it must be None. On Ctrl-C it stores the winners
    found so far and raises ``SystemExit(130)`` after a one-line message.
    """
    if workers > 1 and worker_setup is not None:
        raise ValueError("worker_setup must be None when workers > 1 (worker tune processes start from the command line)")
    workload = load(workload_path)
    identity = device_identity(device)
    cases = [c for c in unique_cases(workload.cases(identity, only)) if tunable_variants(c.problem)]
    if identity.interpreter:
        log.warning("no GPU in use: timing under Triton's CPU interpreter; entries are tagged as interpreter timings")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study_storage = open_storage(storage)
    studies = [open_study(study_storage, key_of(c.problem), settings) for c in cases]  # created once, before workers
    interrupted = False
    try:
        if workers > 1:
            Store.writer(cache).close()  # create the store's schema once, before the workers start
            _run_workers(workers, workload_path, settings, storage or default_storage(), cache, only)
        else:
            total = sum((settings.trials or 0) for _ in cases) or None
            with tqdm(total=total, desc=f"tuning {workload.name}", unit="trial", disable=not progress) as bar:
                _search_cases(cases, studies, settings, device, cache, worker_setup, bar)
    except KeyboardInterrupt:
        interrupted = True
    results = _store_winners(cases, studies, settings, cache, identity)
    if interrupted:
        raise _interrupted(f"stored the winners of {sum(r.variant != '-' for r in results)} of {len(results)} problems")
    return results


def sibling_winner(store: Store, shipped: YamlLayer, key: ProblemKey) -> TunedEntry | None:
    """A winner for ``key``'s problem measured on another GPU of its architecture, as the dispatcher
    would borrow one: from the store, else from the files shipped with the package (stale ones
    too: measured again here). A GPU with no winner of its own measures it early."""
    return next(iter(store.entries_for_arch(key) or shipped.sibling_entries(key)), None)


def _search_cases(cases: list[Case], studies: list[optuna.Study], settings: SearchSettings, device: torch.device,
                  cache: str | None, setup: Callable[[], None] | None, bar: tqdm | None = None) -> None:
    """Run every case's search with one worker process (respawned after crashes and timeouts);
    failures go to the store ``cache``, and the ones it already holds are not retried."""
    with Store.writer(cache) as store, CandidateWorker(device, settings.seed, settings.candidate_timeout_s, setup) as worker, \
            _quiet_interrupts():
        failures = FailureLog(store)
        shipped = YamlLayer("shipped", shipped_files, f"package {SHIPPED_PACKAGE}")  # read once, when first asked
        tuned: dict = {}  # problem key -> this run's winner (variant name, configuration)
        for case, study in zip(cases, studies):
            key = key_of(case.problem)
            if bar is not None:
                bar.set_postfix_str(case.label)
                bar.update(len(counted_trials(study)))
            worker.prepare(case, baseline_candidate(study, case.problem), parts_tuned_here(case.problem, tuned))
            stored = store.get(key.text())
            earlier = None if stored is None else earlier_winner_params(case.problem, stored.variant, stored.config)
            sibling = None if stored is not None else sibling_winner(store, shipped, key)
            run_search(study, case.problem, worker.evaluate, settings, known=failures.known(key),
                       on_failure=lambda name, config, failure, key=key: failures.record(key, name, config, failure),
                       on_trial=None if bar is None else lambda t: bar.update(REFUSED not in t.user_attrs), earlier=earlier,
                       sibling=None if sibling is None else earlier_winner_params(case.problem, sibling.variant, sibling.config))
            confirm_winner(case, study, worker.evaluate)
            _, winner = summarise(case, study)
            if winner is not None:
                tuned[key] = (winner.variant, dict(winner.config))


def parts_tuned_here(problem, tuned: dict) -> dict:
    """The parts of ``problem`` (``OpSpec.parts``) whose own problems this run tuned already, at their
    winners: a backward is timed behind the forward that will run with it, and the layer's search
    with its span attention; other parts take the dispatcher's choice (``runner.resolve_parts``)."""
    return {name: tuned[key_of(part)] for name, part in REGISTRY.spec(problem.op).parts(problem).items()
            if key_of(part) in tuned}


def _store_winners(cases: list[Case], studies: list[optuna.Study], settings: SearchSettings, cache: str | None,
                   identity) -> list[Result]:
    """Summarise every study and store each winner with its provenance; one result per case."""
    results = []
    with Store.writer(cache) as store:
        for case, study in zip(cases, studies):
            result, winner = summarise(case, study)
            results.append(result)
            if winner is None:
                why = "no candidate completed" if result.variant == "-" else "the default is not measured yet"
                log.warning("%s: %s; nothing stored", case.label, why)
                continue
            store.put(TunedEntry(
                key=key_of(case.problem), variant=winner.variant, config=winner.config, median_ms=winner.median_ms,
                default_ms=winner.default_ms, max_error=winner.max_error,
                sampler=search_label(settings.sampler, case.context),
                trials=result.trials, seed=settings.seed,
                provenance=current_provenance(case.problem.op, winner.variant, identity),
            ))
    return results


def _run_workers(workers: int, workload_path: str, settings: SearchSettings, storage: str, cache: str | None,
                 only: str | None) -> None:
    """Start ``workers`` local tune processes on the shared storage (one GPU each when there are GPUs)."""
    gpus = torch.cuda.device_count()
    processes = []
    for index in range(workers):
        env = dict(os.environ)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(index % gpus)
        command = [
            sys.executable, "-m", "superlinear_ops.cli", "tune", workload_path, "--worker-only",
            "--storage", storage, "--sampler", settings.sampler, "--seed", str(settings.seed + index),
            "--no-progress", "--candidate-timeout", str(settings.candidate_timeout_s),
        ]
        if cache is not None:
            command += ["--cache", cache]
        if settings.trials is not None:
            command += ["--trials", str(settings.trials)]
        if settings.timeout_s is not None:
            command += ["--timeout", str(settings.timeout_s)]
        if only is not None:
            command += ["--problems", only]
        processes.append(subprocess.Popen(command, env=env))
    try:
        failures = [p.args for p in processes if p.wait() != 0]
    except KeyboardInterrupt:  # the workers got the same Ctrl-C: let them mark their trials and exit
        for p in processes:
            p.wait()
        raise
    if failures:
        raise RuntimeError(f"{len(failures)} tune worker(s) failed")


def work(workload_path: str, *, settings: SearchSettings, storage: str, device: torch.device,
         cache: str | None = None, only: str | None = None) -> None:
    """A worker tune process: run trials on every study of the workload (studies must exist),
    failures to ``cache``; on Ctrl-C it marks the running trial interrupted and raises
    ``SystemExit(130)`` after a one-line message."""
    workload = load(workload_path)
    identity = device_identity(device)
    study_storage = open_storage(storage)
    cases = [c for c in unique_cases(workload.cases(identity, only)) if tunable_variants(c.problem)]
    try:
        studies = [open_study(study_storage, key_of(c.problem), settings) for c in cases]
        _search_cases(cases, studies, settings, device, cache, None)
    except KeyboardInterrupt:
        raise _interrupted("this worker stopped") from None
