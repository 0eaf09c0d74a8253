"""UCXX progress on an asyncio loop that re-arms the worker after every wake-up and never spins.

ucxx 0.52's ``blocking`` progress mode watches the worker's epoll descriptor, but it arms the worker
(``ucp_worker_arm``) only once, in a task started with the loop; after the first wake-up the descriptor stays
readable and its reader runs on every turn of the loop. Where UCX's TCP transport has a connection (peers on other
hosts, or on this host without CMA), a transport with a connected peer and nothing to do would keep a core busy.
And where the worker always has work (a peer that died in the middle of a shared-memory message leaves UCX
retrying it: error handling is off), that first arming task never yields, so the next event loop to start ucxx
hangs, and so does ucxx's hook on a loop's close.

:class:`WorkerEvents` takes the descriptor over for one loop: on a wake-up it progresses the worker and arms it
again; if UCX says it is busy, it progresses again on the next turn of the loop, and after
:data:`BUSY_TURNS` busy turns in a row at growing intervals up to :data:`LONGEST_WAIT` (a worker busy forever
costs a poll every 10 ms, not a core; the transport calls :meth:`~WorkerEvents.kick` whenever it posts a
message, so that traffic is progressed at once even then). ucxx's own arming task is cancelled before it first
runs, and its once-a-second progress stays as a backstop.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any

__all__ = ["BUSY_TURNS", "LONGEST_WAIT", "WorkerEvents"]

log = logging.getLogger("kvferry.transports.ucx")

#: busy turns of the loop in a row before the progress calls are spaced out
BUSY_TURNS = 64
#: the longest wait between two progress calls of a worker that stays busy (seconds)
LONGEST_WAIT = 0.01
_FIRST_WAIT = 50e-6


class WorkerEvents:
    """Drives the UCXX worker from its epoll descriptor on ``loop``; one per loop (see :meth:`install`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, mode: Any) -> None:
        """``mode``: ucxx's progress object of the loop, which holds the worker (weakly here, as ucxx does)."""
        self._loop = loop
        self._mode = weakref.ref(mode)
        self._fd: int = mode.worker.epoll_file_descriptor
        self._busy = 0
        self._timer: asyncio.TimerHandle | asyncio.Handle | None = None
        self._reading = False
        #: wake-ups by the descriptor, busy answers of ``arm``, and progress calls in all
        self.wakeups = 0
        self.busy_answers = 0
        self.progress_calls = 0

    def __repr__(self) -> str:
        return (
            f"<WorkerEvents fd {self._fd} | {self.wakeups} wake-ups, {self.progress_calls} progress calls, "
            f"{self.busy_answers} busy, {self._busy} busy in a row>"
        )

    @classmethod
    def install(cls, loop: asyncio.AbstractEventLoop) -> WorkerEvents | None:
        """Take the worker's descriptor over on ``loop`` (after ``ucxx.continuous_ucx_progress()`` for it) and
        return the driver; None (ucxx's own progress stays) where ucxx does not run its ``blocking`` mode there
        or its internals are not those of 0.52. Calling it again for a loop returns the installed driver."""
        try:
            import ucxx._lib_async.application_context as application
            from ucxx._lib_async.continuous_ucx_progress import BlockingMode
        except ImportError:
            return None
        mode = application.ProgressTasks.get(loop)
        if not isinstance(mode, BlockingMode):
            return None
        installed = getattr(mode, "_kvferry_events", None)
        if isinstance(installed, WorkerEvents):
            return installed
        arm_task = getattr(mode, "arm_task", None)
        worker = getattr(mode, "worker", None)
        if not isinstance(arm_task, asyncio.Task) or worker is None:
            log.debug("ucxx's blocking progress is not the one known here; leaving it as it is")
            return None
        events = cls(loop, mode)
        arm_task.cancel()  # it may spin forever: the first turn below arms the worker instead
        loop.remove_reader(events._fd)
        events._read(True)
        mode._kvferry_events = events
        events._schedule(now=True)
        return events

    def kick(self) -> None:
        """Work was just handed to the worker (a message posted): progress it on the next turns of the loop, as
        after a wake-up, even where it has been busy for long."""
        self._busy = 0
        if isinstance(self._timer, asyncio.TimerHandle):  # a spaced-out turn: bring it forward
            self._timer.cancel()
            self._timer = None
        self._read(True)
        self._schedule(now=True)

    def _read(self, on: bool) -> None:
        """Watch the descriptor or not (not while a busy worker is polled at intervals: it stays readable)."""
        if on and not self._reading:
            self._loop.add_reader(self._fd, self._wake)
        elif not on and self._reading:
            self._loop.remove_reader(self._fd)
        self._reading = on

    def _wake(self) -> None:
        self.wakeups += 1
        self._turn()

    def _turn(self) -> None:
        self._timer = None
        mode = self._mode()
        worker = None if mode is None else mode.worker
        if worker is None or self._loop.is_closed():
            return
        self.progress_calls += 1
        worker.progress()
        if worker.arm():
            self._busy = 0  # the descriptor wakes us when there is more
            self._read(True)
            return
        self.busy_answers += 1
        self._busy += 1
        self._schedule(now=False)

    def _schedule(self, *, now: bool) -> None:
        if self._timer is not None:
            return
        if now or self._busy <= BUSY_TURNS:
            self._timer = self._loop.call_soon(self._turn)
        else:
            self._read(False)
            wait = min(LONGEST_WAIT, _FIRST_WAIT * 2 ** min(self._busy - BUSY_TURNS, 16))
            self._timer = self._loop.call_later(wait, self._turn)
