"""Host work on the event loop while a model step runs (``EngineConfig.overlap``).

:func:`run_overlapped` starts the step in a thread, then runs the loop's work for the next step (the last step's
commits, the next step's grows) while the thread computes. :func:`run_launched` launches the step on the loop
itself (a device that computes asynchronously: the launch returns before the step ends, ``launch_on_loop``), runs
the work, then waits for the step's tokens. Either way the step always ends before it returns: a failure of the
work is kept in the :class:`OverlapWindow` for the caller to raise once the step is accounted for, and a cancel
waits for the step (the thread, or the device) to end.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from attrs import define

__all__ = ["OverlapWindow", "run_launched", "run_overlapped"]

T = TypeVar("T")
R = TypeVar("R")


@define
class OverlapWindow:
    """The host work one overlapped step did while its model ran."""

    #: seconds the work took (on the loop, while the step ran)
    seconds: float = 0.0
    #: what the work raised (None: it completed)
    error: Exception | None = None


async def run_overlapped(step: Callable[[], T], work: Callable[[], None], window: OverlapWindow) -> T:
    """``step()`` in a worker thread while ``work()`` runs on the loop; ``step``'s result.

    ``work`` must not touch what ``step`` reads. Its exception goes into ``window.error``; ``step``'s is raised
    as itself (not in an exception group).
    """
    result: list[T] = []
    failed: list[Exception] = []

    async def in_thread() -> None:
        try:
            result.append(await anyio.to_thread.run_sync(step))
        except Exception as exc:  # raised below, unwrapped
            failed.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(in_thread)
        await anyio.lowlevel.checkpoint()  # the thread starts before the work
        start = time.perf_counter()
        try:
            work()
        except Exception as exc:  # the caller raises it once the step ended
            window.error = exc
        window.seconds = time.perf_counter() - start
    if failed:
        raise failed[0]
    return result[0]


async def run_launched(
    launch: Callable[[], tuple[T, Callable[[], Awaitable[R]]]],
    work: Callable[[], None] | None,
    window: OverlapWindow,
) -> tuple[T, R]:
    """``launch()`` on the loop, then ``work()`` (when given) while the launched step runs, then the step's
    ``wait()``; ``launch``'s value and ``wait``'s. ``launch``'s exception is raised as itself; ``work``'s goes into
    ``window.error``. ``wait`` must end the step even when cancelled."""
    launched, wait = launch()
    if work is not None:
        start = time.perf_counter()
        try:
            work()
        except Exception as exc:  # the caller raises it once the step ended
            window.error = exc
        window.seconds = time.perf_counter() - start
    return launched, await wait()
