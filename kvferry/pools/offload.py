"""Offload of suspended requests to the host, and their restore: at once, or in two phases around a copy that
runs elsewhere.

Offload saves every page, draft page, the live slot and its replay buffers of a SUSPENDED request into one
host buffer (:mod:`~kvferry.pools.host_memory`: pinned when the arena is on CUDA, reused) and frees them on the
device; restore copies them into whatever pages and slot the request gets next. The bytes move in few large
copies (:mod:`kvferry.kernels.host_copy`: runs of pages as slices, scattered pages by index in chunks).

Two phases (:class:`~kvferry.pools.moves.PendingMove`): :meth:`HostOffload.begin_offload` /
:meth:`~HostOffload.begin_restore` do the bookkeeping and mark the request *moving*; the move's ``run`` copies
(in a worker thread, or inline for the synchronous :meth:`~HostOffload.offload` / :meth:`~HostOffload.restore`);
:meth:`~HostOffload.complete` commits or rolls back. An offload frees the device memory only when it commits,
a restore drops the host copy only then: until then no page the copy reads or writes is handed out, even when
the request is closed meanwhile (the move frees it all when it completes).

Under pressure the manager offloads suspended requests, least recently suspended first, but never one marked
:attr:`~kvferry.pools.lifecycle.Offload.NEVER` (a transfer may read or write it), one not resumed yet (it holds
only shared prefix pages) or one moving. :meth:`HostOffload.plan` picks them before anything moves, so an
allocation that cannot be met even then changes nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import attrs
import numpy as np
import torch
from attrs import define

from kvferry.errors import PoolExhausted, UnknownRequest
from kvferry.kernels.host_copy import RowSection, from_host, to_host
from kvferry.kernels.span_copy.cuda import ordinal
from kvferry.pools.arena import CacheArena, HostPages, HostSlots
from kvferry.pools.config import ATTENTION, DRAFT
from kvferry.pools.host_memory import HostBuffer, HostMemory
from kvferry.pools.lifecycle import CacheState, Offload
from kvferry.pools.moves import CopyFn, MoveKind, PendingMove
from kvferry.pools.rank_pools import RankPools
from kvferry.pools.record import HostCopy, RequestRecord
from kvferry.pools.statistics import Counters

__all__ = ["HostOffload"]

#: Sections of a host buffer start at multiples of this (an int64 view of ``num_accepted`` needs 8).
_ALIGN = 64


@define(eq=False)
class _Piece:
    """Rows ``ids`` of ``rows`` at ``offset`` of a host buffer (``host``: their view of it, once made)."""

    rows: torch.Tensor
    ids: np.ndarray
    offset: int
    host: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return int(self.ids.size) * int(self.rows.shape[1])


@define(eq=False)
class _HostLayout:
    """Where each part of one request lies in its host buffer: attention pools, draft pools, state pools,
    replay row, ``num_accepted``."""

    attention: list[_Piece] = attrs.field(factory=list)
    draft: list[_Piece] = attrs.field(factory=list)
    state: list[_Piece] = attrs.field(factory=list)
    replay: list[_Piece] = attrs.field(factory=list)
    nbytes: int = 0

    def add(self, part: list[_Piece], rows: torch.Tensor, ids: np.ndarray) -> None:
        piece = _Piece(rows, ids, self.nbytes)
        part.append(piece)
        self.nbytes = -(-(self.nbytes + piece.nbytes) // _ALIGN) * _ALIGN

    def sections(self, buffer: torch.Tensor) -> list[RowSection]:
        """What the offload copies, each piece's view of ``buffer`` made (and kept for :meth:`host_copy`)."""
        base = buffer.storage_offset()
        sections = []
        for piece in (*self.attention, *self.draft, *self.state, *self.replay):
            count, width = int(piece.ids.size), int(piece.rows.shape[1])
            piece.host = buffer.as_strided((count, width), (width, 1), base + piece.offset)
            sections.append(RowSection(piece.rows, piece.ids, piece.host))
        return sections

    def host_copy(self, buffer: HostBuffer, num_pages: int, num_draft_pages: int) -> HostCopy:
        """The host copy over the views :meth:`sections` made."""

        def views(part: list[_Piece]) -> tuple[torch.Tensor, ...]:
            out = tuple(p.host for p in part if p.host is not None)
            assert len(out) == len(part), "the offload's copy did not run"
            return out

        copy = HostCopy(None, None, None, num_pages, num_draft_pages, buffer)
        if self.attention:
            copy.pages = HostPages(ATTENTION, num_pages, views(self.attention))
        if self.draft:
            copy.draft_pages = HostPages(DRAFT, num_draft_pages, views(self.draft))
        if self.state:
            replay, accepted = views(self.replay)
            copy.slots = HostSlots(1, views(self.state), replay, accepted.view(torch.int64))
        return copy


