"""The context side's core of one transfer: which chunks each writer posts next, and how each one ended.

A :class:`SendSession` does no I/O and never blocks; :func:`~.sender.send` drives it over a transport. Each
chunk of each writer goes *unposted -> in flight -> reported* (posted, then its write ended OK or FAILED), or
*unposted -> reported* (CANCELLED: never posted because of a cancel). A writer with no chunks reports one
empty chunk. The session is finished when every chunk of every writer has a report and nothing is in flight:
only then may the source pages be freed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
from attrs import define

from kvferry.disagg.protocol import ChunkResult, ChunkStatus
from kvferry.disagg.session.chunks import Chunk

__all__ = ["SendSession"]


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
