"""Transfer sessions: a synchronous core that decides, and an async edge that performs the I/O.

One transfer moves one request's cache from the context engine's ranks (the *writers*) into pages and a slot
the generation engine allocated. Its life, per DESIGN.md "Disaggregation protocol":

- the receiver (:class:`ReceiveSession`) grants the context peer the bytes the transfer writes (its transport
  refuses the peer's writes anywhere else) and sends a :class:`~.protocol.ReceiveRequest`;
- each writer (:class:`SendSession`, one per request on the context side, with a chunk list per writer)
  pushes its chunks with ``transport.write(..., notify=<its ChunkResult>)``; the transport delivers the notify
  only after the data landed. A failed write is reported as FAILED on the control channel, a chunk never
  posted because of a cancel as CANCELLED, and a writer with nothing to write reports one empty chunk: every
  writer reports every chunk;
- the receiver completes only when every expected writer reported all of its chunks. Never on a timeout.

Bounce: a writer given a staging area in the receive request may pack its fragments into its own staging
(:class:`~.staging.StagedWrite`, before its first chunk is posted) and write them as a few large fragments into
that area; its reports say ``staged``. The receiver scatters a writer's area into the pages once every chunk
of that writer landed OK, and completes only after every scatter. Staging areas follow the pages: released
when nothing can land any more, quarantined with them otherwise.

Cancellation is two-phase. A cancel stops posting; a receiver that cancels while writers are still to report
keeps its pages *quarantined* (out of the pools, never reallocated) and sends
:class:`~.protocol.CancelTransfer`. The pages come back when the first of these happens, each of which means no
write of the session can land any more:

- every writer has reported every chunk (the sender was pushing: it posts nothing more, and reports the rest
  CANCELLED);
- the sender answers :class:`~.protocol.CancelAck`: it was not pushing the session and never will (the receive
  request never reached it, or reached it before the push started, which the cancel then called off), or it
  had finished it (every write returned, hence landed, before the reports were sent);
- the transport says the peer is gone (its process died: nothing more can land).

So a cancel whose request never reached the sender costs its pages one round trip, not the connection's
life; only a CancelTransfer or an acknowledgement lost on a live connection keeps them out until it drops.
A stall deadline turns a silent peer into :class:`~kvferry.errors.TransferInDoubt` with the pages still
quarantined (no CancelTransfer is sent then, so only the reports or the peer's loss release them).

The cores (:class:`SendSession`, :class:`ReceiveSession`) do no I/O and never block; :class:`Receiver` and
:func:`send` drive them over a :class:`~kvferry.transports.Transport`.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, Protocol

import anyio
import anyio.lowlevel
import attrs
import numpy as np
from attrs import define, frozen

from kvferry.disagg.protocol import (
    CancelAck,
    CancelTransfer,
    ChunkResult,
    ChunkResults,
    ChunkStatus,
    ReceiveRequest,
    encode_control,
)
from kvferry.disagg.staging import ReceiveStaging, StagedWrite
from kvferry.errors import (
    ClosedResourceError,
    ConfigError,
    InvalidTransition,
    KvferryError,
    MessageTooLarge,
    PeerDisconnected,
    TransferCancelled,
    TransferError,
    TransferInDoubt,
    TransportError,
    WireFormatError,
)
from kvferry.transports import Fragments, Grant, Peer, Transport, coalesce, total_bytes
from kvferry.transports.indexed import IndexedWrite

__all__ = [
    "Chunk",
    "PageHold",
    "ReceiveSession",
    "ReceiveState",
    "Receiver",
    "SendSession",
    "TransferStatistics",
    "send",
    "split_chunks",
]

log = logging.getLogger("kvferry.disagg")


# --- chunks ---------------------------------------------------------------------------------------------


@frozen(eq=False)
class Chunk:
    """One write of one writer: ``src`` fragments (the writer's memory) into ``dst`` (rank ``dst_rank``'s).

    ``staged``: the writer's packing this chunk reads (``src`` lies in its lease); the chunk's bytes are packed
    right before it is posted. All chunks of a packed writer share one. ``area_offset``: ``dst`` lies in the
    receiver's staging area of this writer, from this offset on (the receiver scatters it); None: ``dst`` are
    the receiver's pages. A bounce has both, a writer whose fragments are small on one side only one of them.

    ``indexed``: the chunk is one indexed write (a direct writer's whole transfer as a template and the
    request's ids; ``src``/``dst`` are empty then), posted by ``transport.write_indexed``.
    """

    dst_rank: int
    src: Fragments
    dst: Fragments
    staged: StagedWrite | None = None
    area_offset: int | None = None
    indexed: IndexedWrite | None = None

    @classmethod
    def of_indexed(cls, dst_rank: int, write: IndexedWrite) -> Chunk:
        return cls(dst_rank, _NO_ROWS, _NO_ROWS, indexed=write)

    @property
    def nbytes(self) -> int:
        return total_bytes(self.src) if self.indexed is None else self.indexed.nbytes

    def fragments(self) -> tuple[Fragments, Fragments]:
        """The chunk's rows as plain ``(src, dst)`` fragments (an indexed chunk's expanded from its ids)."""
        return (self.src, self.dst) if self.indexed is None else self.indexed.expand()

    @property
    def num_fragments(self) -> int:
        """Rows the write posts (an indexed write's template rows)."""
        return len(self.src) if self.indexed is None else len(self.indexed.rows)

    def __repr__(self) -> str:
        kind = " packed" if self.staged is not None else ""
        kind += f" into the area at +{self.area_offset}" if self.area_offset is not None else ""
        kind += " indexed" if self.indexed is not None else ""
        return f"<Chunk -> rank {self.dst_rank}{kind}: {self.num_fragments} fragments, {self.nbytes} bytes>"


_NO_ROWS: Fragments = np.zeros((0, 2), dtype=np.uint64)
_NO_ROWS.flags.writeable = False


def split_chunks(dst_rank: int, src: Fragments, dst: Fragments, *, max_bytes: int) -> list[Chunk]:
    """Coalesce ``src -> dst`` and cut it into chunks of at most ``max_bytes`` (a longer fragment is one chunk).

    Chunks are the unit of posting, of reporting and of cancellation.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    src, dst = coalesce(src, dst)
    if not len(src):
        return []
    ends = np.cumsum(src[:, 1].astype(np.int64))
    chunk_of = (ends - 1) // max_bytes
    # a new chunk starts where the running total crosses a max_bytes boundary
    starts = np.flatnonzero(np.concatenate(([True], chunk_of[1:] != chunk_of[:-1])))
    bounds = [*starts.tolist(), len(src)]
    return [
        Chunk(dst_rank, np.ascontiguousarray(src[a:b]), np.ascontiguousarray(dst[a:b]))
        for a, b in itertools.pairwise(bounds)
    ]


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


# --- the sender's core ------------------------------------------------------------------------------------


@define(eq=False)
class SendSession:
    """The context side of one transfer: which chunks each writer posts, and what it reported.

    ``plan[writer]`` lists that writer's chunks (may be empty: it then reports one empty chunk). Not
    thread-safe; one task per writer calls :meth:`next_post` / :meth:`finish_post` in turn.
    """

    session_id: int
    plan: Mapping[int, Sequence[Chunk]]
    cancelled: bool = False
    _next: dict[int, int] = attrs.field(factory=dict, init=False)
    _in_flight: set[tuple[int, int]] = attrs.field(factory=set, init=False)
    _reports: dict[tuple[int, int], ChunkResult] = attrs.field(factory=dict, init=False)

    def num_chunks(self, writer: int) -> int:
        return max(1, len(self.plan[writer]))

    @property
    def writers(self) -> tuple[int, ...]:
        return tuple(sorted(self.plan))

    def result(self, writer: int, chunk: int, status: ChunkStatus, detail: str = "") -> ChunkResult:
        """The report of ``chunk`` with ``status`` (its byte and fragment counts filled in)."""
        chunks = self.plan[writer]
        nbytes = fragments = 0
        if status is ChunkStatus.OK and chunks:
            nbytes, fragments = chunks[chunk].nbytes, chunks[chunk].num_fragments
        offset = chunks[min(chunk, len(chunks) - 1)].area_offset if chunks else None
        return ChunkResult(
            self.session_id,
            writer,
            chunk,
            self.num_chunks(writer),
            status,
            nbytes,
            fragments,
            detail[:4000],
            offset is not None,
            offset or 0,
        )

    def next_post(self, writer: int) -> tuple[int, Chunk | None] | None:
        """The next chunk ``writer`` should post (``None`` chunk: the one empty report), or None when it is
        done or cancelled. Marks it in flight until :meth:`finish_post`."""
        index = self._next.get(writer, 0)
        if self.cancelled or index >= self.num_chunks(writer):
            return None
        self._next[writer] = index + 1
        self._in_flight.add((writer, index))
        chunks = self.plan[writer]
        return index, (chunks[index] if chunks else None)

    def unposted_count(self, writer: int) -> int:
        """How many of ``writer``'s chunks have been neither posted nor reported unposted."""
        return self.num_chunks(writer) - self._next.get(writer, 0)

    def finish_post(self, writer: int, chunk: int, report: ChunkResult) -> None:
        """Record how a posted chunk ended (the report was, or is about to be, sent)."""
        self._in_flight.discard((writer, chunk))
        self._reports[writer, chunk] = report

    def cancel(self) -> None:
        """Post nothing more. Chunks in flight end as they end; the rest are reported CANCELLED."""
        self.cancelled = True

    def release_staging(self) -> None:
        """Give back the writers' own staging leases (idempotent). Call it when no posted write reads them."""
        for chunks in self.plan.values():
            for chunk in chunks:
                if chunk.staged is not None:
                    chunk.staged.release()

    def unposted(self, writer: int) -> list[ChunkResult]:
        """CANCELLED reports of ``writer``'s chunks that were never posted (recorded as reported)."""
        out = []
        for index in range(self._next.get(writer, 0), self.num_chunks(writer)):
            report = self.result(writer, index, ChunkStatus.CANCELLED, "cancelled before posting")
            self._reports[writer, index] = report
            out.append(report)
        self._next[writer] = self.num_chunks(writer)
        return out

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def report(self, writer: int, chunk: int) -> ChunkResult | None:
        """How ``writer``'s ``chunk`` ended (None: not posted or not ended yet)."""
        return self._reports.get((writer, chunk))

    @property
    def finished(self) -> bool:
        """Every chunk of every writer has a report and nothing is in flight (the source may be freed)."""
        return not self._in_flight and all(
            (w, c) in self._reports for w in self.plan for c in range(self.num_chunks(w))
        )

    @property
    def ok(self) -> bool:
        return self.finished and all(r.status is ChunkStatus.OK for r in self._reports.values())

    def statistics(self) -> dict[str, int]:
        reports = self._reports.values()
        return {
            "chunks": sum(self.num_chunks(w) for w in self.plan),
            "reported": len(self._reports),
            "in_flight": len(self._in_flight),
            "bytes": sum(r.nbytes for r in reports if r.status is ChunkStatus.OK),
            "fragments": sum(r.fragments for r in reports if r.status is ChunkStatus.OK),
        }

    def __repr__(self) -> str:
        s = self.statistics()
        state = "cancelled" if self.cancelled else ("finished" if self.finished else "sending")
        return (
            f"<SendSession {self.session_id} {state} [{s['reported']}/{s['chunks']} reported, "
            f"{s['in_flight']} in flight, {s['bytes']} bytes]>"
        )


# --- the receiver's core ----------------------------------------------------------------------------------


class ReceiveState(enum.Enum):
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
    #: nothing was asked or everything has reported: free the pages now
    FREE = "free"
    #: writers may still write: quarantine the pages and tell the sender to stop
    QUARANTINE = "quarantine"
    #: already ended (or already cancelling): nothing to do
    NOTHING = "nothing"


_TRANSITIONS: dict[ReceiveState, frozenset[ReceiveState]] = {
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
    each report). The session completes only when all have reported; see the module docstring.
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
        if dst not in _TRANSITIONS[self.state]:
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


# --- the receiver's async edge ------------------------------------------------------------------------------


class PageHold(Protocol):
    """What the receiver holds for one transfer (a manager request's pages, draft pages and slot)."""

    def free(self) -> None:
        """Return everything to the pools now (nothing can land any more)."""
        ...

    def quarantine(self) -> Callable[[], None]:
        """Take everything out of the pools (never reallocated); the returned callable returns it."""
        ...


@define(eq=False)
class _Live:
    session: ReceiveSession
    hold: PageHold
    staging: ReceiveStaging | None = None
    changed: anyio.Event = attrs.field(factory=anyio.Event)
    release: Callable[[], None] | None = None
    #: what the context peer may write for this session (revoked when the pages go back)
    grant: Grant | None = None


@define(eq=False)
class Receiver:
    """The generation side's transfers from one context peer.

    Feed it the peer's reports (:meth:`on_result`, from the link's reader tasks) and the peer's loss
    (:meth:`peer_lost`) and its answers to our cancels (:meth:`on_cancel_ack`); call :meth:`receive` once per
    request. Quarantined pages of cancelled or in-doubt transfers are released here when their writers report,
    the peer acknowledges a cancel, or the peer is gone, so they outlive :meth:`receive`.

    ``destinations``: the byte ranges the writers of a receive request may write
    (:func:`~.transfer.destinations`); each session grants them to the peer before its request is sent and
    revokes them when the session is over (see :meth:`receive`). None: nothing is granted here (the caller
    grants, or its transport needs none); the peer's writes are then refused unless granted otherwise.
    """

    transport: Transport
    peer: Peer
    writers: tuple[int, ...]
    stall_timeout: float = 30.0
    #: seconds the CancelTransfer of a cancelled transfer may take (best effort)
    control_timeout: float = 1.0
    destinations: Callable[[ReceiveRequest], Fragments] | None = None
    _sessions: dict[int, _Live] = attrs.field(factory=dict, init=False)
    _next_id: int = attrs.field(default=1, init=False)
    _lost: str | None = attrs.field(default=None, init=False)
    _counts: dict[str, int] = attrs.field(
        factory=lambda: dict.fromkeys(("complete", "failed", "cancelled", "in_doubt", "bytes"), 0), init=False
    )

    def new_session(self, key: str, hold: PageHold, staging: ReceiveStaging | None = None) -> ReceiveSession:
        """A session for ``key``, holding ``hold`` (freed or quarantined as the transfer ends) and ``staging``
        (the areas offered to bouncing writers: released when the pages are, kept while they are quarantined).
        The receive request must carry ``staging.areas()``."""
        offered = staging.writers if staging is not None else frozenset()
        session = ReceiveSession(self._next_id, key, self.writers, offered)
        self._next_id += 1
        self._sessions[session.session_id] = _Live(session, hold, staging)
        return session

    async def receive(self, session: ReceiveSession, request: ReceiveRequest) -> TransferStatistics:
        """Grant the peer the request's destinations, send ``request`` and wait until every writer has reported
        every chunk.

        On success the pages hold the request's cache and stay with the caller. Otherwise the hold is freed
        (everyone reported, or the peer is gone) or quarantined (writers still out) before this raises.

        The grant (:attr:`destinations`) is made before the request is sent, and travels with it in one send
        (the control channel is ordered: the peer knows it before it reads the request), and lasts exactly as
        long as writes may land: it is revoked on success before this returns, and otherwise when the pages go
        back to the pools (freed, or released from quarantine), never later. Our own checks refuse at once (a
        two-sided receiver's too); the revoke goes out without delaying the result, ahead of anything we send
        the peer afterwards (a receive request that reuses the pages comes after it), and the peer's check
        follows when it arrives: no writer of the session writes by then (it has reported, acknowledged a
        cancel, or is gone). A grant the transport refuses fails the transfer before the request is sent.

        A cancel before the request is sent frees the pages at once. A later one sends
        :class:`~.protocol.CancelTransfer` (best effort) and leaves the pages quarantined until no write can
        land any more: every writer reported (the sender was pushing), the sender answered
        :class:`~.protocol.CancelAck` (it never got the request, called the push off before it started, or had
        finished it), or the peer is gone. Only a lost CancelTransfer or acknowledgement on a connection that
        stays up keeps them quarantined for the connection's life.

        :raises ~kvferry.errors.TransferError: a chunk failed, or the peer went away.
        :raises ~kvferry.errors.TransferCancelled: the sender cancelled.
        :raises ~kvferry.errors.TransferInDoubt: no report within ``stall_timeout`` seconds while writers are
            still out; the pages stay quarantined.
        """
        live = self._sessions[session.session_id]
        started = time.perf_counter()
        scattered: dict[tuple[int, int], str] = {}
        try:
            if self._lost is not None:
                session.peer_lost(self._lost)
            else:
                # a cancel that comes before anything is sent frees the pages (ALLOCATED); no turn of the loop
                await anyio.lowlevel.checkpoint_if_cancelled()
                # REQUESTED before the send: every writer may report before send_message returns (a fast
                # context side), and a report must find the session waiting for it. A failed send then takes
                # the cancel path below (quarantine until the writers report or the peer is gone: the request
                # may have left before the failure).
                session.requested()
                refused = await self._grant(live, request)
                if refused is not None:
                    session.not_sent(refused)
                else:
                    try:
                        await self.transport.send_message(self.peer, encode_control(request))
                    except MessageTooLarge as exc:
                        session.not_sent(f"receive request refused by the transport: {exc}")
            while True:
                # unpack each staged chunk as soon as it landed (overlaps the chunks still being written)
                await self._scatter(live, scattered)
                if session.settled:
                    # reports that arrived during the scatter above may have completed other writers
                    await self._scatter(live, scattered)
                    break
                live.changed = anyio.Event()
                with anyio.move_on_after(self.stall_timeout):
                    await live.changed.wait()
                if not live.changed.is_set() and not session.settled:
                    session.stalled()
                    self._counts["in_doubt"] += 1
                    self._quarantine(live, notify=False)
                    raise TransferInDoubt(
                        f"transfer {session.session_id} ({session.key}): no report for {self.stall_timeout}s "
                        f"with {session.outstanding} writers out; its pages stay quarantined"
                    )
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._abandon(live)
            raise
        seconds = time.perf_counter() - started
        failures = [detail for detail in scattered.values() if detail]
        if session.state is ReceiveState.COMPLETE and failures:
            self._finish(live)  # everyone reported: nothing can land, free the pages and the staging
            self._counts["failed"] += 1
            raise TransferError(f"transfer {session.session_id} ({session.key}) failed: {failures[0]}")
        if session.state is ReceiveState.COMPLETE:
            self._sessions.pop(session.session_id, None)
            if live.grant is not None:  # every writer reported: nothing more may land
                grant, live.grant = live.grant, None
                grant.revoke_nowait()  # our side refuses now; the peer's before anything we send it next
            if live.staging is not None:
                live.staging.release()
            self._counts["complete"] += 1
            stats = session.statistics(seconds)
            self._counts["bytes"] += stats.nbytes
            return stats
        self._finish(live)
        if session.state is ReceiveState.CANCELLED:
            raise TransferCancelled(
                f"transfer {session.session_id} ({session.key}) cancelled: {session.detail}"
            )
        raise TransferError(f"transfer {session.session_id} ({session.key}) failed: {session.detail}")

    async def _scatter(self, live: _Live, scattered: dict[tuple[int, int], str]) -> None:
        """Scatter every staged chunk that landed OK (once each, its byte range of its writer's area; in a worker
        thread: a kernel plus a device wait). A failure is recorded in ``scattered`` (the transfer fails once
        every writer reported; until then the pages stay as they are)."""
        if live.staging is None or live.session.state not in (ReceiveState.REQUESTED, ReceiveState.COMPLETE):
            return
        for report in live.session.staged_landed():
            key = (report.writer, report.chunk)
            if key in scattered:
                continue
            scattered[key] = ""
            end = report.offset + report.nbytes
            try:
                await anyio.to_thread.run_sync(live.staging.scatter, report.writer, report.offset, end)
            except ConfigError as exc:
                scattered[key] = f"scatter of writer {report.writer}'s staging failed: {exc}"

    async def _abandon(self, live: _Live) -> None:
        session = live.session
        if live.release is not None or session.session_id not in self._sessions:
            return  # already quarantined (in doubt) or already finished
        action = session.cancel()
        if action is CancelAction.QUARANTINE:
            self._quarantine(live, notify=True)
            with anyio.move_on_after(self.control_timeout), _suppress_transport():
                await self.transport.send_message(
                    self.peer, encode_control(CancelTransfer(session.session_id, "receiver cancelled"))
                )
        else:
            self._finish(live)

    def _quarantine(self, live: _Live, *, notify: bool) -> None:
        if live.release is None:
            live.release = live.hold.quarantine()

    async def _grant(self, live: _Live, request: ReceiveRequest) -> str | None:
        """Grant the peer ``request``'s destinations (:attr:`destinations`); why it could not, or None.

        :raises ~kvferry.errors.PeerDisconnected: the peer is gone (nothing was granted).
        """
        if self.destinations is None:
            return None
        try:
            # deferred: it goes out with the request, in one send
            live.grant = await self.transport.grant(self.peer, self.destinations(request), defer=True)
        except (PeerDisconnected, ClosedResourceError):
            raise
        except (TransportError, KvferryError, ValueError) as exc:  # RegionError, too many grants, bad ids
            return f"granting the receive request's destinations failed: {type(exc).__name__}: {exc}"
        return None

    def _finish(self, live: _Live) -> None:
        """The session is over and nothing can land: revoke its grant, give its pages back and forget it."""
        if live.grant is not None:
            grant, live.grant = live.grant, None
            grant.revoke_nowait()  # before the pages go back: our side refuses at once
        self._sessions.pop(live.session.session_id, None)
        state = live.session.state
        if state is ReceiveState.FAILED:
            self._counts["failed"] += 1
        elif state is ReceiveState.CANCELLED:
            self._counts["cancelled"] += 1
        if live.release is not None:
            live.release()
        else:
            live.hold.free()
        if live.staging is not None:
            live.staging.release()

    def on_result(self, report: ChunkResult) -> None:
        """A writer's report (a notification or a control message) arrived."""
        live = self._sessions.get(report.session_id)
        if live is None:
            log.debug("report for unknown or finished session %s", report.session_id)
            return
        try:
            live.session.on_result(report)
        except WireFormatError as exc:
            log.warning("bad report from the context peer: %s", exc)
            live.session.peer_lost(f"bad report: {exc}")  # no longer trusted: fail the session
        live.changed.set()
        if live.session.settled and live.release is not None:
            self._finish(live)  # a cancelled / in-doubt session: its writers are done, release the pages

    def on_cancel_ack(self, ack: CancelAck) -> None:
        """The peer answered a :class:`~.protocol.CancelTransfer`: no write of ``ack.session_id`` can land any
        more. A session quarantined after a cancel is released now (pages and staging), as when its last writer
        reports; an unknown, finished or not cancelled session is left as it is (a stale or stray answer).
        Reports of the released session that arrive later are ignored (its id is never reused)."""
        live = self._sessions.get(ack.session_id)
        if live is None or not live.session.cancel_acknowledged():
            state = "unknown or finished" if live is None else live.session.state.name
            log.debug("cancel acknowledgement for %s session %s ignored", state, ack.session_id)
            return
        live.session.detail = live.session.detail or f"cancelled; the peer acknowledged: {ack.reason}"
        live.changed.set()
        self._finish(live)

    def peer_lost(self, reason: str) -> None:
        """The transport says the peer is gone: every session settles and quarantines are released."""
        self._lost = reason
        for live in list(self._sessions.values()):
            live.session.peer_lost(reason)
            live.changed.set()
            if live.release is not None:
                self._finish(live)

    @property
    def lost(self) -> bool:
        return self._lost is not None

    def statistics(self) -> dict[str, int]:
        quarantined = sum(1 for live in self._sessions.values() if live.release is not None)
        staging = sum(live.staging.nbytes for live in self._sessions.values() if live.staging is not None)
        return {
            **self._counts,
            "sessions": len(self._sessions),
            "quarantined": quarantined,
            "staging_bytes": staging,
        }

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<Receiver {len(self.writers)} writers [{s['sessions']} sessions, {s['quarantined']} quarantined"
            f"{', peer lost' if self._lost else ''} | {s['complete']} complete, {s['failed']} failed]>"
        )


def _notifying(write: IndexedWrite, ok: ChunkResult) -> IndexedWrite:
    """``write`` with its chunk's OK report as the notification."""
    return IndexedWrite(write.rows, write.src_ids, write.dst_ids, encode_control(ok))


class _suppress_transport:
    """Swallow transport errors of a best-effort message (the peer may be gone)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        return exc_type is not None and issubclass(exc_type, (TransportError, KvferryError))


# --- the sender's async edge --------------------------------------------------------------------------------


#: what a chunk's write or pack may fail with (the chunk is reported FAILED; the others go on)
_CHUNK_ERRORS = (
    PeerDisconnected,
    ClosedResourceError,
    TransportError,
    TransferError,
    ConfigError,
    ValueError,
)


async def send(
    transport: Transport,
    peer: Peer,
    session: SendSession,
    *,
    stall_timeout: float | None = None,
    max_in_flight: int = 4,
) -> None:
    """Push every writer's chunks of ``session`` (writers concurrently, each with up to ``max_in_flight``
    chunks posted at once, in order of posting). The writers that write directly (not packed) in one chunk
    (the default for direct writers) post it first, together, in one
    :meth:`~kvferry.transports.Transport.write_indexed` (indexed chunks) or
    :meth:`~kvferry.transports.Transport.write_many` (plain ones): one copy where the transport can; then the
    rest.

    Each chunk is one ``transport.write`` (``write_indexed`` for an indexed chunk) whose notify is the chunk's OK
    report; the indexed chunks posted together send no notification each: their OK reports go in one
    :class:`~.protocol.ChunkResults` message once the call returned (their bytes landed). A failed write is reported
    FAILED on the control channel; after a cancel (:meth:`SendSession.cancel`) the unposted chunks are
    reported CANCELLED. A packed chunk packs its own bytes into the writer's staging (in a worker thread, one
    chunk at a time over all writers) right before it is posted; a failed pack fails that chunk. Returns when
    every posted write has ended and every report was sent (or the peer is gone): then the source pages may be
    freed, and the writers' staging leases have been released.
    Never raises for a failed chunk (it is reported instead).

    :raises ~kvferry.errors.PeerDisconnected: the peer went away (nothing more can be reported).
    """
    lost: list[BaseException] = []
    # one chunk packed at a time, in posting order: packing the next chunk overlaps writing this one (several
    # packs at once would only fight over the cores and memory the writes need)
    packing = anyio.CapacityLimiter(1)

    async def report(result: ChunkResult) -> None:
        if lost:
            return
        try:
            await transport.send_message(peer, encode_control(result))
        except (PeerDisconnected, ClosedResourceError) as exc:
            lost.append(exc)

    async def report_all(results: list[ChunkResult]) -> None:
        if len(results) == 1:
            await report(results[0])
        elif results and not lost:
            try:
                await transport.send_message(peer, encode_control(ChunkResults(tuple(results))))
            except (PeerDisconnected, ClosedResourceError) as exc:
                lost.append(exc)

    async def ended(w: int, index: int, ok: ChunkResult, error: Exception | None) -> None:
        # how a posted chunk ended: OK (its report travelled as the write's notification), FAILED and reported,
        # or FAILED with the peer gone (nothing more can be reported); anything else is not a chunk's failure
        if error is None:
            session.finish_post(w, index, ok)
        elif isinstance(error, PeerDisconnected | ClosedResourceError):
            session.finish_post(w, index, session.result(w, index, ChunkStatus.FAILED, str(error)))
            lost.append(error)
        elif isinstance(error, _CHUNK_ERRORS):
            failed = session.result(w, index, ChunkStatus.FAILED, f"{type(error).__name__}: {error}")
            session.finish_post(w, index, failed)
            await report(failed)
        else:
            raise error

    async def writer(w: int) -> None:
        while not lost and (item := session.next_post(w)) is not None:
            index, chunk = item
            ok = session.result(w, index, ChunkStatus.OK)
            if chunk is None:
                session.finish_post(w, index, ok)
                await report(ok)
                continue
            try:
                if chunk.indexed is not None:
                    (outcome,) = await transport.write_indexed(
                        peer, [_notifying(chunk.indexed, ok)], stall_timeout=stall_timeout
                    )
                    await ended(w, index, ok, outcome)
                    continue
                if chunk.staged is not None:  # pack this chunk's bytes (overlaps the writes in flight)
                    await anyio.to_thread.run_sync(chunk.staged.pack_chunk, chunk.src, limiter=packing)
                await transport.write(
                    peer, chunk.src, chunk.dst, encode_control(ok), stall_timeout=stall_timeout
                )
            except _CHUNK_ERRORS as exc:
                await ended(w, index, ok, exc)
            else:
                await ended(w, index, ok, None)
        if lost:
            session.unposted(w)
            return
        for cancelled in session.unposted(w):
            await report(cancelled)

    async def only_chunks_together() -> None:
        # the only chunk of every writer that writes its pages directly in one chunk (a direct writer's, by
        # default), posted in one call: the transport may move them as one copy (one launch, one wait)
        batch = [
            w for w in session.writers if len(session.plan[w]) == 1 and session.plan[w][0].staged is None
        ]
        if len(batch) < 2 or session.cancelled:
            return
        for w in batch:
            session.next_post(w)  # chunk 0
        oks = [session.result(w, 0, ChunkStatus.OK) for w in batch]
        chunks = [session.plan[w][0] for w in batch]
        # indexed writes (the default of direct writers) in one call, plain ones in another
        indexed = [(i, c.indexed) for i, c in enumerate(chunks) if c.indexed is not None]
        plain = [i for i, c in enumerate(chunks) if c.indexed is None]
        outcomes: list[Exception | None] = [None] * len(batch)
        if indexed:
            # no notification each: the OK reports of the writes that landed go in one message once the call
            # returned (it returns when their bytes have landed)
            done = await transport.write_indexed(
                peer, [write for _, write in indexed], stall_timeout=stall_timeout
            )
            for (i, _), outcome in zip(indexed, done, strict=True):
                outcomes[i] = outcome
            await report_all(
                [oks[i] for (i, _), outcome in zip(indexed, done, strict=True) if outcome is None]
            )
        if plain:
            done = await transport.write_many(
                peer,
                [(chunks[i].src, chunks[i].dst, encode_control(oks[i])) for i in plain],
                stall_timeout=stall_timeout,
            )
            for i, outcome in zip(plain, done, strict=True):
                outcomes[i] = outcome
        for w, ok, outcome in zip(batch, oks, outcomes, strict=True):
            await ended(w, 0, ok, outcome)

    try:
        await only_chunks_together()
        # as many posting tasks per writer as it has chunks left, up to max_in_flight (each posts, or after a
        # cancel reports unposted, that writer's chunks in order); writers done together above need none
        tasks = [
            w for w in session.writers for _ in range(min(max(1, max_in_flight), session.unposted_count(w)))
        ]
        if len(tasks) == 1:  # one writer with one chunk left, say: no task group to set up
            await writer(tasks[0])
        elif tasks:
            async with anyio.create_task_group() as tg:
                for w in tasks:
                    tg.start_soon(writer, w)
    finally:
        # every posted write has ended (a write returns only then, cancel included): nothing reads the leases
        session.release_staging()
    if lost:
        raise PeerDisconnected(f"transfer {session.session_id}: {lost[0]}")
