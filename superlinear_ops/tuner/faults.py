"""Why a candidate failed: the reason categories a failed trial is recorded with, and the sorting of
exceptions (and dead worker processes) into them."""

from __future__ import annotations

import signal
from dataclasses import dataclass

import torch

from ..cache.entry import FAILURE_CATEGORIES as CATEGORIES

COMPILE_ERROR, RESOURCE_LIMIT, CRASH, TIMEOUT, WRONG_NUMBERS = CATEGORIES

# Texts of CUDA errors after which the process's CUDA context is unusable (sticky errors).
STICKY_CUDA_ERRORS = (
    "illegal memory access", "illegal instruction", "misaligned address", "unspecified launch failure",
    "device-side assert", "an illegal", "launch timed out", "hardware stack error", "cuda error",
)
_COMPILE_MODULES = ("triton.compiler", "triton.language", "triton.backends")


@dataclass(frozen=True)
class Failure:
    """One candidate's failure: its category (one of ``CATEGORIES``) and a readable message."""

    category: str
    message: str

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"category must be one of {CATEGORIES}, got {self.category!r}")


@dataclass(frozen=True)
class Outcome:
    """What checking and timing one candidate gave: its time and error, or its failure."""

    milliseconds: float | None = None
    max_error: float | None = None
    failure: Failure | None = None


def is_sticky(err: BaseException) -> bool:
    """True when ``err`` is a CUDA error that leaves the process's CUDA context unusable."""
    text = str(err).lower()
    return any(words in text for words in STICKY_CUDA_ERRORS)


def classify(err: BaseException) -> str:
    """The category of an exception raised while building, launching or running a candidate."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import InterpreterError, OutOfResources, PTXASError

    text = str(err).lower()
    if isinstance(err, (OutOfResources, torch.OutOfMemoryError)) or "out of resource" in text or "out of memory" in text:
        return RESOURCE_LIMIT
    if isinstance(err, (CompilationError, PTXASError)) or type(err).__module__.startswith(_COMPILE_MODULES):
        return COMPILE_ERROR
    if isinstance(err, InterpreterError) or is_sticky(err):
        return CRASH
    return COMPILE_ERROR  # any other error before a result: the candidate could not be built or launched


def describe_exit(exitcode: int | None) -> str:
    """'killed by SIGSEGV' for a process's negative exit code, 'exit status N' otherwise."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit status {exitcode}"
