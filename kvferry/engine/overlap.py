"""Host work on the event loop while a model step runs in its worker thread (``EngineConfig.overlap``).

:func:`run_overlapped` starts the step in a thread, then runs the loop's work for the next step (the last step's
commits, the next step's grows) while the thread computes. The step always ends before it returns: a failure of
the work is kept in the :class:`OverlapWindow` for the caller to raise once the step is accounted for, and a
cancel waits for the thread as ``anyio.to_thread.run_sync`` does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import anyio
from attrs import define

__all__ = ["OverlapWindow", "run_overlapped"]

T = TypeVar("T")


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
