"""The device path of indexed writes (:mod:`kvferry.transports.indexed`): templates checked once per peer against
both sides' registered memory, and writes launched as one batched indexed copy whose ids are checked each time.

Used where a transport copies device memory itself: a peer in this process, or a peer's CUDA memory mapped here
by CUDA IPC (nixl). Per write the host joins the ids, compares them with the limits (one pass), and launches;
the device works out every address (:func:`kvferry.kernels.span_copy.copy_indexed`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from attrs import define, frozen

from kvferry.errors import RegionError
from kvferry.kernels import span_copy
from kvferry.transports._memory import RegionTable, synchronize_cuda
from kvferry.transports.indexed import IndexedRows, IndexedWrite

__all__ = ["DeviceDestinations", "IndexedCopies"]

#: templates (and joined launches) kept per peer; the oldest is dropped
_KEPT = 64


def _kernel_for(device: str) -> bool:
    """Whether the indexed span copy can run on ``device`` (CUDA with Triton)."""
    import torch

    return span_copy.available(torch.device(device))


@frozen(eq=False)
class DeviceDestinations:
    """Where a peer's registered regions lie in this process for a device copy: for each of the peer's regions
    the index into :attr:`table` of the region mapped here that holds it (-1: not mapped), and per mapped region
    the shift from the peer's addresses to ours (mod 2**64)."""

    exported: npt.NDArray[np.int64]
    shift: npt.NDArray[np.uint64]
    table: RegionTable

    @classmethod
    def same_process(cls, regions: RegionTable) -> DeviceDestinations:
        """A peer of this process: its addresses are ours."""
        return cls(np.arange(len(regions), dtype=np.int64), np.zeros(len(regions), dtype=np.uint64), regions)


@define(eq=False)
class _Template:
    """A template checked for one peer: its device and its destination rows' addresses here (at id 0)."""

    device: Any
    dst_address: npt.NDArray[np.int64]


@define(eq=False)
class _Launch:
    """Templates written together: their joined device table, the limit of every id it reads, and a pinned id
    vector the kernel reads (one launch at a time uses it; another one at the same time takes its own)."""

    table: span_copy.IndexedTable
    limits: npt.NDArray[np.uint64]
    ids: npt.NDArray[np.int64] | None = None
    #: where the kernel reads :attr:`ids` from (a copy on the device, made on the stream before each launch)
    device_ids: Any = None
    busy: bool = False
    #: ordinary memory the ids are joined and checked in before they go to :attr:`ids` in one pass (numpy reads
    #: pinned memory slower than ordinary memory)
    scratch: npt.NDArray[np.int64] | None = None

    def take_ids(self) -> npt.NDArray[np.int64]:
        """A pinned id vector for one launch (give it back with :meth:`give_back`)."""
        if self.busy:
            return span_copy.pinned_ids(len(self.limits))
        if self.ids is None:
            import torch

            self.ids = span_copy.pinned_ids(len(self.limits))
            self.device_ids = torch.empty(
                max(len(self.limits), 1), dtype=torch.int64, device=self.table.device
            )
        self.busy = True
        return self.ids

    def give_back(self, ids: npt.NDArray[np.int64]) -> None:
        if ids is self.ids:
            self.busy = False


