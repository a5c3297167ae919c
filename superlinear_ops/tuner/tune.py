"""``tune``: search every problem of a workload, then store each winner with its provenance.

Studies live in an Optuna storage (``--storage``: a database URL, a SQLite file, or a journal
file ending in .log/.journal), so an interrupted run resumes where it stopped and several workers
(``--workers N`` locally, one per GPU, or ``tune`` on several machines) share the work. Studies are
created once before workers start, which avoids Optuna's schema-creation race.
"""

from __future__ import annotations

import logging
import math
import os
import pathlib
import subprocess
import sys
from dataclasses import dataclass

import optuna
import platformdirs
import torch
from optuna.trial import TrialState
from tqdm import tqdm

from ..buckets import key_of
from ..cache.entry import TunedEntry
from ..cache.provenance import current_provenance
from ..cache.store import Store
from ..kernels.launch import KernelConfig
from ..problem import device_identity
from ..registry import REGISTRY
from .runner import ProblemBench
from .search import SearchSettings, candidate_of, finished_trials, open_study, params_of, run_search, tunable_variants
from .workload import Case, load

log = logging.getLogger(__name__)


def default_storage() -> str:
    """Optuna storage used when none is given: a SQLite file beside the user's tuned store."""
    path = pathlib.Path(platformdirs.user_cache_dir("superlinear-ops")) / "studies.sqlite"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def open_storage(location: str | None):
    """An Optuna storage for a URL, a SQLite file or a journal file (.log / .journal)."""
    location = location or default_storage()
    if "://" in location:
        return optuna.storages.RDBStorage(location, engine_kwargs={"connect_args": {"timeout": 60}} if location.startswith("sqlite") else {})
    if location.endswith((".log", ".journal")):
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(location))
    return optuna.storages.RDBStorage(f"sqlite:///{pathlib.Path(location).resolve()}", engine_kwargs={"connect_args": {"timeout": 60}})


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


def summarise(case: Case, study: optuna.Study) -> tuple[Result, Winner | None]:
    """The study's outcome: a result row, and the winner to store (None when nothing completed)."""
    trials = finished_trials(study)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    failed = sum(t.state == TrialState.FAIL for t in trials)
    pruned = sum(t.state == TrialState.PRUNED for t in trials)
    key_text = key_of(case.problem).text()
    if not complete:
        return Result(case.label, key_text, math.nan, math.nan, "-", "-", len(trials), failed, pruned), None
    default_variant = REGISTRY.fallback(case.problem)
    default_params = params_of(default_variant, default_variant.default(case.problem))
    default = next((t for t in complete if t.params == default_params), None)
    best = min(complete, key=lambda t: t.value)
    name, config = candidate_of(best.params)
    winner = Winner(name, config, best.value, default.value if default is not None else math.inf,
                    float(best.user_attrs.get("max_error", math.nan)))
    return Result(case.label, key_text, winner.default_ms, winner.median_ms, name, config.text(), len(trials), failed, pruned), winner


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
) -> list[Result]:
    """Tune every problem of the workload (or those whose label matches ``only``); one result per key."""
    workload = load(workload_path)
    identity = device_identity(device)
    cases = [c for c in unique_cases(workload.cases(identity, only)) if tunable_variants(c.problem)]
    if identity.interpreter:
        log.warning("no GPU in use: timing under Triton's CPU interpreter; entries are tagged as interpreter timings")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study_storage = open_storage(storage)
    studies = [open_study(study_storage, key_of(c.problem), settings) for c in cases]  # created once, before workers
    if workers > 1:
        _run_workers(workers, workload_path, settings, storage or default_storage(), only)
    else:
        total = sum((settings.trials or 0) for _ in cases) or None
        bar = tqdm(total=total, desc=f"tuning {workload.name}", unit="trial", disable=not progress)
        for case, study in zip(cases, studies):
            bar.set_postfix_str(case.label)
            bench = ProblemBench(case, device, seed=settings.seed)
            bar.update(len(finished_trials(study)))
            run_search(study, bench, settings, on_trial=lambda _t: bar.update(1))
        bar.close()
    results = []
    with Store.writer(cache) as store:
        for case, study in zip(cases, studies):
            result, winner = summarise(case, study)
            results.append(result)
            if winner is None:
                log.warning("%s: no candidate completed; nothing stored", case.label)
                continue
            store.put(TunedEntry(
                key=key_of(case.problem), variant=winner.variant, config=winner.config, median_ms=winner.median_ms,
                default_ms=winner.default_ms, max_error=winner.max_error, sampler=settings.sampler,
                trials=result.trials, seed=settings.seed,
                provenance=current_provenance(case.problem.op, winner.variant, identity),
            ))
    return results


def _run_workers(workers: int, workload_path: str, settings: SearchSettings, storage: str, only: str | None) -> None:
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
            "--no-progress",
        ]
        if settings.trials is not None:
            command += ["--trials", str(settings.trials)]
        if settings.timeout_s is not None:
            command += ["--timeout", str(settings.timeout_s)]
        if only is not None:
            command += ["--problems", only]
        processes.append(subprocess.Popen(command, env=env))
    failures = [p.args for p in processes if p.wait() != 0]
    if failures:
        raise RuntimeError(f"{len(failures)} tune worker(s) failed")


def work(workload_path: str, *, settings: SearchSettings, storage: str, device: torch.device,
         only: str | None = None) -> None:
    """A worker: run trials on every study of the workload (studies must exist)."""
    workload = load(workload_path)
    identity = device_identity(device)
    study_storage = open_storage(storage)
    for case in unique_cases(workload.cases(identity, only)):
        if not tunable_variants(case.problem):
            continue
        study = open_study(study_storage, key_of(case.problem), settings)
        run_search(study, ProblemBench(case, device, seed=settings.seed), settings)
