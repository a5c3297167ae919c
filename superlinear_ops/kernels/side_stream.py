"""Launches that run beside the current CUDA stream: a fork onto a high-priority side stream and a
join back.

A chain of small latency-bound launches (the span-tile plan: about 40 kernels of a few microseconds
each) waits behind every block of a large kernel queued before it on the same stream. Queued on a
higher-priority stream instead, each of its kernels takes the next multiprocessor that the large
kernel (the window part) frees, so the chain finishes while the large kernel runs. Fork and join are
events on the streams, so CUDA-graph capture records them as graph edges.
"""

from __future__ import annotations

from types import TracebackType

import torch

# One side stream per stream that forks (eager work and each graph capture fork from their own).
# torch.cuda.Stream() hands out streams of PyTorch's pool, so no CUDA call happens during a capture.
_SIDE: dict[torch.cuda.Stream, torch.cuda.Stream] = {}
PRIORITY = -1  # higher than PyTorch's default streams (0, the lowest)


def _side_of(main: torch.cuda.Stream) -> torch.cuda.Stream:
    side = _SIDE.get(main)
    while side is None or side == main:  # the pool is round-robin: never fork onto the stream itself
        side = torch.cuda.Stream(main.device, priority=PRIORITY)
        _SIDE[main] = side
    return side


class SideStream:
    """Launches made inside ``with side:`` run on a high-priority side stream that starts after the
    work already queued on the current stream (the fork happens at construction); ``join`` makes
    the current stream wait for them. Off CUDA both do nothing, so the launches run in place.

    Use: ``side = SideStream(device)``, large launches on the current stream, ``with side: a =
    small_launches()``, then ``side.join(*a's tensors)`` before the current stream reads them
    (the large launches go first so that the host queues them before the slow-to-queue chain).
    """

    def __init__(self, device: torch.device) -> None:
        self._main = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self._side = None if self._main is None else _side_of(self._main)
        self._context = None
        if self._side is not None:
            self._side.wait_stream(self._main)

    def __enter__(self) -> SideStream:
        if self._side is not None:
            self._context = torch.cuda.stream(self._side)
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
        if self._side is None:
            return
        self._main.wait_stream(self._side)
        for tensor in made:
            tensor.record_stream(self._main)