def _ids(values: Sequence[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def _offload_layout(arena: CacheArena, record: RequestRecord) -> _HostLayout:
    layout = _HostLayout()
    if record.pages:
        ids = _ids(record.pages)
        for rows in arena.page_rows(ATTENTION):
            layout.add(layout.attention, rows, ids)
    if record.draft_pages:
        ids = _ids(record.draft_pages)
        for rows in arena.page_rows(DRAFT):
            layout.add(layout.draft, rows, ids)
    if record.slot is not None:
        ids = _ids([record.slot])
        for rows in arena.state_rows():
            layout.add(layout.state, rows, ids)
        layout.add(layout.replay, arena.replay_rows(), ids)
        layout.add(layout.replay, arena.num_accepted_rows(), ids)
    return layout


def _restore_sections(
    arena: CacheArena, host: HostCopy, pages: Sequence[int], draft_pages: Sequence[int], slot: int | None
) -> list[RowSection]:
    """What a restore copies: the host copy's parts into ``pages``, ``draft_pages`` and ``slot``. A slot whose
    replay state was dropped gets it reset here (on the current stream, before the copy)."""
    sections: list[RowSection] = []
    if host.pages is not None:
        ids = _ids(pages[: host.num_pages])
        sections += [
            RowSection(r, ids, b) for r, b in zip(arena.page_rows(ATTENTION), host.pages.blocks, strict=True)
        ]
    if host.draft_pages is not None:
        ids = _ids(draft_pages[: host.num_draft_pages])
        sections += [
            RowSection(r, ids, b)
            for r, b in zip(arena.page_rows(DRAFT), host.draft_pages.blocks, strict=True)
        ]
    saved = host.slots
    if saved is not None and slot is not None:
        ids = _ids([slot])
        sections += [RowSection(r, ids, b) for r, b in zip(arena.state_rows(), saved.blocks, strict=True)]
        if saved.replay is None or saved.num_accepted is None:
            arena.reset_replay([slot])
        else:
            sections.append(RowSection(arena.replay_rows(), ids, saved.replay))
            sections.append(
                RowSection(arena.num_accepted_rows(), ids, saved.num_accepted.view(torch.uint8).view(-1, 8))
            )
    return sections


def _restore_copy(sections: list[RowSection]) -> CopyFn | None:
    if not sections:
        return None
    return lambda stop: from_host(sections, stop=stop)


class HostOffload:
    """Moves requests' memory of one rank's pools to the host and back."""

    def __init__(self, pools: RankPools, counters: Counters) -> None:
        self._pools = pools
        self._counters = counters
        self._memory: HostMemory | None = None
        self._stream: object | None = None
        #: moves started and not finished (closed requests' included)
        self._moving: set[PendingMove] = set()

    @property
    def memory(self) -> HostMemory:
        """The host memory of this rank's offloaded requests (pinned when the arena is on CUDA)."""
        if self._memory is None:
            arena = self._pools.arena
            self._memory = HostMemory(pinned=arena is not None and arena.device.type == "cuda")
        return self._memory

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory held, by offloaded requests and for reuse."""
        return 0 if self._memory is None else self._memory.allocated_bytes

    @property
    def num_moving(self) -> int:
        return len(self._moving)

    def moves(self) -> list[PendingMove]:
        """The moves started and not finished."""
        return list(self._moving)

    def plan(
        self,
        records: Iterable[RequestRecord],
        pages: int,
        draft_pages: int,
        slots: int,
        *,
        exclude: RequestRecord | None = None,
    ) -> list[RequestRecord]:
        """The suspended records to offload so that ``pages``, ``draft_pages`` and ``slots`` fit (none when they
        fit already). Changes nothing.

        :raises ~kvferry.errors.PoolExhausted: if they do not fit even with every movable record offloaded.
        """
        if pages <= 0 and draft_pages <= 0 and slots <= 0:
            return []
        pools = self._pools
        free_pages = pools.pages.num_free_pages
        free_draft = pools.draft.num_free_pages if pools.draft is not None else 0
        free_slots = pools.slots.num_available if pools.slots is not None and slots > 0 else 0

        def fits(freed_pages: int, freed_draft: int, freed_slots: int) -> bool:
            return (
                pages <= free_pages + freed_pages
                and draft_pages <= free_draft + freed_draft
                and slots <= free_slots + freed_slots
            )

        if fits(0, 0, 0):
            return []
        victims: list[RequestRecord] = []
        if pools.config.offload_under_pressure:
            candidates = sorted(
                (
                    r
                    for r in records
                    if r is not exclude
                    and r.state is CacheState.SUSPENDED
                    and r.offload is not Offload.NEVER
                    and r.resumed
                    and r.host is None
                    and r.moving is None
                ),
                key=lambda r: r.suspend_seq,
            )
            # a page is freed only when every reference on it belongs to a victim
            held: Counter[int] = Counter()
            held_draft: Counter[int] = Counter()
            freed_slots = 0
            draft = pools.draft
            for victim in candidates:
                victims.append(victim)
                held.update(victim.pages)
                held_draft.update(victim.draft_pages)
                freed_slots += victim.slot is not None
                freed_pages = sum(1 for p, n in held.items() if n == pools.pages.ref_cnt(p))
                freed_draft = (
                    sum(1 for p, n in held_draft.items() if n == draft.ref_cnt(p)) if draft is not None else 0
                )
                if fits(freed_pages, freed_draft, freed_slots):
                    return victims
        raise PoolExhausted(
            f"need {pages} pages ({free_pages} free), {draft_pages} draft pages ({free_draft} free), "
            f"{slots} slots ({free_slots} available); {len(victims)} suspended requests could move to the host"
        )

    # --- two phases ----------------------------------------------------------------------------------------

    def _side_stream(self) -> object | None:
        arena = self._pools.arena
        if arena is None or arena.device.type != "cuda":
            return None
        stream = self._stream
        if stream is None or stream.device.index != ordinal(arena.device):  # type: ignore[attr-defined]
            # one per device (a rebalance may hand over an arena of another)
            stream = self._stream = torch.cuda.Stream(arena.device)  # type: ignore[no-untyped-call]
        return stream

    def _move(self, kind: MoveKind, record: RequestRecord, nbytes: int, copy: CopyFn | None) -> PendingMove:
        arena = self._pools.arena
        return PendingMove(
            kind,
            record,
            owner=self,
            nbytes=nbytes,
            copy=copy,
            device=None if arena is None else arena.device,
            stream=self._side_stream() if copy is not None else None,
        )

    def begin_offload(self, record: RequestRecord) -> PendingMove:
        """Start moving a suspended record (not moving) to the host: reserve its host buffer and mark it moving;
        nothing is freed yet. A record on the host already or never resumed gets a move with nothing to do
        (finishing it changes nothing). Deferred replay writes must be flushed."""
        if record.host is not None or not record.resumed:
            return self._move(MoveKind.OFFLOAD, record, 0, None)
        arena = self._pools.arena
        layout = _offload_layout(arena, record) if arena is not None else _HostLayout()
        buffer = self.memory.reserve(layout.nbytes) if layout.nbytes else None

        def copy(stop: Callable[[], bool]) -> bool:
            assert buffer is not None
            # in the copy's thread: allocating (and pinning) a new block takes a while
            return to_host(layout.sections(buffer.materialize()), stop=stop)

        pending = self._move(MoveKind.OFFLOAD, record, layout.nbytes, copy if buffer is not None else None)
        pending.pages, pending.draft_pages, pending.slot = (
            list(record.pages),
            list(record.draft_pages),
            record.slot,
        )
        pending.buffer = buffer
        pending.layout = layout
        return self._register(record, pending)

    def begin_restore(
        self, record: RequestRecord, pages: list[int], draft_pages: list[int], slot: int | None, *, pin: bool
    ) -> PendingMove:
        """Start bringing a record on the host (not moving) back into ``pages``, ``draft_pages`` and ``slot``
        (allocated by the caller, given to the record only when the move commits)."""
        host = record.host
        assert host is not None
        arena = self._pools.arena
        sections = _restore_sections(arena, host, pages, draft_pages, slot) if arena is not None else []
        nbytes = sum(s.nbytes for s in sections)

        pending = self._move(MoveKind.RESTORE, record, nbytes, _restore_copy(sections))
        pending.pages, pending.draft_pages, pending.slot = pages, draft_pages, slot
        pending.host, pending.pin = host, pin
        return self._register(record, pending)

    def _register(self, record: RequestRecord, pending: PendingMove) -> PendingMove:
        record.moving = pending
        self._moving.add(pending)
        return pending

    def complete(self, pending: PendingMove, *, commit: bool = True) -> bool:
        """Wait for the move's copy (running it here if nobody did), then commit it when every byte was copied
        and ``commit``, else roll it back. Returns whether it committed. Idempotent (False once finished).

        A request closed while moving gets everything the move held freed now (or left to its quarantine).

        :raises ~kvferry.errors.UnknownRequest: if the move is another manager's.
        :raises BaseException: the copy's error, when it failed (after the roll-back) and ``commit``.
        """
        if pending.owner is not self:
            raise UnknownRequest(f"{pending!r} was not started by this manager")
        if pending not in self._moving:
            return False
        pending.run()
        self._moving.discard(pending)
        record = pending.record
        if record.moving is pending:
            record.moving = None
        ok = commit and pending.copied and not pending.closed
        if pending.closed:
            self._drop_closed(pending)
        elif pending.kind is MoveKind.OFFLOAD:
            if ok:
                self._commit_offload(record, pending)
            elif pending.buffer is not None:
                self.memory.release(pending.buffer)
        elif ok:
            self._commit_restore(record, pending)
        else:
            self._pools.free(pending.pages, pending.draft_pages, pending.slot)
        pending.end()
        if pending.error is not None and commit and not pending.closed:
            raise pending.error
        return ok

    def _commit_offload(self, record: RequestRecord, pending: PendingMove) -> None:
        layout = pending.layout
        assert isinstance(layout, _HostLayout)
        if pending.buffer is not None:
            host = layout.host_copy(pending.buffer, len(pending.pages), len(pending.draft_pages))
        else:
            host = HostCopy(None, None, None, len(pending.pages), len(pending.draft_pages))
        self._pools.free(pending.pages, pending.draft_pages, pending.slot)
        record.pages, record.draft_pages, record.slot = [], [], None
        record.host = host
        self._counters.offloads += 1

    def _commit_restore(self, record: RequestRecord, pending: PendingMove) -> None:
        pending.order_after_copy()
        record.pages, record.draft_pages, record.slot = pending.pages, pending.draft_pages, pending.slot
        self._drop_host(record)
        if pending.pin:
            record.offload = Offload.NEVER
        self._counters.restores += 1

    def _drop_closed(self, pending: PendingMove) -> None:
        if pending.quarantine is None or pending.quarantine_released:
            self._pools.free(pending.pages, pending.draft_pages, pending.slot)
        if pending.kind is MoveKind.OFFLOAD:
            buffer = pending.buffer
        else:
            buffer = pending.host.buffer if pending.host is not None else None
        if buffer is not None:
            self.memory.release(buffer)

    def close(self, record: RequestRecord) -> bool:
        """The record is being closed: False when a move holds its device memory (and frees it, with the host
        buffer, when it completes), True when the caller frees the device memory; its host copy is dropped."""
        pending = record.moving
        if pending is None:
            self._drop_host(record)
            return True
        pending.closed = True
        return False

    def _drop_host(self, record: RequestRecord) -> None:
        host, record.host = record.host, None
        if host is not None and host.buffer is not None:
            self.memory.release(host.buffer)

    # --- at once -------------------------------------------------------------------------------------------

    def offload(self, record: RequestRecord) -> None:
        """Save the record's pages, draft pages, slot and replay state to the host and free them on the device,
        now. A no-op for a record on the host already or never resumed. Deferred replay writes must be
        flushed."""
        self.complete(self.begin_offload(record))

    def restore(self, record: RequestRecord) -> None:
        """Copy the host copy into the pages and slot the record holds now, now, and drop it. The blocks are not
        offered for reuse here (the prefix index and the draft mirror re-offer them)."""
        host = record.host
        assert host is not None
        arena = self._pools.arena
        if arena is not None:
            sections = _restore_sections(arena, host, record.pages, record.draft_pages, record.slot)
            pending = self._move(
                MoveKind.RESTORE, record, sum(s.nbytes for s in sections), _restore_copy(sections)
            )
            pending.run()
            if pending.error is not None:
                raise pending.error
            pending.order_after_copy()
            pending.end()
        self._drop_host(record)
        self._counters.restores += 1

    def __repr__(self) -> str:
        c = self._counters
        return f"<HostOffload {c.offloads} offloads, {c.restores} restores, {len(self._moving)} moving>"
