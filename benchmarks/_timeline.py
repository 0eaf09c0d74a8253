"""Where a transfer's time goes: named functions wrapped to record each call's start and end.

Each wrapped call records its start and end on ``time.perf_counter``, which on Linux is the system-wide
monotonic clock, so stamps taken in a sender and a receiver process lie on one time axis:

- ``disagg_2p.py --timeline`` ships the sender's events with each transfer's note and merges them with the
  receiver's, relative to the moment the receiver began the transfer (:func:`summarise`): the request's trip,
  the sender's plan, checks, table, launch and wait, the notification's trip and the receiver's bookkeeping,
  each where it happens;
- ``--stages`` (``latency.py``, ``disagg_2p.py``) reports each wrapped function's median time per call
  (:meth:`Timeline.durations_us`).

Targets are named by module and attribute (``"kvferry.kernels.span_copy", "_Launcher.launch"``) and looked up
in that module and its submodules, so a name that moved between the modules of a package is still found; a
name that no longer exists is skipped and listed in :attr:`Timeline.missing`. A wrapper costs about a
microsecond per call: a run with a timeline is for finding the time, not for the figures of record.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

Event = tuple[str, float, float]

#: (module, attribute, label) of the stages of a write and of a message's or notification's trip; ``T.`` is
#: the transport's class (its own attribute when it has one, else the channel base's), ``P.`` its data path's class
TRANSFER_PATH: tuple[tuple[str, str, str], ...] = (
    ("kvferry.transports.channel", "ChannelTransport.write", "T.write"),
    ("kvferry.transports.channel", "ChannelTransport.write_many", "T.write_many"),
    ("kvferry.transports.writes", "WritePipeline.checked", "T.writes.checked"),
    ("P", "write", "P.write"),
    ("P", "write_together", "P.write_together"),
    ("P", "_ipc_route", "P._ipc_route"),
    ("kvferry.transports._memory", "CopyPlan.run", "CopyPlan.run"),
    ("kvferry.transports._memory", "CopyPlan._device_rows", "CopyPlan._device_rows"),
    ("kvferry.kernels.span_copy", "piece_table", "span_copy.piece_table"),
    ("kvferry.kernels.span_copy", "pinned_table", "span_copy.pinned_table"),
    ("kvferry.kernels.span_copy", "Launcher.launch", "span_copy.launch"),
    ("kvferry.transports._memory", "synchronize_cuda", "synchronize_cuda"),
    ("kvferry.transports._memory", "wait_event", "wait_event"),
    ("kvferry.transports.control", "ControlChannel.send_frames", "T.control.send_frames"),
    ("kvferry.transports.control", "ControlChannel.send_message", "T.control.send_message"),
    ("kvferry.transports.control", "ControlChannel._dispatch", "T.control._dispatch (control frame in)"),
    ("kvferry.transports._framing", "FrameReader.receive_exactly", "reader.receive_exactly"),
    ("kvferry.disagg.protocol", "encode_control", "encode_control"),
    ("kvferry.disagg.protocol", "decode_control", "decode_control"),
    ("kvferry.disagg.transfer", "plan_transfer", "plan_transfer"),
    ("kvferry.disagg.session", "send", "session.send"),
    ("kvferry.disagg.session", "Receiver.on_result", "Receiver.on_result"),
    ("kvferry.disagg.session", "Receiver.receive", "Receiver.receive"),
    ("kvferry.disagg.mapping", "RankMap.plan", "RankMap.plan"),
)

#: the stages of one write on the writer's side (``--stages``), with labels that say what each covers
WRITE_STAGES: tuple[tuple[str, str, str], ...] = (
    ("T", "write", "write (whole)"),
    ("kvferry.transports.writes", "WritePipeline.checked", "checked (pairing, coalesce, locate)"),
    ("P", "write", "data path write (route + copy + notify)"),
    ("P", "_ipc_route", "ipc route"),
    ("kvferry.transports._memory", "CopyPlan.run", "CopyPlan.run (queue + sync)"),
    ("kvferry.transports._memory", "CopyPlan._device_rows", "device rows (queue)"),
    ("kvferry.kernels.span_copy", "piece_table", "piece table"),
    ("kvferry.kernels.span_copy", "copy_spans", "copy_spans (table + upload + launch)"),
    ("kvferry.kernels.span_copy", "copy_fragments", "copy_fragments (rows + upload + launch)"),
    ("kvferry.kernels.span_copy", "upload", "table upload"),
    ("kvferry.kernels.span_copy", "pinned_table", "pinned table"),
    ("kvferry.kernels.span_copy", "upload_held", "table upload (grid)"),
    ("kvferry.transports._memory", "wait_event", "wait_event"),
    ("kvferry.kernels.span_copy", "Launcher.launch", "launch"),
    ("kvferry.transports._memory", "synchronize_cuda", "synchronize_cuda"),
    ("kvferry.transports.control", "ControlChannel.send_frame", "send_frame"),
)


def _find(
    module: str, path: str, transport: type | None, data_path: type | None = None
) -> tuple[Any, str] | None:
    """The owner of ``path``'s last attribute (a module or class) and that attribute's name, or None.

    ``module`` ``"T"`` is the transport's class, ``"P"`` its data path's class; otherwise the module and its loaded submodules are searched
    for the first part of ``path``."""
    head, _, rest = path.partition(".")
    if module in ("T", "P"):
        owner = transport if module == "T" else data_path
        if owner is None:
            return None
        return (owner, head) if hasattr(owner, head) else None
    try:
        importlib.import_module(module)
    except ImportError:
        return None
    modules = [m for name, m in list(sys.modules.items()) if name == module or name.startswith(module + ".")]
    for candidate in modules:
        owner = getattr(candidate, head, None)
        if owner is None:
            continue
        if not rest:
            return candidate, head
        return (owner, rest) if hasattr(owner, rest) else None
    return None


class Timeline:
    """Start and end stamps of the wrapped calls, kept until :meth:`take`."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        #: the targets of :meth:`wrap_all` that were not found (renamed or gone), as ``module:path``
        self.missing: list[str] = []

    def __repr__(self) -> str:
        return f"Timeline(events={len(self.events)}, missing={self.missing})"

    def wrap(self, owner: Any, name: str, label: str | None = None) -> None:
        """Replace ``owner.name`` (a function of a module or class) by one that records each call."""
        original = inspect.getattr_static(owner, name)
        unwrap = original.__func__ if isinstance(original, staticmethod | classmethod) else original
        label = label or f"{getattr(owner, '__name__', owner)}.{name}"
        events = self.events
        clock = time.perf_counter  # system-wide on Linux: one axis for both processes
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

    def wrap_all(self, targets: Iterable[tuple[str, str, str]], transport: Any = None) -> None:
        """Wrap every ``(module, attribute path, label)`` of ``targets`` that exists; ``transport`` (a transport
        or its class) stands for the module ``"T"``, and its data path's class (known from a transport, not
        from a class) for ``"P"``."""
        cls = transport if isinstance(transport, type) or transport is None else type(transport)
        path_object = getattr(transport, "data_path", None) if not isinstance(transport, type) else None
        data_path = type(path_object) if path_object is not None else None
        for module, path, label in targets:
            found = _find(module, path, cls, data_path)
            if found is None:
                self.missing.append(f"{module}:{path}")
            else:
                self.wrap(*found, label)

    def mark(self, label: str) -> None:
        now = time.perf_counter()
        self.events.append((label, now, now))

    def take(self) -> list[Event]:
        out = list(self.events)
        self.events.clear()
        return out

    def durations_us(self) -> dict[str, float]:
        """Per label, the median time of one call in microseconds (the first call left out when there are
        several: it pays one-off costs)."""
        times: dict[str, list[float]] = defaultdict(list)
        for label, began, ended in self.events:
            times[label].append((ended - began) * 1e6)
        return {label: statistics.median(v[1:] or v) for label, v in times.items()}


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
    rows: list[dict[str, Any]] = [
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


def transfer_timeline(transport: Any) -> Timeline:
    """A timeline of the stages of a write and of a message's or notification's trip through ``transport``
    (a transport, or its class)."""
    timeline = Timeline()
    timeline.wrap_all(TRANSFER_PATH, transport)
    return timeline


def write_stages(transport: Any) -> Timeline:
    """A timeline of the stages of one write by ``transport`` (read with :meth:`Timeline.durations_us`)."""
    timeline = Timeline()
    timeline.wrap_all(WRITE_STAGES, transport)
    return timeline
