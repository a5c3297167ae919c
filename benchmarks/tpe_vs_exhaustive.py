"""How many trials TPE needs to come within 3% of an exhaustive sweep's best, replayed offline.

Reads exhaustive studies (``superlinear-ops tune --sampler exhaustive``) and replays the tuner's
TPE sampler (same settings, several fixed seeds, the heuristic default enqueued first) against the
measured times: each TPE trial returns the exhaustive measurement of the configuration it picks,
and configurations the static check rejected are pruned, as in a live run.

Run:  python benchmarks/tpe_vs_exhaustive.py STUDIES.log [...] --out results.json   (journal files or SQLite)
"""

from __future__ import annotations

import argparse
import json
import statistics

import optuna
from optuna.trial import TrialState

from superlinear_ops.tuner.search import SearchSettings, make_sampler
from superlinear_ops.tuner.tune import open_storage

SEEDS = range(10)
WITHIN = 1.03


def measured(study: optuna.Study) -> tuple[dict, set, dict]:
    """(times by params, pruned params, the distributions) of an exhaustive study."""
    times, pruned, distributions = {}, set(), {}
    for trial in study.trials:
        key = tuple(sorted(trial.params.items()))
        distributions.update(trial.distributions)
        if trial.state == TrialState.COMPLETE:
            times[key] = trial.value
        elif trial.state == TrialState.PRUNED:
            pruned.add(key)
    return times, pruned, distributions


def replay(study: optuna.Study, sampler_name: str, seed: int, budget: int) -> int | None:
    """Trials the sampler needs to reach within 3% of the exhaustive best (None: not within budget)."""
    times, pruned, _ = measured(study)
    best = min(times.values())
    default = study.trials[0].params  # the enqueued heuristic default
    replay_study = optuna.create_study(sampler=make_sampler(SearchSettings(sampler=sampler_name, seed=seed)))
    replay_study.enqueue_trial(default)
    variants = sorted({p["variant"] for p in (t.params for t in study.trials)})
    spaces = {}
    for trial in study.trials:
        for name, dist in trial.distributions.items():
            spaces[name] = dist

    def objective(trial: optuna.Trial) -> float:
        variant = trial.suggest_categorical("variant", variants)
        for name, dist in spaces.items():
            if name.startswith(f"{variant}."):
                trial.suggest_categorical(name, dist.choices)
        key = tuple(sorted(trial.params.items()))
        if key in pruned or key not in times:
            raise optuna.TrialPruned()
        return times[key]

    for n in range(1, budget + 1):
        replay_study.optimize(objective, n_trials=1)
        done = [t for t in replay_study.trials if t.state == TrialState.COMPLETE]
        if done and min(t.value for t in done) <= best * WITHIN:
            return n
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("storages", nargs="+", help="Optuna storages (journal .log files, SQLite files or URLs) holding exhaustive studies")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    rows = []
    for path in args.storages:
        storage = open_storage(path)
        for summary in optuna.get_all_study_summaries(storage):
            study = optuna.load_study(study_name=summary.study_name, storage=storage)
            times, pruned, _ = measured(study)
            best = min(times.values())
            default_ms = study.trials[0].value
            budget = len(study.trials)
            row = {"study": summary.study_name, "exhaustive_trials": budget, "completed": len(times),
                   "pruned": len(pruned), "best_ms": best, "default_ms": default_ms, "speedup": default_ms / best}
            for sampler in ("tpe", "random"):
                needed = [replay(study, sampler, seed, budget) for seed in SEEDS]
                reached = [n for n in needed if n is not None]
                row[sampler] = {"trials_to_3pct": needed, "median": statistics.median(reached) if reached else None,
                                "max": max(reached) if reached else None}
            rows.append(row)
            print(json.dumps(row))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
