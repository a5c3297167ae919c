"""The ``tune``, ``verify``, ``bench`` and ``warmup`` commands."""

from __future__ import annotations

import argparse
import math

from ..devices import select_device
from .search import SAMPLERS, SearchSettings


def tune_command(args: argparse.Namespace) -> int:
    """Run the tuner over a workload and print one row per problem."""
    device = select_device(args.device)
    settings = SearchSettings(trials=args.trials, timeout_s=args.timeout, sampler=args.sampler, seed=args.seed,
                              candidate_timeout_s=args.candidate_timeout)
    if args.worker_only:
        from .tune import work

        work(args.workload, settings=settings, storage=args.storage, device=device, cache=args.cache, only=args.problems)
        return 0
    from .tune import tune

    results = tune(args.workload, settings=settings, storage=args.storage, cache=args.cache, device=device,
                   workers=args.workers, progress=not args.no_progress, only=args.problems)
    print(f"{'problem':<38}{'default ms':>12}{'best ms':>12}{'speedup':>9}{'trials':>8}{'failed':>7}{'pruned':>7}  variant: configuration")
    for r in results:
        print(f"{r.label:<38}{r.default_ms:>12.4f}{r.best_ms:>12.4f}{r.speedup:>8.2f}x{r.trials:>8}{r.failed:>7}{r.pruned:>7}  {r.variant}: {r.config}")
    return 0


def verify_command(args: argparse.Namespace) -> int:
    """Re-measure cached winners, a row printed as each is measured; exit 1 when one is slower than the
    default beyond the threshold (or, with ``--require-all``, has no tuned entry)."""
    from .. import use_cache
    from .bench import verify

    if args.cache:
        use_cache(args.cache)
    print(f"{'problem':<38}{'default ms':>12}{'tuned ms':>12}{'dense ms':>12}  verdict (fastest dense backend)", flush=True)
    failed = False
    for r in verify(args.workload, select_device(args.device), args.threshold, args.problems):
        backend, dense_ms = r.dense.fastest if r.dense else ("-", math.nan)
        print(f"{r.label:<38}{r.default_ms:>12.4f}{r.tuned_ms:>12.4f}{dense_ms:>12.4f}  {r.verdict} ({backend})", flush=True)
        failed |= r.failed or (args.require_all and r.verdict == "no tuned entry")
    return 1 if failed else 0


def bench_command(args: argparse.Namespace) -> int:
    """Bench a workload: default, tuned, dense SDPA and the lower bound per problem; or, with
    ``--report``, write a results JSON file's Markdown report."""
    if args.report:
        from .report import write_report

        print(f"wrote {write_report(args.report, args.out)}")
        return 0
    if args.workload is None:
        raise ValueError("bench needs a workload file (or --report RESULTS.json)")
    from .. import use_cache
    from .bench import run_bench

    if args.cache:
        use_cache(args.cache)
    rows = run_bench(args.workload, select_device(args.device), args.output, args.plot, args.problems)
    print(f"{'problem':<38}{'default':>10}{'tuned':>10}{'speedup':>9}{'SDPA':>10}{'bound':>10}  tuned choice (source); fastest SDPA")
    for r in rows:
        bound = "-" if math.isnan(r.lower_bound_ms) else f"{r.lower_bound_ms:.4f}"
        print(f"{r.label:<38}{r.default_ms:>10.4f}{r.tuned_ms:>10.4f}{r.speedup:>8.2f}x{r.sdpa_ms:>10.4f}{bound:>10}  "
              f"{r.tuned_choice} ({r.tuned_source}); {r.sdpa_kind}")
    print(f"wrote {args.output}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def warmup_command(args: argparse.Namespace) -> int:
    """Run each workload problem's chosen kernels once, so that Triton's cache holds them compiled."""
    from tqdm import tqdm

    from .. import use_cache
    from ..precompile import warmup
    from ..problem import device_identity
    from .tune import unique_cases
    from .workload import load

    if args.cache:
        use_cache(args.cache)
    device = select_device(args.device)  # before Triton is imported: on the CPU it must load as the interpreter
    from triton import knobs

    cases = unique_cases(load(args.workload).cases(device_identity(device), args.problems))
    for case in tqdm(cases, desc="warmup", unit="problem", disable=args.no_progress):
        warmup([case.problem], device)
    where = f"Triton's cache: {knobs.cache.dir}" if device.type == "cuda" else "the CPU interpreter compiles nothing"
    print(f"warmed up {len(cases)} problem{'' if len(cases) == 1 else 's'} on {device} ({where})")
    return 0


def _workload_arguments(parser: argparse.ArgumentParser, cache_help: str, optional: bool = False) -> None:
    """The arguments every workload command takes."""
    parser.add_argument("workload", nargs="?" if optional else None, help="workload YAML file, e.g. tuning/quick.yaml")
    parser.add_argument("--cache", default=None, help=cache_help)
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="cuda or cpu (default: cuda when available; cpu runs Triton's interpreter)")
    parser.add_argument("--problems", default=None, metavar="REGEX", help="only the problems whose label matches")


