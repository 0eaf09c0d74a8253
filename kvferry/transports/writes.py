"""The write pipeline of a channel transport: check every row, then copy here or hand over to the data path.

Every write goes the same way, whatever moves its bytes::

    write / write_many / write_indexed
      └─ checked: each source row in our registered memory, each destination row in the peer's and inside
         what the peer granted us (else RegionError / NotGranted, nothing written)
           ├─ a peer of this process: copied here (CopyPlan; indexed writes by one device launch)
           └─ any other: the transport's DataPath (NIXL, UCX), with the checked rows
      └─ the notification, once every byte of its write landed

Rows are merged where they are contiguous on both sides (``coalesce``) before they are checked. Several writes
to one peer move as one copy where this transport copies them itself, or where the data path can
(:meth:`~kvferry.transports.datapath.DataPath.write_together`: nixl's CUDA IPC mapping); their notifications
then follow in order, in one send. Each write is bounded by a :class:`Guard`: the peer's loss ends it with the
peer's error, and no progress for its stall deadline with :class:`~kvferry.errors.TransferTimeout`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio
import numpy as np
import numpy.typing as npt
from attrs import define

from kvferry.errors import NotGranted, RegionError, TransferTimeout
from kvferry.transports._indexed_copy import DeviceDestinations
from kvferry.transports._memory import CopyPlan
from kvferry.transports.base import (
    Fragments,
    PeerState,
    Transport,
    WriteRows,
    as_fragments,
    joined_rows,
    outcomes_of,
    total_bytes,
    write_rows,
)
from kvferry.transports.messages import FrameKind

if TYPE_CHECKING:
    from kvferry.transports.channel import ChannelTransport
    from kvferry.transports.datapath import DataPath
    from kvferry.transports.indexed import IndexedWrite
    from kvferry.transports.peers import ChannelPeer

__all__ = ["CheckedRows", "Guard", "WritePipeline"]

log = logging.getLogger("kvferry.transports")


class CheckedRows(NamedTuple):
    """A write's rows once checked: every row lies in registered memory (``src_index``: the range of ours
    holding each source row; ``dst_index``: the range of the peer's :attr:`ChannelPeer.regions` holding each
    destination row)."""

    src: Fragments
    dst: Fragments
    src_index: npt.NDArray[np.int64]
    dst_index: npt.NDArray[np.int64]

    @classmethod
    def joined(cls, parts: Sequence[CheckedRows]) -> CheckedRows:
        """Several writes' checked rows as one write's, in order."""
        return cls(*(np.concatenate(column) for column in zip(*parts, strict=True)))


@define(eq=False)
class Guard:
    """Bounds one write: cancelled when the peer is lost, or when no progress is reported for ``stall`` seconds."""

    scope: anyio.CancelScope
    stall: float
    reason: BaseException | None = None

    def progress(self) -> None:
        """Record progress: the stall deadline starts again."""
        self.scope.deadline = anyio.current_time() + self.stall


class WritePipeline:
    """The writes of one :class:`~kvferry.transports.channel.ChannelTransport` and their counts."""

    def __init__(self, transport: ChannelTransport[DataPath]) -> None:
        self.transport = transport
        self._next_write_id = 1
        #: writes of ours that have not returned yet
        self.in_flight = 0
        self.completed = 0
        #: completed writes that moved as one copy with others
        self.combined = 0
        #: completed indexed writes whose addresses the device worked out
        self.indexed = 0
        self.failed = 0
        self.bytes_written = 0
        #: writes of ours refused for a destination outside the peer's grants
        self.refused = 0
        #: writes of peers into our memory refused for the same reason (two-sided receivers)
        self.incoming_refused = 0

    def new_write_id(self) -> int:
        """A write id, never reused by this transport (two-sided data paths announce writes by it)."""
        write_id = self._next_write_id
        self._next_write_id += 1
        return write_id

    @asynccontextmanager
    async def guard(self, peer: ChannelPeer, stall: float) -> AsyncIterator[Guard]:
        """Run the body until done, the peer is lost (its error is raised) or it stalls (TransferTimeout)."""
        if peer.state is not PeerState.CONNECTED:
            raise peer.error
        with anyio.CancelScope(deadline=anyio.current_time() + stall) as scope:
            guard = Guard(scope, stall)
            peer.guards.add(guard)
            try:
                yield guard
            finally:
                peer.guards.discard(guard)
        if scope.cancelled_caught:
            if guard.reason is not None:
                raise guard.reason
            raise TransferTimeout(f"write to {peer.address} made no progress for {stall} s")

    def count_refused(self, p: ChannelPeer, exc: NotGranted) -> None:
        """Count and log a write of ours refused for a destination outside ``p``'s grants."""
        self.refused += 1
        log.warning("%s: refused a write to %s: %s", self.transport.instance_id, p.address, exc)

    def count_incoming_refused(self, p: ChannelPeer, exc: NotGranted) -> None:
        """Count and log a write of ``p``'s into our memory refused (two-sided receivers)."""
        self.incoming_refused += 1
        log.warning("%s: refused a write from %s: %s", self.transport.instance_id, p.address, exc)

    # --- the three ways in -------------------------------------------------------------------------------

    async def write(
        self, p: ChannelPeer, src: npt.ArrayLike, dst: npt.ArrayLike, notify: bytes | None, stall: float
    ) -> None:
        """:meth:`~kvferry.transports.Transport.write` to a live peer."""
        try:
            checked = self.checked(p, write_rows(src, dst, merge=self.transport.coalesce))
        except NotGranted as exc:
            self.count_refused(p, exc)
            raise
        await self._write_checked(p, checked, notify, stall)

    async def write_many(
        self,
        p: ChannelPeer,
        writes: Sequence[tuple[npt.ArrayLike, npt.ArrayLike, bytes | None]],
        stall: float,
    ) -> list[Exception | None]:
        """:meth:`~kvferry.transports.Transport.write_many` to a live peer: every write is checked on its own (a
        refused one is left out); the rest move together, as one write and then their notifications in order,
        when this transport copies them itself (same process) or the data path can; else each is written on its
        own, concurrently."""
        merge = self.transport.coalesce
        outcomes: list[Exception | None] = [None] * len(writes)
        together = len(writes) > 1 and self._may_write_together(p)
        if together:
            # all of them checked as one write first (one pass over the rows, not one per write): when every
            # row is fine, so is every write on its own
            try:
                rows, sizes = joined_rows(writes, merge=merge)
                joined = self.checked(p, rows)
            except (RegionError, ValueError):
                pass  # one of them is refused: each is checked on its own below
            else:
                parts = [(i, sizes[i], notify) for i, (_, _, notify) in enumerate(writes)]
                if await self._write_together(
                    p, partial(self._move_together, p, joined, stall), parts, outcomes
                ):
                    return outcomes
                together = False  # the data path cannot move these together
        checked: list[tuple[int, CheckedRows, bytes | None]] = []
        for i, (src, dst, notify) in enumerate(writes):
            try:
                checked.append((i, self.checked(p, write_rows(src, dst, merge=merge)), notify))
            except (RegionError, ValueError) as exc:
                if isinstance(exc, NotGranted):
                    self.count_refused(p, exc)
                outcomes[i] = exc
        if together and len(checked) > 1:
            joined = CheckedRows.joined([c for _, c, _ in checked])
            parts = [(i, total_bytes(c.src), notify) for i, c, notify in checked]
            if await self._write_together(p, partial(self._move_together, p, joined, stall), parts, outcomes):
                return outcomes
        alone = await outcomes_of(
            [partial(self._write_checked, p, c, notify, stall) for _, c, notify in checked]
        )
        for (i, _, _), outcome in zip(checked, alone, strict=True):
            outcomes[i] = outcome
        return outcomes

    async def write_indexed(
        self, p: ChannelPeer, writes: Sequence[IndexedWrite], stall_timeout: float | None
    ) -> list[Exception | None]:
        """:meth:`~kvferry.transports.Transport.write_indexed` to a live peer. Where this transport copies device
        memory to ``p`` itself (a peer of this process; nixl's CUDA IPC mapping), each template is checked
        against both sides' registered memory once (:class:`~kvferry.transports._indexed_copy.IndexedCopies`),
        the writes' ids every time, and the writes move as one indexed device copy (one launch, one wait), then
        their notifications in order. Anything else (host memory, templates over several devices) goes as plain
        fragments."""
        transport = self.transport
        destinations = self._device_destinations(p) if writes else None
        if destinations is None:
            return await Transport.write_indexed(transport, p, writes, stall_timeout=stall_timeout)
        outcomes: list[Exception | None] = [None] * len(writes)
        on_device: list[tuple[int, Any]] = []
        plain: list[int] = []
        for i, w in enumerate(writes):
            try:
                template = p.indexed.template(
                    w.rows, transport.own_regions, p.regions, destinations, p.address
                )
                if template is not None:
                    # the template lies in registered memory; the rows these ids name must lie in the grants
                    w.check()
                    self._check_granted(p, w.rows.destination_runs(w.dst_ids))
            except RegionError as exc:  # refused before anything is written
                if isinstance(exc, NotGranted):
                    self.count_refused(p, exc)
                outcomes[i] = exc
                continue
            if template is None or (on_device and template.device != on_device[0][1].device):
                plain.append(i)
            else:
                on_device.append((i, template))
        if on_device:
            prepared: tuple[Any, Any] | None
            try:
                prepared = p.indexed.prepare([writes[i] for i, _ in on_device], [t for _, t in on_device])
            except RegionError:  # an id outside its limit: each write on its own says which
                good = []
                for i, template in on_device:
                    try:
                        writes[i].check()
                    except RegionError as exc:
                        outcomes[i] = exc
                    else:
                        good.append((i, template))
                on_device = good
                prepared = (
                    p.indexed.prepare([writes[i] for i, _ in good], [t for _, t in good]) if good else None
                )
            if prepared is not None:
                stall = transport.stall(stall_timeout)
                move = partial(self._indexed_here, p, len(on_device), *prepared, stall)
                parts = [(i, writes[i].nbytes, writes[i].notify) for i, _ in on_device]
                if not await self._write_together(p, move, parts, outcomes):
                    plain += [i for i, _ in on_device]  # no kernel: as plain fragments
        if plain:
            plain.sort()
            done = await Transport.write_indexed(
                transport, p, [writes[i] for i in plain], stall_timeout=stall_timeout
            )
            for i, outcome in zip(plain, done, strict=True):
                outcomes[i] = outcome
        return outcomes

    # --- checks ------------------------------------------------------------------------------------------

    def checked(self, p: ChannelPeer, rows: WriteRows) -> CheckedRows:
        """The rows to write (merged if they merge) and the registered ranges (of ours, of the peer's) that hold
        each, once every row is known to lie in registered memory, and every destination row in what the peer
        granted us (else :class:`~kvferry.errors.NotGranted`, a RegionError).

        Merged rows are checked first (fewer rows: a merged row inside one registered range holds every row it
        merged); only when one is not, the rows as given are checked, which names the first bad one, or, when
        each lies in a range but a merged one spans two adjacent ranges, are written unmerged.
        """
        own = self.transport.own_regions
        src, dst = rows.src, rows.dst
        # where write_rows saw the rows lie (many rows; the same bytes merged or not)
        b = rows.bounds
        src_bounds, dst_bounds = (None, None) if b is None else ((b[0], b[1]), (b[2], b[3]))
        if rows.merged_src is not None and rows.merged_dst is not None:
            try:
                src_index = own.locate(rows.merged_src, "source", src_bounds)
                dst_index = p.regions.locate(rows.merged_dst, f"destination at {p.address}", dst_bounds)
            except RegionError:
                pass
            else:
                # merged rows are unions of rows as given: inside the grants' union iff those are
                self._check_granted(p, rows.merged_dst, dst_bounds)
                return CheckedRows(rows.merged_src, rows.merged_dst, src_index, dst_index)
            # the wrap-around check ran on the merged rows: the rows as given get it row by row now
            src, dst = as_fragments(src), as_fragments(dst)
        src_index = own.locate(src, "source", src_bounds)
        dst_index = p.regions.locate(dst, f"destination at {p.address}", dst_bounds)
        self._check_granted(p, dst, dst_bounds)
        return CheckedRows(src, dst, src_index, dst_index)

    def _check_granted(self, p: ChannelPeer, dst: Fragments, bounds: tuple[int, int] | None = None) -> None:
        """:raises ~kvferry.errors.NotGranted: a destination row outside what ``p`` granted us."""
        p.grants.check(dst, f"destination at {p.address}", bounds)

    # --- moving the bytes --------------------------------------------------------------------------------

    def copies_itself(self, p: ChannelPeer) -> bool:
        """Writes to ``p`` are copies in this process (not through the data path)."""
        transport = self.transport
        return p.same_process and (transport.same_process_copy or not transport.capabilities.cross_process)

    def _may_write_together(self, p: ChannelPeer) -> bool:
        """Several writes to ``p`` may move as one (:meth:`_write_together` may still decline)."""
        return self.copies_itself(p) or self.transport.data_path.may_write_together(p)

    def _device_destinations(self, p: ChannelPeer) -> DeviceDestinations | None:
        """Where ``p``'s registered regions lie in this process for a device copy, or None (no device path)."""
        if self.copies_itself(p):
            return DeviceDestinations.same_process(p.regions)
        return self.transport.data_path.device_destinations(p)

    async def _copy_here(self, p: ChannelPeer, rows: CheckedRows, stall: float) -> None:
        """Copy checked rows in this process (a same-process peer), under the stall guard."""
        async with self.guard(p, stall):
            plan = CopyPlan(
                rows.src,
                self.transport.own_regions,
                rows.dst,
                p.regions,
                src_index=rows.src_index,
                dst_index=rows.dst_index,
            )
            # polled on the loop only when it is our one write in flight (pollers slow each other down)
            await plan.run(poll=self.in_flight == 1)

    async def _write_checked(
        self, p: ChannelPeer, rows: CheckedRows, notify: bytes | None, stall: float
    ) -> None:
        self.in_flight += 1
        try:
            if self.copies_itself(p):
                await self._copy_here(p, rows, stall)
                if notify is not None:
                    await self.transport.control.send_frame(p, FrameKind.NOTIFY, notify)
            else:
                await self.transport.data_path.write(p, rows, notify, stall)
        except NotGranted as exc:  # a two-sided receiver refused it: nothing was written
            self.count_refused(p, exc)
            raise
        except BaseException:
            self.failed += 1
            raise
        finally:
            self.in_flight -= 1
        self.completed += 1
        self.bytes_written += total_bytes(rows.src)

    async def _move_together(self, p: ChannelPeer, combined: CheckedRows, stall: float) -> bool:
        """Copy several writes' checked rows as one; False (nothing written) when the data path cannot."""
        if self.copies_itself(p):
            await self._copy_here(p, combined, stall)
            return True
        return await self.transport.data_path.write_together(p, combined, stall)

    async def _indexed_here(self, p: ChannelPeer, count: int, launch: Any, ids: Any, stall: float) -> bool:
        async with self.guard(p, stall):
            moved = await p.indexed.copy(launch, ids, poll=self.in_flight == 1)
        if moved:
            self.indexed += count
        return moved

    async def _write_together(
        self,
        p: ChannelPeer,
        move: Callable[[], Awaitable[bool]],
        parts: Sequence[tuple[int, int, bytes | None]],
        outcomes: list[Exception | None],
    ) -> bool:
        """Move the bytes of several writes at once (``move``; ``parts``: each one's index, bytes and
        notification), then send their notifications in order, filling ``outcomes``; False (nothing written)
        when ``move`` cannot write them together."""
        self.in_flight += 1
        try:
            if not await move():
                return False
        except Exception as exc:  # the writes failed together
            self.failed += len(parts)
            for i, _, _ in parts:
                outcomes[i] = exc
            return True
        except BaseException:
            self.failed += len(parts)
            raise
        finally:
            self.in_flight -= 1
        # every byte of every part landed: now the notifications, in order, in one send
        try:
            await self.transport.control.send_frames(
                p, [(FrameKind.NOTIFY, notify) for _, _, notify in parts if notify is not None]
            )
        except Exception as exc:  # the peer is lost: which notifications arrived is unknown
            failed: Exception | None = exc
        else:
            failed = None
        for i, nbytes, notify in parts:
            if failed is not None and notify is not None:
                outcomes[i] = failed
                self.failed += 1
                continue
            self.completed += 1
            self.combined += 1
            self.bytes_written += nbytes
        return True

    def __repr__(self) -> str:
        return (
            f"<WritePipeline [{self.in_flight} in flight | {self.completed} done ({self.combined} combined, "
            f"{self.indexed} indexed), {self.failed} failed, {self.refused} refused | "
            f"{self.bytes_written} bytes]>"
        )
