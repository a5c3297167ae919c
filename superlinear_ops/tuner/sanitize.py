"""``sanitize``: a memory-check sweep of the declared spaces.

For every problem of a workload, at a small shape of the same layout (problems that differ only in
their lengths share one), every applicable variant runs a covering set of its declared space
(``covering_configs``) under ``compute-sanitizer`` (memcheck by default; racecheck on request),
each configuration checked against the float64 reference too. The sweep runs in child processes,
each over a chunk of one layout's configurations, several at once (``--jobs``: compiling is what
takes the time, and the GPU has room for many); a configuration that crashes its child is reported
and the child is restarted after it, so one fault never hides the others. Without compute-sanitizer (a CPU machine) the same
sweep runs without it, as a dry run of the configurations' correctness.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from ..buckets import key_of
from ..devices import select_device
from ..launch import KernelConfig
from ..problem import device_identity
from ..registry import REGISTRY, Variant
from .runner import ProblemBench
from .tune import unique_cases
from .workload import Case, load

log = logging.getLogger(__name__)

SMALL_QUERIES, SMALL_KEYS, SMALL_WINDOW = 128, 1024, 128  # the sweep's shape: every tile kind still has several blocks
REPEATS = 2  # runs per configuration (some illegal accesses show only after several launches)
CHUNK = 6  # configurations per child process: small enough to spread a layout over the jobs
ITEM, DONE = "@@sanitize-item", "@@sanitize-done"
SANITIZER_LINE = re.compile(r"^={9} (?!ERROR SUMMARY)(.*)")


def covering_configs(variant: Variant, default: KernelConfig) -> list[KernelConfig]:
    """``default``, every value of every tunable with the others at their defaults, and every pair of
    a pipeline depth (``*stages``) and a key-tile width (``*block_n`` / ``*block_k``) of one kernel part."""
    configs = {default}
    for param in variant.space:
        configs.update(default.replace(**{param.name: value}) for value in param.values)
    values = {p.name: p.values for p in variant.space}
    for stages in (name for name in values if name.endswith("stages")):
        part = stages.removesuffix("stages")
        for width in (f"{part}block_n", f"{part}block_k", "block_k" if part == "num_" else None):
            if width in values:
                for s, w in itertools.product(values[stages], values[width]):
                    configs.add(default.replace(**{stages: s, width: w}))
    return sorted(configs, key=lambda c: c.text())


def small_case(case: Case) -> Case:
    """``case`` at the sweep's shape, its layout otherwise unchanged: the window shrunk to at most
    ``SMALL_WINDOW`` keys (the largest ``sw_index`` that gives it), ``SMALL_KEYS`` keys past twice
    the window (so that queries have spans), a training step still one query per key, decode one query."""
    p = case.problem
    sw_index = p.sw_index
    while sw_index > 1 and p._replace(sw_index=sw_index).window > SMALL_WINDOW:
        sw_index -= 1
    p = p._replace(sw_index=sw_index)
    keys = min(p.keys, 2 * p.window + SMALL_KEYS)
    queries = 1 if REGISTRY.spec(p.op).single_query else keys if p.queries == p.keys else min(p.queries, SMALL_QUERIES)
    fill = min(case.cache_fill, keys // 2) if case.cache_fill else None
    return replace(case, problem=p._replace(queries=queries, keys=keys), cache_fill=fill)


def layouts(workload_path: str, identity, only: str | None) -> list[Case]:
    """One small case per distinct layout of the workload's problems."""
    return unique_cases([small_case(c) for c in load(workload_path).cases(identity, only)])


def items(case: Case, variants: str | None = None) -> list[tuple[Variant, KernelConfig]]:
    """(variant, configuration) pairs the sweep runs for ``case``: each applicable variant's covering
    set (only the variants whose name ``variants`` matches, when given), less what its declared
    constraints or its static check rule out on this GPU."""
    out = []
    for variant in REGISTRY.variants(case.problem.op):
        if variants is not None and not re.search(variants, variant.name):
            continue
        if variant.not_supported_reasons(case.problem):
            continue
        for config in covering_configs(variant, variant.default(case.problem)):
            if variant.violation(config) is None and variant.compile_check(case.problem, config) is None:
                out.append((variant, config))
    return out


