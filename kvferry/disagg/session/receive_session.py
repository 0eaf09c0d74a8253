"""The generation side's core of one transfer: which writers must report, what they reported, and the state.

A :class:`ReceiveSession` does no I/O and never blocks; :class:`~.receiver.Receiver` drives it. Every state
change goes through one transition table (:data:`RECEIVE_TRANSITIONS`); a pair that is not there raises
:class:`~kvferry.errors.InvalidTransition`. The states::

    ALLOCATED ──requested()──> REQUESTED ──every writer reported──> COMPLETE | FAILED | CANCELLED
        │                        │  │  │
        │                        │  │  └─ stalled(), writers out ──> IN_DOUBT ───┐ every writer reported,
        │                        │  └─ cancel(), writers out ──> CANCELLING ─────┤ the sender's CancelAck
        │                        │                                               │ or the peer lost
        │                        │                                               └──> CANCELLED
        │                        └─ not_sent() / peer_lost() ──> FAILED
        └─ cancel() ──> CANCELLED;  peer_lost() ──> FAILED

COMPLETE, FAILED and CANCELLED are terminal: nothing can land in the pages any more (:attr:`ReceiveSession.settled`).
CANCELLING and IN_DOUBT keep the pages quarantined: writes may still land until they settle.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import attrs
from attrs import define

from kvferry.disagg.protocol import ChunkResult, ChunkStatus
from kvferry.errors import InvalidTransition, WireFormatError

__all__ = ["RECEIVE_TRANSITIONS", "CancelAction", "ReceiveSession", "ReceiveState", "TransferStatistics"]


class TransferStatistics(NamedTuple):
    """What one transfer moved, as the receiver counted it from the writers' reports."""

    session_id: int
    nbytes: int
    fragments: int
    chunks: int
    writers: int
    seconds: float
    #: writers whose bytes came through a staging area (scattered by the receiver)
    bounced: int = 0


class ReceiveState(enum.Enum):
    """Where one transfer is on the receiving side (the module docstring draws the moves)."""

    #: pages allocated, nothing asked yet
    ALLOCATED = "allocated"
    #: receive request being sent or sent; writers reporting (reports may arrive before the send returns)
    REQUESTED = "requested"
    #: cancelled while writers were still to report: pages quarantined until they have
    CANCELLING = "cancelling"
    #: the stall deadline passed with writers still to report: pages quarantined until they do
    IN_DOUBT = "in_doubt"
    #: every writer reported every chunk OK: the pages hold the request's cache
    COMPLETE = "complete"
    #: every writer reported and some chunk failed, or the peer is gone
    FAILED = "failed"
    #: cancelled, and nothing can land any more
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in (ReceiveState.COMPLETE, ReceiveState.FAILED, ReceiveState.CANCELLED)


class CancelAction(enum.Enum):
    """What the receiver does with the pages when it gives a transfer up (:meth:`ReceiveSession.cancel`)."""

    #: nothing was asked or everything has reported: free the pages now
    FREE = "free"
    #: writers may still write: quarantine the pages and tell the sender to stop
    QUARANTINE = "quarantine"
    #: already ended (or already cancelling): nothing to do
    NOTHING = "nothing"


#: The one table of allowed transitions: ``RECEIVE_TRANSITIONS[src]`` is the set of states ``src`` may move to.
RECEIVE_TRANSITIONS: dict[ReceiveState, frozenset[ReceiveState]] = {
    ReceiveState.ALLOCATED: frozenset({ReceiveState.REQUESTED, ReceiveState.CANCELLED, ReceiveState.FAILED}),
    ReceiveState.REQUESTED: frozenset(
        {
            ReceiveState.COMPLETE,
            ReceiveState.FAILED,
            ReceiveState.CANCELLING,
            ReceiveState.CANCELLED,
            ReceiveState.IN_DOUBT,
        }
    ),
    ReceiveState.CANCELLING: frozenset({ReceiveState.CANCELLED}),
    ReceiveState.IN_DOUBT: frozenset({ReceiveState.CANCELLED}),
    ReceiveState.COMPLETE: frozenset(),
    ReceiveState.FAILED: frozenset(),
    ReceiveState.CANCELLED: frozenset(),
}