class IndexedCopies:
    """What a transport checked of the templates written to one peer, for the region tables in force (a change
    of either side's regions or of the mapping forgets it all), and the joined tables of templates written
    together."""

    __slots__ = ("_key", "_launches", "_templates", "launches", "templates_checked")

    def __init__(self) -> None:
        self._key: tuple[RegionTable, RegionTable, RegionTable] | None = None
        self._templates: dict[IndexedRows, _Template | None] = {}
        self._launches: dict[tuple[IndexedRows, ...], _Launch] = {}
        #: templates checked against registered memory (once each while the regions stay)
        self.templates_checked = 0
        #: indexed copies launched
        self.launches = 0

    def template(
        self,
        rows: IndexedRows,
        own: RegionTable,
        regions: RegionTable,
        destinations: DeviceDestinations,
        where: str,
    ) -> _Template | None:
        """``rows`` checked against our registered memory (``own``) and the peer's (``regions``), or None when
        they cannot be copied by one device here (host memory, several devices, a region not mapped): the
        write then goes as plain fragments.

        :raises RegionError: some address the template may reach lies outside registered memory.
        """
        key = (own, regions, destinations.table)
        if self._key is None or any(a is not b for a, b in zip(self._key, key, strict=True)):
            self._templates.clear()
            self._launches.clear()
            self._key = key
        if rows in self._templates:
            return self._templates[rows]
        src_extents, dst_extents = rows.extents()
        src_index = own.locate(src_extents, "source of an indexed write")
        dst_index = regions.locate(dst_extents, f"destination of an indexed write at {where}")
        self.templates_checked += 1
        template = None
        devices = own.devices(src_index)
        if len(rows) and len(devices) == 1 and "cpu" not in devices and _kernel_for(next(iter(devices))):
            mapped = destinations.exported[dst_index]
            if int(mapped.min()) >= 0 and destinations.table.devices(mapped) == devices:
                import torch

                shifted = rows.dst_base.astype(np.uint64) + destinations.shift[mapped]
                template = _Template(torch.device(devices.pop()), shifted.astype(np.int64))
        if len(self._templates) >= _KEPT:
            self._templates.pop(next(iter(self._templates)))
        self._templates[rows] = template
        return template

    def clear(self) -> None:
        """Forget every template and joined table (the peer is gone)."""
        self._templates.clear()
        self._launches.clear()
        self._key = None

    def _launch(self, writes: Sequence[IndexedWrite], templates: Sequence[_Template]) -> _Launch:
        key = tuple(w.rows for w in writes)
        launch = self._launches.get(key)
        if launch is not None:
            return launch
        columns: list[list[npt.NDArray[np.int64]]] = [[] for _ in range(7)]
        limits: list[npt.NDArray[np.int64]] = []
        at = 0
        for w, t in zip(writes, templates, strict=True):
            rows = w.rows
            # this write's ids in the joined vector: its source ids, then its destination ids
            dst_at = at + len(rows.src_limit)
            for column, values in zip(
                columns,
                (
                    rows.src_slot + at,
                    rows.src_base,
                    rows.src_stride,
                    rows.dst_slot + dst_at,
                    t.dst_address,
                    rows.dst_stride,
                    rows.length,
                ),
                strict=True,
            ):
                column.append(values)
            limits += [rows.src_limit, rows.dst_limit]
            at = dst_at + len(rows.dst_limit)
        ss, sb, st, ds, db, dt, length = (np.concatenate(c) for c in columns)
        table = span_copy.indexed_table(templates[0].device, ss, sb, st, ds, db, dt, length, at)
        launch = _Launch(table, np.concatenate(limits).astype(np.uint64))
        if len(self._launches) >= _KEPT:
            self._launches.pop(next(iter(self._launches)))
        self._launches[key] = launch
        return launch

    def prepare(
        self, writes: Sequence[IndexedWrite], templates: Sequence[_Template]
    ) -> tuple[_Launch, npt.NDArray[np.int64]]:
        """The joined launch of ``writes`` (their templates checked, all on one device) and their ids joined into
        its pinned vector (hand both to :meth:`copy`, which gives the vector back).

        :raises RegionError: an id outside its limit, or a write with another number of ids than its template
            (check each write to find which)."""
        launch = self._launch(writes, templates)
        if launch.scratch is None:
            launch.scratch = np.empty(len(launch.limits), dtype=np.int64)
        joined = launch.scratch
        try:
            # every write's source ids then its destination ids, write after write (the joined table's slots)
            np.concatenate([v for w in writes for v in (w.src_ids, w.dst_ids)], out=joined)
        except ValueError:  # the lengths do not add up to the joined templates'
            raise RegionError("indexed writes: more or fewer ids than their templates") from None
        if not bool(np.less(joined.view(np.uint64), launch.limits).all()):
            raise RegionError("indexed writes: an id outside its limit")
        ids = launch.take_ids()
        ids[...] = joined
        return launch, ids

    async def copy(self, launch: _Launch, ids: npt.NDArray[np.int64], *, poll: bool) -> bool:
        """Copy a prepared launch and wait for it; False when the kernel could not be launched (nothing was
        copied). A cancel during the wait is held off until the copy ran (nothing lands after it returns)."""
        keep: list[Any] = [launch.table]
        try:
            with span_copy.on_device(launch.table.device):
                try:
                    own = ids is launch.ids  # the launch's own vector: its device copy is ours too
                    device_ids = launch.device_ids if own else None
                    if not span_copy.copy_indexed(
                        launch.table, ids, keep=keep, pinned=True, device_ids=device_ids
                    ):
                        return False
                    self.launches += 1
                finally:
                    await synchronize_cuda(launch.table.nbytes, poll=poll)
        finally:
            launch.give_back(ids)
        return True

    def __repr__(self) -> str:
        return (
            f"<IndexedCopies {len(self._templates)} templates ({self.templates_checked} checked), "
            f"{len(self._launches)} joined, {self.launches} launches>"
        )