def add_commands(commands) -> None:
    """Register ``tune``, ``verify``, ``bench``, ``warmup`` and ``sanitize`` on the CLI's subparsers."""
    tune = commands.add_parser(
        "tune", help="search the best variant and configuration for every problem of a workload",
        description="Tune a workload file (see tuning/). Each problem gets an Optuna study named by its key; "
        "every candidate is built, checked against the reference and timed in a worker process (a crash or hang fails "
        "only that trial); failures and winners go to the cache.",
    )
    _workload_arguments(tune, "where winners go: SQLite file or URL (default: the user's store)")
    tune.add_argument("--trials", type=int, default=24,
                      help="trials per problem, not counting configurations the static check refuses (default 24; 0: until exhausted)")
    tune.add_argument("--timeout", type=float, default=None, help="seconds per problem (default: none)")
    tune.add_argument("--candidate-timeout", type=float, default=300.0, metavar="SECONDS",
                      help="seconds one candidate may take to build, check and time before its worker is killed (default 300)")
    tune.add_argument("--sampler", choices=SAMPLERS, default="tpe", help="default: tpe")
    tune.add_argument("--seed", type=int, default=0, help="sampler and input seed (default 0)")
    tune.add_argument("--storage", default=None, help="Optuna storage: URL, SQLite file or .log journal (default: user cache)")
    tune.add_argument("--workers", type=int, default=1, help="local worker processes, one per visible GPU (default 1)")
    tune.add_argument("--no-progress", action="store_true", help="no progress bar")
    tune.add_argument("--worker-only", action="store_true", help=argparse.SUPPRESS)
    tune.set_defaults(handler=tune_command, normalise_trials=True)

    verify = commands.add_parser(
        "verify", help="re-measure cached winners against the default; fail when one is slower",
        description="For every problem of a workload, check and time the dispatcher's cached choice beside "
        "the heuristic default, with dense SDPA under each backend that runs here (named); exit 1 when a winner is slower "
        "than the default by more than --threshold.",
    )
    _workload_arguments(verify, "explicit cache to verify (SQLite, YAML or URL)")
    verify.add_argument("--threshold", type=float, default=0.05, help="allowed slowdown (default 0.05 = 5%%)")
    verify.add_argument("--require-all", action="store_true", help="also fail when a problem has no tuned entry")
    verify.set_defaults(handler=verify_command)

    bench = commands.add_parser(
        "bench", help="time default, tuned, dense SDPA and the lower bound per problem",
        description="Side by side in one run, per problem of a workload: the heuristic default, the tuned choice, "
        "dense scaled_dot_product_attention under each backend that runs here (cuDNN, flash, memory-efficient: by name, the "
        "fastest compared) and the lower bound (bytes over bandwidth, FLOPs over the tensor rate).",
    )
    _workload_arguments(bench, "explicit cache (SQLite, YAML or URL)", optional=True)
    bench.add_argument("--output", "-o", default="bench.json", help="JSON file to write (default bench.json)")
    bench.add_argument("--plot", default=None, help="PNG file to write (needs matplotlib)")
    bench.add_argument("--report", default=None, metavar="RESULTS.json",
                       help="instead of benching: write the Markdown report of a GPU's results file (docs/benchmarks/)")
    bench.add_argument("--out", default=None, metavar="REPORT.md", help="where --report writes (default: beside it, .md)")
    bench.set_defaults(handler=bench_command)

    warm = commands.add_parser(
        "warmup", help="compile a workload's kernels ahead of time into Triton's cache",
        description="Run the dispatcher's choice for every problem of a workload once, on zero inputs of its real "
        "shape (forward and backward for training), so that Triton's on-disk cache (TRITON_CACHE_DIR, printed at the "
        "end) holds every kernel a deployment calls: bake it into a server's image and the first request compiles "
        "nothing. Also builds the decode geometry tables of the process.",
    )
    _workload_arguments(warm, "explicit cache the dispatcher reads (SQLite, YAML or URL)")
    warm.add_argument("--no-progress", action="store_true", help="no progress bar")
    warm.set_defaults(handler=warmup_command)

    from .sanitize import add_command as add_sanitize_command

    add_sanitize_command(commands)