@define(eq=False)
class ReceiveSession:
    """The generation side of one transfer: which writers must report, and what they reported.

    ``writers`` are the context ranks; each one reports every one of its chunks (it says how many it has in
    each report). The session completes only when all have reported; never on a timeout (see the
    module docstring for its states).
    """

    session_id: int
    key: str
    writers: tuple[int, ...]
    #: writers offered a staging area (only they may report staged chunks)
    staging_writers: frozenset[int] = frozenset()
    state: ReceiveState = ReceiveState.ALLOCATED
    detail: str = ""
    _num_chunks: dict[int, int] = attrs.field(factory=dict, init=False)
    _staged: dict[int, bool] = attrs.field(factory=dict, init=False)
    _reports: dict[tuple[int, int], ChunkResult] = attrs.field(factory=dict, init=False)

    def _move(self, dst: ReceiveState) -> None:
        if dst not in RECEIVE_TRANSITIONS[self.state]:
            raise InvalidTransition(f"receive session {self.session_id}: {self.state.name} -> {dst.name}")
        self.state = dst

    def requested(self) -> None:
        """The receive request is (about to be) sent: ALLOCATED -> REQUESTED.

        Call it *before* sending: writers may report before the send returns. Reports recorded while
        ALLOCATED are not lost: if every writer already reported everything, the session settles here.
        """
        self._move(ReceiveState.REQUESTED)
        if self.all_reported:
            self._settle()

    def not_sent(self, reason: str) -> None:
        """The receive request provably never left (the transport refused it whole): REQUESTED -> FAILED, so
        the pages are freed. No-op once a writer reported (then it did arrive somewhere)."""
        if self.state is ReceiveState.REQUESTED and not self._reports:
            self.detail = self.detail or reason
            self._move(ReceiveState.FAILED)

    def on_result(self, report: ChunkResult) -> None:
        """Record one writer's report; moves to COMPLETE / FAILED / CANCELLED once every writer reported.

        :raises ~kvferry.errors.WireFormatError: a report from a writer we do not expect, or whose chunk
            count disagrees with its earlier reports (the session fails; nothing else changes).
        """
        if report.writer not in self.writers:
            raise WireFormatError(f"session {self.session_id}: report from unexpected writer {report.writer}")
        known = self._num_chunks.get(report.writer, report.num_chunks)
        if known != report.num_chunks:
            raise WireFormatError(
                f"session {self.session_id}: writer {report.writer} said {known} chunks, now {report.num_chunks}"
            )
        if report.staged and report.writer not in self.staging_writers:
            raise WireFormatError(f"session {self.session_id}: writer {report.writer} staged without an area")
        if (
            report.status is ChunkStatus.OK
            and self._staged.get(report.writer, report.staged) != report.staged
        ):
            raise WireFormatError(
                f"session {self.session_id}: writer {report.writer} mixes staged and direct"
            )
        self._num_chunks[report.writer] = report.num_chunks
        if report.status is ChunkStatus.OK:
            self._staged[report.writer] = report.staged
        key = (report.writer, report.chunk)
        earlier = self._reports.get(key)
        if earlier is None or earlier.status is ChunkStatus.OK:
            self._reports[key] = report  # a later failure of the same chunk wins over its success
        if report.status is not ChunkStatus.OK and not self.detail:
            self.detail = (
                f"writer {report.writer} chunk {report.chunk}: {report.status.value} {report.detail}"
            )
        if self.all_reported:
            self._settle()

    @property
    def all_reported(self) -> bool:
        return len(self._num_chunks) == len(self.writers) and len(self._reports) == sum(
            self._num_chunks.values()
        )

    @property
    def outstanding(self) -> int:
        """Writers that have not reported every chunk yet."""
        done = {w for w, n in self._num_chunks.items() if all((w, c) in self._reports for c in range(n))}
        return len(self.writers) - len(done)

    def staged_landed(self) -> list[ChunkResult]:
        """The OK reports of chunks that landed in a staging area (each may be scattered as soon as it landed)."""
        return [r for r in self._reports.values() if r.staged and r.status is ChunkStatus.OK and r.nbytes]

    def _settle(self) -> None:
        if self.state in (ReceiveState.CANCELLING, ReceiveState.IN_DOUBT):
            self._move(ReceiveState.CANCELLED)
        elif self.state is ReceiveState.REQUESTED:
            statuses = {r.status for r in self._reports.values()}
            if statuses == {ChunkStatus.OK}:
                self._move(ReceiveState.COMPLETE)
            elif ChunkStatus.FAILED in statuses:
                self._move(ReceiveState.FAILED)
            else:
                self._move(ReceiveState.CANCELLED)

    def cancel(self) -> CancelAction:
        """The receiver gives up on the transfer (its caller was cancelled)."""
        if self.state is ReceiveState.ALLOCATED:
            self._move(ReceiveState.CANCELLED)
            return CancelAction.FREE
        if self.state is ReceiveState.REQUESTED:
            self._move(ReceiveState.CANCELLING)
            return CancelAction.QUARANTINE
        if self.state is ReceiveState.COMPLETE or self.state is ReceiveState.FAILED:
            return CancelAction.FREE  # everyone reported: nothing can land any more
        return CancelAction.NOTHING

    def cancel_acknowledged(self) -> bool:
        """The sender answered our cancel: no write can land any more. CANCELLING -> CANCELLED (True: the pages
        may be released); any other state is left as it is (False)."""
        if self.state is ReceiveState.CANCELLING:
            self._move(ReceiveState.CANCELLED)
            return True
        return False

    def stalled(self) -> bool:
        """The stall deadline passed; True (-> IN_DOUBT, pages stay quarantined) if writers are still out."""
        if self.state is ReceiveState.REQUESTED and not self.all_reported:
            self._move(ReceiveState.IN_DOUBT)
            return True
        return False

    def peer_lost(self, reason: str) -> None:
        """The transport confirmed the sender is gone: nothing more can land (FAILED, or CANCELLED if we
        had already given up)."""
        if self.state in (ReceiveState.CANCELLING, ReceiveState.IN_DOUBT):
            self._move(ReceiveState.CANCELLED)
        elif self.state in (ReceiveState.ALLOCATED, ReceiveState.REQUESTED):
            self.detail = self.detail or reason
            self._move(ReceiveState.FAILED)

    @property
    def settled(self) -> bool:
        """Nothing can land in the pages any more."""
        return self.state.is_terminal

    def statistics(self, seconds: float = 0.0) -> TransferStatistics:
        ok = [r for r in self._reports.values() if r.status is ChunkStatus.OK]
        return TransferStatistics(
            self.session_id,
            sum(r.nbytes for r in ok),
            sum(r.fragments for r in ok),
            sum(1 for r in ok if r.nbytes),
            len(self.writers),
            seconds,
            sum(1 for staged in self._staged.values() if staged),
        )

    def __repr__(self) -> str:
        return (
            f"<ReceiveSession {self.session_id} {self.key!r} {self.state.name} "
            f"[{len(self._reports)} reports, {self.outstanding}/{len(self.writers)} writers out]>"
        )
