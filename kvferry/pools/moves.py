"""One request's copy to the host or back, in flight: the middle of a two-phase offload or restore.

:meth:`CacheManager.start_offload <kvferry.pools.manager.CacheManager.start_offload>` and
:meth:`~kvferry.pools.manager.CacheManager.start_restore` do the bookkeeping (synchronous, all or nothing) and
return a :class:`PendingMove`; its :meth:`~PendingMove.run` moves the bytes, in whatever thread calls it (a worker
thread, so the event loop never waits for a copy); :meth:`CacheManager.finish
<kvferry.pools.manager.CacheManager.finish>` commits the move (or rolls it back). Between start and finish the
request is *moving*.

On CUDA the copy runs on a side stream of the manager, after everything queued on the arena device's current
stream when the move started (so it reads what the model wrote, and writes no page an earlier step still
reads), and :meth:`~PendingMove.run` waits for its event; :meth:`CacheManager.finish` then orders the current
stream after the copy. On the host the copy runs in the calling thread, in chunks that release the GIL.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kvferry.kernels.span_copy.cuda import on_device

if TYPE_CHECKING:
    from kvferry.pools.host_memory import HostBuffer
    from kvferry.pools.quarantine import Quarantine
    from kvferry.pools.record import HostCopy, RequestId, RequestRecord

__all__ = ["BLOCKING_WAIT_BYTES", "CopyFn", "MoveKind", "MoveState", "PendingMove"]

#: On CUDA a move of at least this many bytes waits for its copy asleep, a smaller one spinning.
BLOCKING_WAIT_BYTES = 64 << 20

#: A move's copy: ``copy(stop) -> True`` when every byte was copied, False when ``stop()`` ended it early.
CopyFn = Callable[[Callable[[], bool]], bool]


class MoveKind(enum.Enum):
    """Which way a move copies."""

    #: device -> host: the request's pages, slot and replay state are saved, then freed on the device
    OFFLOAD = "offload"
    #: host -> device: the host copy is written into new pages and a new slot, then dropped
    RESTORE = "restore"


class MoveState(enum.Enum):
    """Where a move's copy stands."""

    #: started, the copy not yet run
    PENDING = "pending"
    #: a thread is copying
    COPYING = "copying"
    #: every byte is copied
    COPIED = "copied"
    #: stopped by :meth:`PendingMove.abort` before every byte was copied
    ABORTED = "aborted"
    #: the copy raised (:attr:`PendingMove.error`)
    FAILED = "failed"
    #: committed or rolled back by ``finish``: nothing of the manager refers to it any more
    FINISHED = "finished"


