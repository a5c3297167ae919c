"""``ops.side_stream.SideStream`` on stand-in CUDA streams (no GPU here): the fork, the side
stream's context, the join and the allocator marks, in the order a GPU relies on."""

from __future__ import annotations

import contextlib

import torch

from superlinear_ops.ops import side_stream


class FakeStream:
    """Records what is asked of it; equal to another only when it is the same object."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log, self.device = name, log, torch.device("cuda", 0)

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(f"{self.name} waits for {event.name}")


class FakeEvent:
    """Names itself by its number and the stream it was last recorded on."""

    def __init__(self, log: list, number: int) -> None:
        self.log, self.number, self.name = log, number, "unrecorded event"

    def record(self, stream: FakeStream) -> None:
        self.name = f"event {self.number} of {stream.name}"
        self.log.append(f"{stream.name} records event")


class FakeTensor:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def record_stream(self, stream: FakeStream) -> None:
        self.log.append(f"{self.name} used by {stream.name}")


def fake_cuda(monkeypatch, log: list, pool: list[str]) -> list[FakeEvent]:
    """torch.cuda's streams and events replaced: the current stream is "main"; Stream() hands out
    ``pool`` in order (as PyTorch's round-robin pool may hand out the current stream itself).
    Returns the list of the events made so far."""
    main = FakeStream("main", log)
    streams = iter(pool)
    events: list[FakeEvent] = []

    def new_stream(device=None, priority=0):
        name = next(streams)
        log.append(f"new {name} at priority {priority}")
        return main if name == "main" else FakeStream(name, log)

    def new_event():
        events.append(FakeEvent(log, len(events)))
        return events[-1]

    @contextlib.contextmanager
    def current(stream):
        log.append(f"enter {stream.name}")
        yield
        log.append(f"leave {stream.name}")

    monkeypatch.setattr(side_stream, "_FORKS", {})
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "Event", new_event)
    monkeypatch.setattr(torch.cuda, "stream", current)
    return events


def test_fork_context_join_and_allocator_marks_in_order(monkeypatch) -> None:
    log: list = []
    events = fake_cuda(monkeypatch, log, ["main", "side"])  # the pool hands out the current stream first: skipped
    side = side_stream.SideStream(torch.device("cuda"))
    log.append("large launch on main")
    with side:
        log.append("small launches")
    side.join(FakeTensor("order", log), FakeTensor("lo", log))
    forked, joined = (e.name for e in events)
    assert log == [
        f"new main at priority {side_stream.PRIORITY}", f"new side at priority {side_stream.PRIORITY}",
        "main records event", f"side waits for {forked}", "large launch on main", "enter side", "small launches",
        "leave side", "side records event", f"main waits for {joined}", "order used by main", "lo used by main",
    ]
    assert forked.endswith("of main") and joined.endswith("of side")
    assert side_stream.PRIORITY < 0  # above PyTorch's default streams


def test_one_side_stream_and_two_events_per_forking_stream(monkeypatch) -> None:
    """Every call forks and joins again, on the same side stream with the same two events."""
    log: list = []
    events = fake_cuda(monkeypatch, log, ["side", "unused"])
    for _ in range(3):
        side_stream.SideStream(torch.device("cuda")).join()
    assert [entry for entry in log if entry.startswith("new")] == [f"new side at priority {side_stream.PRIORITY}"]
    assert len(events) == 2
    assert log.count("main records event") == 3 and log.count("side records event") == 3


def test_off_cuda_no_stream_is_touched(monkeypatch) -> None:
    """On the CPU (the interpreter's tests) the launches run in place: no stream call at all."""
    def no_streams(*args, **kwargs):
        raise AssertionError("a CUDA stream call off CUDA")

    for name in ("current_stream", "Stream", "Event", "stream"):
        monkeypatch.setattr(torch.cuda, name, no_streams)
    monkeypatch.setattr(side_stream, "_FORKS", {})
    side = side_stream.SideStream(torch.device("cpu"))
    with side:
        made = torch.arange(4)
    side.join(made)
    assert side_stream._FORKS == {}
