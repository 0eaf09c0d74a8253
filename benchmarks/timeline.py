"""A cross-process timeline of one transfer: where its time goes, on both sides, in order.

Wraps named functions (sync or async) so that each call records its start and end on ``time.perf_counter``,
which on Linux is the system-wide monotonic clock: stamps taken in the sender and the receiver process are on one
time axis. ``disagg_2p.py --timeline`` ships the sender's events with each transfer's note and merges them with
the receiver's, relative to the moment the receiver began the transfer; the medians over the repetitions show
the request's trip, the sender's plan, checks, table, launch and wait, the notification's trip and the
receiver's bookkeeping, each where it happens.

A wrapper costs about a microsecond per call; a run with a timeline is for finding the time, not for the
figures of record.
"""

from __future__ import annotations

import functools
import inspect
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

Event = tuple[str, float, float]


class Timeline:
    """Start and end stamps of the wrapped calls, kept until :meth:`take`."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def wrap(self, owner: Any, name: str, label: str | None = None) -> None:
        """Replace ``owner.name`` (a function of a module or class) by one that records each call."""
        original = inspect.getattr_static(owner, name)
        unwrap = original.__func__ if isinstance(original, staticmethod | classmethod) else original
        label = label or f"{getattr(owner, '__name__', owner)}.{name}"
        events = self.events
        clock = time.perf_counter
        if inspect.iscoroutinefunction(unwrap):

            @functools.wraps(unwrap)
            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                began = clock()
                try:
                    return await unwrap(*args, **kwargs)
                finally:
                    events.append((label, began, clock()))

            wrapped: Any = timed_async
        else:

            @functools.wraps(unwrap)
            def timed(*args: Any, **kwargs: Any) -> Any:
                began = clock()
                try:
                    return unwrap(*args, **kwargs)
                finally:
                    events.append((label, began, clock()))

            wrapped = timed
        if isinstance(original, staticmethod):
            wrapped = staticmethod(wrapped)
        elif isinstance(original, classmethod):
            wrapped = classmethod(wrapped)
        setattr(owner, name, wrapped)
        if inspect.ismodule(owner):  # the names other modules imported (``from module import name``)
            for module in list(sys.modules.values()):
                if getattr(module, name, None) is original:
                    setattr(module, name, wrapped)

    def mark(self, label: str) -> None:
        now = time.perf_counter()
        self.events.append((label, now, now))

    def take(self) -> list[Event]:
        out = list(self.events)
        self.events.clear()
        return out


def summarise(runs: Sequence[Iterable[Event]], origins: Sequence[float]) -> list[dict[str, Any]]:
    """Per event (the k-th call of a label is its own event), the medians over ``runs`` of its start and end
    relative to each run's origin, in microseconds, ordered by start."""
    starts: dict[str, list[float]] = defaultdict(list)
    ends: dict[str, list[float]] = defaultdict(list)
    for events, origin in zip(runs, origins, strict=True):
        seen: dict[str, int] = defaultdict(int)
        for label, began, ended in sorted(events, key=lambda e: e[1]):
            key = f"{label}[{seen[label]}]" if seen[label] else label
            seen[label] += 1
            starts[key].append((began - origin) * 1e6)
            ends[key].append((ended - origin) * 1e6)
    rows = [
        {
            "event": key,
            "start_us": round(statistics.median(starts[key]), 1),
            "end_us": round(statistics.median(ends[key]), 1),
            "runs": len(starts[key]),
        }
        for key in starts
    ]
    for row in rows:
        row["us"] = round(row["end_us"] - row["start_us"], 1)
    return sorted(rows, key=lambda r: r["start_us"])


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    return "\n".join(
        f"  {r['start_us']:9.1f} {r['end_us']:9.1f} {r['us']:8.1f}  {r['event']} ({r['runs']})" for r in rows
    )


def wrap_transfer_path(timeline: Timeline, transport: Any) -> None:
    """The stages of a write and of a message's or notification's trip through ``transport`` (a transport, or
    its class)."""
    from kvferry.disagg import mapping, protocol, session, transfer
    from kvferry.kernels import span_copy
    from kvferry.transports import _framing, _memory, channel, control, writes

    path = type(getattr(transport, "data_path", None))
    for owner, name, label in (
        (channel.ChannelTransport, "write", "T.write"),
        (channel.ChannelTransport, "write_many", "T.write_many"),
        (writes.WritePipeline, "checked", "T.writes.checked"),
        (path, "write", "T.data_path.write"),
        (path, "write_together", "T.data_path.write_together"),
        (path, "_ipc_route", "T.data_path._ipc_route"),
        (_memory.CopyPlan, "run", "CopyPlan.run"),
        (_memory.CopyPlan, "_device_rows", "CopyPlan._device_rows"),
        (span_copy, "piece_table", "span_copy.piece_table"),
        (span_copy, "_pinned_table", "span_copy._pinned_table"),
        (span_copy._Launcher, "launch", "span_copy.launch"),
        (_memory, "synchronize_cuda", "synchronize_cuda"),
        (_memory, "wait_event", "wait_event"),
        (control.ControlChannel, "send_frames", "T.control.send_frames"),
        (channel.ChannelTransport, "send_message", "T.send_message"),
        (control.ControlChannel, "_dispatch", "T.control._dispatch (control frame in)"),
        (_framing.FrameReader, "receive_exactly", "reader.receive_exactly"),
        (protocol, "encode_control", "encode_control"),
        (protocol, "decode_control", "decode_control"),
        (transfer, "plan_transfer", "plan_transfer"),
        (session, "send", "session.send"),
        (session.Receiver, "on_result", "Receiver.on_result"),
        (session.Receiver, "receive", "Receiver.receive"),
        (mapping.RankMap, "plan", "RankMap.plan"),
    ):
        if hasattr(owner, name):
            timeline.wrap(owner, name, label)