def run_child(workload_path: str, label: str, key: str, start: int, stop: int, device: torch.device,
              variants: str | None = None) -> int:
    """The child's job: run the items ``start:stop`` of the problem ``label`` whose small case has the
    problem key ``key``, one marker line each."""
    # Among all the workload's problems, not its layouts: in the whole workload another problem may stand for
    # this one's layout; and two problems may share a label (op entries that differ only in batch), not a key.
    case = next(small for c in load(workload_path).cases(device_identity(device), None)
                if c.label == label and key_of((small := small_case(c)).problem).text() == key)
    bench = ProblemBench(case, device, seed=0)
    for index, (variant, config) in list(enumerate(items(case, variants)))[start:stop]:
        print(f"{ITEM} {index} {variant.qualified_name} {config.text()}", flush=True)
        try:
            for _ in range(REPEATS):
                bench.check(variant, config)  # synchronises on a GPU: a fault is this configuration's
            verdict = "ok"
        except Exception as error:  # reported per configuration; the sweep goes on
            verdict = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200] if str(error).strip() else ''}"
        print(f"{DONE} {index} {verdict}", flush=True)
    return 0


@dataclass
class SweepRow:
    """One configuration's result: sanitizer errors and the check's verdict."""

    layout: str
    variant: str
    config: str
    verdict: str = "not run"
    errors: list[str] | None = None

    @property
    def clean(self) -> bool:
        """No sanitizer error and a correct result."""
        return not self.errors and self.verdict == "ok"


def _child_command(sanitizer: str | None, tool: str, workload_path: str, case: Case, start: int, stop: int,
                   device: str, variants: str | None) -> list[str]:
    child = [sys.executable, "-m", "superlinear_ops.tuner.sanitize", workload_path, "--child", case.label,
             "--key", key_of(case.problem).text(), "--start", str(start), "--stop", str(stop), "--device", device,
             *(["--variants", variants] if variants is not None else [])]
    return child if sanitizer is None else [sanitizer, "--tool", tool, "--print-limit", "20", *child]


def _read_child(command: list[str], rows: list[SweepRow], progress) -> tuple[int | None, int, int, str]:
    """Run one child, filling ``rows`` as its lines arrive; (last item started, last item done,
    exit status, the last line it wrote to stderr)."""
    current, last = None, -1
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
        for line in child.stdout:
            if line.startswith(ITEM):
                current = int(line.split()[1])
                rows[current].errors = []
            elif line.startswith(DONE):
                _, index, *verdict = line.rstrip("\n").split(" ", 2)
                rows[int(index)].verdict, last = (verdict or [""])[0], int(index)
                progress.update(1)
                if not rows[last].clean:
                    progress.write(f"{rows[last].layout} | {rows[last].variant} {rows[last].config}: {rows[last].verdict}")
            elif current is not None and (match := SANITIZER_LINE.match(line)) and match.group(1).strip():
                rows[current].errors.append(match.group(1).strip())
        stderr = child.stderr.read()
    return current, last, child.returncode, (stderr.strip().splitlines() or ["no output"])[-1][:200]


def sweep_range(rows: list[SweepRow], case: Case, start: int, stop: int, workload_path: str, tool: str,
                device: str, sanitizer: str | None, progress, variants: str | None = None) -> None:
    """Fill ``rows[start:stop]`` of one layout, restarting the child after an item that ended it."""
    while start < stop:
        command = _child_command(sanitizer, tool, workload_path, case, start, stop, device, variants)
        current, last, status, tail = _read_child(command, rows, progress)
        if last == stop - 1:
            return
        crashed = current if current is not None and current > last else max(last + 1, start)
        rows[crashed].verdict = f"the child ended here (exit {status}): {tail}"
        progress.update(1)
        progress.write(f"{case.label} | {rows[crashed].variant} {rows[crashed].config}: {rows[crashed].verdict}")
        start = crashed + 1


