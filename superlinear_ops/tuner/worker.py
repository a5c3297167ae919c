"""Disposable workers: every candidate is built, checked and timed in a spawned process that holds the
current problem's inputs (built once per worker, not per candidate). A candidate that kills the
process (a signal, a sticky CUDA error such as an illegal memory access) or runs past the timeout
comes back as a failed ``Outcome``; the worker is then killed and a fresh one started on the next
candidate, with the problem's inputs and real-size baseline rebuilt (so too when a worker is found dead
between candidates)."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import signal
import sys
import time
import warnings
from collections.abc import Callable

import torch

from ..launch import KernelConfig
from ..registry import REGISTRY
from .faults import CRASH, TIMEOUT, Failure, Outcome, classify, describe_exit, is_sticky
from .runner import CandidateFailed, PartNames, ProblemBench, context_usable
from .workload import Case

log = logging.getLogger(__name__)
CUBLAS_CONTEXT_WARNING = "Attempting to run cuBLAS, but there was no current CUDA context"
DEFAULT_TIMEOUT_S = 300.0
_DEAD = object()  # what _wait returns when the worker process is gone


class WorkerError(RuntimeError):
    """The worker could not prepare a problem (not a candidate's fault); the message says why."""


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when the tuner that spawned it dies."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def evaluate(bench: ProblemBench, name: str, config: KernelConfig) -> tuple[Outcome, bool]:
    """Check, time and re-check one candidate; (its outcome, whether this process must be replaced)."""
    try:
        variant = REGISTRY.get(bench.problem.op, name)
        error = bench.check(variant, config)
        milliseconds = bench.time_ms(variant, config)
        bench.check(variant, config, runs=1)  # still right after the timed launches
        return Outcome(milliseconds, error), False
    except CandidateFailed as err:
        return Outcome(failure=Failure(err.category, str(err))), err.sticky or not context_usable(bench.device)
    except Exception as err:  # the candidate could not even be looked up or started
        failure = Failure(classify(err), f"{err.__class__.__name__}: {str(err)[:300]}")
        return Outcome(failure=failure), is_sticky(err) or not context_usable(bench.device)


def serve(conn, device: torch.device, seed: int, setup: Callable[[], None] | None) -> None:
    """The worker process: answer prepare / baseline / evaluate requests until told to stop or the
    tuner goes away. Ctrl-C is the tuner's to handle: the worker ignores SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    warnings.filterwarnings("ignore", message=CUBLAS_CONTEXT_WARNING)
    if setup is not None:
        setup()
    if device.type == "cuda":
        torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
    bench = None
    while True:
        try:
            request, payload = conn.recv()
        except (EOFError, OSError):
            return
        if request == "stop":
            return
        if request == "prepare":
            try:
                case, parts = payload
                bench = ProblemBench(case, device, seed=seed, parts=parts)
                conn.send(("ready", None))
            except Exception as err:
                conn.send(("error", f"{err.__class__.__name__}: {err}"))
            continue
        name, values = payload
        if request == "baseline":
            try:
                bench.set_baseline(REGISTRY.get(bench.problem.op, name), KernelConfig(values))
                conn.send(("ready", None))
            except Exception as err:
                conn.send(("error", f"{err.__class__.__name__}: {err}"))
            continue
        outcome, replace = evaluate(bench, name, KernelConfig(values))
        conn.send(("outcome", outcome, replace))
        if replace:
            return


class CandidateWorker:
    """The tuner's handle on its worker process: one problem at a time (``prepare``), then one
    candidate per ``evaluate``, each given ``timeout_s`` seconds. ``setup`` (a picklable callable)
    runs first in every worker process, e.g. to register variants the worker must know."""

    def __init__(self, device: torch.device, seed: int, timeout_s: float = DEFAULT_TIMEOUT_S,
                 setup: Callable[[], None] | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.device, self.seed, self.timeout_s, self.setup = device, seed, timeout_s, setup
        self.starts = 0  # processes started so far (1 + respawns)
        self.baseline: tuple[str, KernelConfig] | None = None
        self._context = multiprocessing.get_context("spawn")
        self._process = None
        self._conn = None
        self._case: Case | None = None
        self._parts: PartNames | None = None
        self._prepared = False  # the live process holds self._case's inputs

    def __enter__(self) -> "CandidateWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def prepare(self, case: Case, baseline: tuple[str, KernelConfig] | None = None,
                parts: PartNames | None = None) -> None:
        """Switch to ``case`` (its inputs are built on the next ``evaluate``); ``baseline`` is a candidate
        that passed before (a resumed study's default), against which real-size results are compared;
        ``parts`` names the configurations of the op's other parts (``ProblemBench``)."""
        self._case, self.baseline, self._parts, self._prepared = case, baseline, parts, False

    def evaluate(self, name: str, config: KernelConfig) -> Outcome:
        """Check and time ``name``/``config`` on the prepared problem in the worker process."""
        if self._case is None:
            raise WorkerError("evaluate before prepare: no problem to run the candidate on")
        if self._process is not None and not self._process.is_alive():
            self._kill()  # it died between candidates (killed from outside): a fresh one runs this candidate
        if self._process is None:
            self._start()
        elif not self._prepared:
            self._prepare()
        self._conn.send(("evaluate", (name, dict(config))))
        reply = self._wait(self.timeout_s)
        if reply is None:
            self._kill()
            return Outcome(failure=Failure(TIMEOUT, f"no result within {self.timeout_s:g} s; the worker was killed"))
        if reply is _DEAD:
            code = self._kill()
            return Outcome(failure=Failure(CRASH, f"the worker process died while running it ({describe_exit(code)})"))
        _, outcome, replace = reply
        if replace:
            self._kill()
        elif outcome.failure is None and self.baseline is None:
            self.baseline = (name, config)
        return outcome

    def close(self) -> None:
        """Stop the worker process (killed if it does not stop at once)."""
        if self._process is None:
            return
        try:
            self._conn.send(("stop", None))
        except OSError:
            pass
        self._process.join(5)
        self._kill()

    def _start(self) -> None:
        parent, child = self._context.Pipe()
        self._process = self._context.Process(target=serve, args=(child, self.device, self.seed, self.setup),
                                              name="superlinear-ops-worker", daemon=True)
        self._process.start()
        child.close()
        self._conn = parent
        self.starts += 1
        self._prepare()

    def _prepare(self) -> None:
        self._conn.send(("prepare", (self._case, self._parts)))
        reply = self._wait(None)
        if reply is _DEAD or reply[0] != "ready":
            why = describe_exit(self._kill()) if reply is _DEAD else reply[1]
            raise WorkerError(f"the worker could not prepare {self._case.label}: {why}")
        self._prepared = True
        if self.baseline is None:
            return
        name, config = self.baseline
        self._conn.send(("baseline", (name, dict(config))))
        reply = self._wait(self.timeout_s)
        if reply is not None and reply is not _DEAD and reply[0] == "ready":
            return
        log.warning("%s: baseline %s %s did not run again (%s); the next passing candidate is the baseline",
                    self._case.label, name, config.text(), "timeout" if reply is None else "crash" if reply is _DEAD else reply[1])
        self.baseline = None
        if reply is None or reply is _DEAD:  # a fresh process without it
            self._kill()
            self._start()

    def _wait(self, timeout_s: float | None):
        """The next reply; None after ``timeout_s`` (None: no limit) without one; _DEAD when the process died."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            step = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            if self._conn.poll(step):
                try:
                    return self._conn.recv()
                except (EOFError, OSError):
                    return _DEAD
            if not self._process.is_alive():
                return _DEAD
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _kill(self) -> int | None:
        """Kill and reap the worker process; its exit code."""
        process, self._process = self._process, None
        if process is None:
            return None
        if process.is_alive():
            process.kill()
        process.join()
        self._conn.close()
        return process.exitcode