class PendingMove:
    """A request's cache on its way to the host (:attr:`kind` OFFLOAD) or back (RESTORE).

    Made by the manager's ``start_offload`` / ``start_restore``; give it to the same manager's ``finish``
    exactly once whatever happens (the manager holds the request's device memory and host buffer for it until
    then). :meth:`run`, :meth:`abort`, :meth:`wait` and :attr:`done` may be used from any thread.
    """

    def __init__(
        self,
        kind: MoveKind,
        record: RequestRecord,
        *,
        owner: object,
        nbytes: int,
        copy: CopyFn | None,
        device: torch.device | None,
        stream: Any = None,
    ) -> None:
        self.kind = kind
        self.request_id: RequestId = record.request_id
        #: bytes the copy moves (0: nothing to copy, bookkeeping only)
        self.nbytes = nbytes
        self.error: BaseException | None = None
        self._record = record
        self._owner = owner
        self._copy = copy
        self._device = device
        self._stream = stream
        self._ready: Any = None
        self._copied: Any = None
        self._state = MoveState.PENDING if copy is not None else MoveState.COPIED
        self._lock = threading.Lock()
        self._ended = threading.Event()
        self._stop = False
        if copy is None:
            self._ended.set()
        elif device is not None and device.type == "cuda":
            # the copy must see every write queued so far (and write no page a queued step still reads)
            self._ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._ready.record(torch.cuda.current_stream(device))
        # the manager's side of the move (set by HostOffload; read by it and the manager only)
        #: device memory the move holds: the request's (OFFLOAD) or the new pages and slot (RESTORE)
        self.pages: list[int] = []
        self.draft_pages: list[int] = []
        self.slot: int | None = None
        #: OFFLOAD: the host buffer it writes; RESTORE: the host copy it reads (dropped when it commits)
        self.buffer: HostBuffer | None = None
        self.host: HostCopy | None = None
        #: OFFLOAD: where each part lies in the buffer (the offload's own description)
        self.layout: object = None
        #: RESTORE: mark the request Offload.NEVER when it is back
        self.pin = False
        #: the request was closed while moving: finish frees what the move holds
        self.closed = False
        #: the close quarantined the device memory: the quarantine frees it, once released and the copy ended
        self.quarantine: Quarantine | None = None
        self.quarantine_released = False

    # --- the copy ------------------------------------------------------------------------------------------

    @property
    def state(self) -> MoveState:
        return self._state

    @property
    def done(self) -> bool:
        """True once the copy ended (copied, aborted or failed): ``finish`` will not wait."""
        return self._ended.is_set()

    @property
    def copied(self) -> bool:
        """True when every byte was copied (or there was nothing to copy)."""
        return self._state is MoveState.COPIED

    def run(self) -> None:
        """Copy the bytes and return when the copy ended; never raises (a failure is kept in :attr:`error`).

        The first call copies, in the calling thread (on CUDA: queues the copy on the side stream and waits for
        it); a later or concurrent call waits for that copy to end. After :meth:`abort` (or once ``finish``
        ran) it copies nothing.
        """
        with self._lock:
            first = self._state is MoveState.PENDING
            aborted = self._stop
            if first:
                self._state = MoveState.ABORTED if aborted else MoveState.COPYING
        if not first:
            self._ended.wait()
            return
        if aborted:
            self._ended.set()
            return
        assert self._copy is not None
        state = MoveState.FAILED
        try:
            state = MoveState.COPIED if self._run_copy(self._copy) else MoveState.ABORTED
        except BaseException as exc:  # kept for finish, which raises it in the caller's thread
            self.error = exc
        finally:
            self._state = state
            self._ended.set()

    def _run_copy(self, copy: CopyFn) -> bool:
        device = self._device
        if device is None or device.type != "cuda":
            return copy(self._stopped)
        stream = self._stream
        with on_device(device), torch.cuda.stream(stream):
            stream.wait_event(self._ready)
            completed = copy(self._stopped)
            # a large copy's thread sleeps on the event instead of spinning a core; a small one spins (waking a
            # sleeping thread costs more than the copy)
            copied = torch.cuda.Event(blocking=self.nbytes >= BLOCKING_WAIT_BYTES)  # type: ignore[no-untyped-call]
            copied.record(stream)
        self._copied = copied
        copied.synchronize()
        return completed

    def _stopped(self) -> bool:
        return self._stop

    def abort(self) -> None:
        """Ask the copy to stop: one not yet running never runs, a host copy stops at its next chunk, a CUDA copy
        queues no more chunks (what is queued runs). ``finish`` then rolls the move back. Thread-safe."""
        self._stop = True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the copy ended (or ``timeout`` seconds passed); True when it ended."""
        return self._ended.wait(timeout)

    def order_after_copy(self) -> None:
        """Make the device's current stream wait for the copy (a restore's pages are read only after it)."""
        if self._copied is not None and self._device is not None:
            torch.cuda.current_stream(self._device).wait_event(self._copied)

    def end(self) -> None:
        """Mark the move finished (``finish`` ran) and drop what it referred to."""
        with self._lock:
            self._state = MoveState.FINISHED
            self._copy = None
        self._ended.set()

    # --- the manager's side ------------------------------------------------------------------------------------

    @property
    def owner(self) -> object:
        """The offload component of the manager that made it (``finish`` refuses another's moves)."""
        return self._owner

    @property
    def record(self) -> RequestRecord:
        return self._record

    def __repr__(self) -> str:
        closed = ", closed" if self.closed else ""
        return f"<PendingMove {self.kind.value} of {self.request_id!r}: {self.nbytes} B, {self._state.value}{closed}>"