def sanitize(workload_path: str, device: str, tool: str = "memcheck", only: str | None = None,
             progress_bar: bool = True, jobs: int = 1, variants: str | None = None) -> list[SweepRow]:
    """The sweep over every layout of the workload (see the module docstring), ``jobs`` children at
    once, over the variants whose name ``variants`` matches (all when None)."""
    sanitizer = shutil.which("compute-sanitizer") if device == "cuda" else None
    if sanitizer is None:
        log.warning("compute-sanitizer not used (%s): a dry run of the configurations' correctness only",
                    "no GPU" if device != "cuda" else "not on PATH")
    cases = layouts(workload_path, device_identity(torch.device(device)), only)
    tables = [[SweepRow(c.label, v.qualified_name, k.text()) for v, k in items(c, variants)] for c in cases]
    chunks = [(rows, case, start, min(start + CHUNK, len(rows)))
              for case, rows in zip(cases, tables) for start in range(0, len(rows), CHUNK)]
    began = time.time()
    with tqdm(total=sum(map(len, tables)), unit="config", disable=not progress_bar) as progress, \
            ThreadPoolExecutor(max(1, jobs)) as pool:
        list(pool.map(lambda chunk: sweep_range(*chunk, workload_path, tool, device, sanitizer, progress, variants),
                      chunks))
    for case, rows in zip(cases, tables):
        log.info("%s: %d configurations, %d with errors", case.label, len(rows), sum(not r.clean for r in rows))
    log.info("%d configurations in %.0f s with %d jobs", sum(map(len, tables)), time.time() - began, jobs)
    return [row for rows in tables for row in rows]


def sanitize_command(args: argparse.Namespace) -> int:
    """Run the sweep and print one line per configuration with errors; exit 1 when there is one."""
    device = select_device(args.device).type
    began = time.time()
    rows = sanitize(args.workload, device, args.tool, args.problems, not args.no_progress, args.jobs, args.variants)
    bad = [r for r in rows if not r.clean]
    for r in bad:
        print(f"{r.layout} | {r.variant} {r.config}: {r.verdict}; {len(r.errors or [])} sanitizer lines"
              + (f" (first: {r.errors[0]})" if r.errors else ""))
    print(f"{len(rows)} configurations over {len({r.layout for r in rows})} layouts, {len(bad)} with errors"
          f" ({args.tool if device == 'cuda' else 'dry run, no sanitizer'}, {time.time() - began:.0f} s, {args.jobs} jobs)")
    return 1 if bad else 0


def add_command(commands) -> None:
    """Register ``sanitize`` on the CLI's subcommands."""
    parser = commands.add_parser(
        "sanitize", help="memory-check sweep of every variant's declared space (compute-sanitizer)",
        description="Run a covering set of every applicable variant's declared space (every value of each "
        "tunable, and every pair of pipeline depth and key-tile width) for each layout of a workload's "
        "problems at a small shape, under compute-sanitizer, and report the configurations with errors.")
    parser.add_argument("workload", help="workload YAML file, e.g. tuning/superlinear-exp-v0.1.yaml")
    parser.add_argument("--tool", choices=("memcheck", "racecheck"), default="memcheck", help="default: memcheck")
    parser.add_argument("--problems", metavar="REGEX", help="only the problems whose label matches")
    parser.add_argument("--variants", metavar="REGEX", help="only the variants whose name matches")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="child processes at once (compiling dominates; e.g. the CPU cores); default: 1")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (configurations with errors still print as found)")
    parser.set_defaults(handler=sanitize_command)


def main(argv: list[str] | None = None) -> int:
    """The child process's entry point (``python -m superlinear_ops.tuner.sanitize``)."""
    parser = argparse.ArgumentParser(description="one layout of a sanitize sweep (run by `superlinear-ops sanitize`)")
    parser.add_argument("workload")
    parser.add_argument("--child", required=True, help="the layout's problem label")
    parser.add_argument("--key", required=True, help="the problem key of its small case")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--stop", type=int, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--variants", help="only the variants whose name matches")
    args = parser.parse_args(argv)
    return run_child(args.workload, args.child, args.key, args.start, args.stop, torch.device(args.device),
                     args.variants)


if __name__ == "__main__":
    sys.exit(main())
