"""Launches that run beside the current CUDA stream: a fork onto a high-priority side stream and a
join back.

A chain of small latency-bound launches (the span-tile plan: a key kernel, a sort of a few kernels
and a bounds kernel) waits behind every block of a large kernel queued before it on the same stream. Queued on a
higher-priority stream instead, each of its kernels takes the next multiprocessor that the large
kernel (the window part) frees, so the chain finishes while the large kernel runs. Fork and join are
events on the streams, so CUDA-graph capture records them as graph edges.
"""

from __future__ import annotations

from types import TracebackType
from typing import NamedTuple

import torch

PRIORITY = -1  # higher than PyTorch's default streams (0, the lowest)


class _Fork(NamedTuple):
    """A forking stream's side stream and the two events that order it (reused every call: a wait
    holds the event's state at the time it is queued, so recording it again later is safe)."""

    side: torch.cuda.Stream
    forked: torch.cuda.Event  # recorded on the forking stream, waited for by the side stream
    joined: torch.cuda.Event  # recorded on the side stream, waited for by the forking stream


# One fork per stream that forks (eager work and each graph capture fork from their own).
# torch.cuda.Stream() hands out streams of PyTorch's pool, so no stream is created during a capture.
_FORKS: dict[torch.cuda.Stream, _Fork] = {}


def _fork_of(main: torch.cuda.Stream) -> _Fork:
    fork = _FORKS.get(main)
    if fork is None:
        side = torch.cuda.Stream(main.device, priority=PRIORITY)
        while side == main:  # the pool is round-robin: never fork onto the stream itself
            side = torch.cuda.Stream(main.device, priority=PRIORITY)
        fork = _FORKS[main] = _Fork(side, torch.cuda.Event(), torch.cuda.Event())
    return fork


class SideStream:
    """Launches made inside ``with side:`` run on a high-priority side stream that starts after the
    work already queued on the current stream (the fork happens at construction); ``join`` makes
    the current stream wait for them. Off CUDA both do nothing, so the launches run in place.

    Use: ``side = SideStream(device)``, large launches on the current stream, ``with side: a =
    small_launches()``, then ``side.join(*a's tensors)`` before the current stream reads them
    (the large launches go first so that the host queues them before the slow-to-queue chain).
    Fork and join are one event record and one wait each, with events made once per forking stream
    (``Stream.wait_stream`` makes a new event every call: host time that showed where the call is
    host-bound).
    """

    def __init__(self, device: torch.device) -> None:
        self._main = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self._fork = None if self._main is None else _fork_of(self._main)
        self._context = None
        if self._fork is not None:
            self._fork.forked.record(self._main)
            self._fork.side.wait_event(self._fork.forked)

    def __enter__(self) -> SideStream:
        if self._fork is not None:
            self._context = torch.cuda.stream(self._fork.side)
            self._context.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        if self._context is not None:
            self._context.__exit__(kind, error, trace)
            self._context = None

    def join(self, *made: torch.Tensor) -> None:
        """Make the current stream wait for the side stream's launches; ``made``, the tensors they
        allocated, are marked as used by the current stream (the allocator keeps them until its
        work on them is done)."""
        if self._fork is None:
            return
        self._fork.joined.record(self._fork.side)
        self._main.wait_event(self._fork.joined)
        for tensor in made:
            tensor.record_stream(self._main)
