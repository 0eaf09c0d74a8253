"""Registered memory: range lookups that refuse what lies outside, and byte views of registered ranges."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.lowlevel
import numpy as np
import numpy.typing as npt

from kvferry.errors import NotGranted, RegionError, WireFormatError
from kvferry.kernels import span_copy
from kvferry.kernels.rows import copy_by_rows
from kvferry.transports.base import Fragments, Registration, total_bytes
from kvferry.transports.messages import RegionInfo

if TYPE_CHECKING:
    import torch

__all__ = [
    "CopyPlan",
    "GrantTable",
    "Grants",
    "RegionTable",
    "TensorRegistration",
    "byte_view",
    "device_copy",
    "device_of",
    "region_infos",
    "synchronize_cuda",
    "union_of",
]

#: host copies of at most this many bytes run on the event loop's thread (a hand-off costs more)...
HOST_INLINE_BYTES = 1 << 20
#: ... longer ones in a worker thread, this many bytes per call at most (a cancel is seen between calls). A turn
#: of the event loop between pieces of one copy costs a host copy near a memcpy much of its rate: 4 MiB pieces
#: with a turn after each reached 0.75 of a memcpy on ``cpu-2core``, 64 MiB pieces 0.93
HOST_SLICE_BYTES = 64 << 20
#: a write of at most this many device rows is a ``copy_`` each (cheaper to launch than the batched kernel)
FEW_DEVICE_COPIES = 8
#: device rows at least this long, when they are at least half a write's rows (and at most MAX_DEVICE_COPIES),
#: are a ``copy_`` each, queued first: the device's own copy is faster per byte than the kernel, and the device
#: is busy with the first of them while the host queues the rest
DEVICE_COPY_BYTES = 32 << 20
MAX_DEVICE_COPIES = 64
#: device waits are polled on the event loop for at most this long, then waited for in a worker thread
POLL_SECONDS = 1e-3
#: ... and for at most this long plus the time the copied bytes take at this rate
POLL_BASE_SECONDS = 100e-6
POLL_BYTES_PER_SECOND = 1e12


def device_of(tensor: torch.Tensor) -> str:
    if tensor.device.type == "cpu":
        return "cpu"
    if tensor.device.type == "cuda":
        return f"cuda:{tensor.device.index if tensor.device.index is not None else 0}"
    raise ValueError(f"cannot register memory on device {tensor.device}")


class TensorRegistration(Registration):
    """The registration handle every transport hands out; ``backend`` holds the library's own handle."""

    __slots__ = ("_active", "_tensors", "backend", "infos")

    def __init__(self, tensors: Sequence[torch.Tensor], backend: Any = None) -> None:
        for tensor in tensors:
            if not tensor.is_contiguous():
                raise ValueError("registered tensors must be contiguous")
            if tensor.numel() == 0:
                raise ValueError("cannot register an empty tensor")
            device_of(tensor)
        self._tensors = tuple(tensors)
        self._active = True
        self.backend = backend
        self.infos = region_infos(self._tensors)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self._tensors

    @property
    def active(self) -> bool:
        return self._active

    def deactivate(self) -> None:
        self._active = False

    @property
    def nbytes(self) -> int:
        return sum(info.length for info in self.infos)

    def __repr__(self) -> str:
        state = "active" if self._active else "deregistered"
        return f"<Registration [{len(self._tensors)} tensors, {self.nbytes} bytes | {state}]>"


def region_infos(tensors: Sequence[torch.Tensor]) -> tuple[RegionInfo, ...]:
    return tuple(RegionInfo(t.data_ptr(), t.numel() * t.element_size(), device_of(t)) for t in tensors)


_U64 = (1 << 64) - 1


def _bounds(regions: Sequence[RegionInfo]) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """The start and end of each range as uint64, an end of exactly ``2**64`` as ``2**64 - 1`` (a fragment ends
    at ``2**64 - 1`` at most: the same answers).

    :raises ~kvferry.errors.WireFormatError: if a range is not inside the address space.
    """
    addresses = [r.address for r in regions]
    lengths = [r.length for r in regions]
    # the bounds first: numpy raises OverflowError for an int outside uint64
    if regions and (min(addresses) < 0 or max(addresses) > _U64 or min(lengths) < 1 or max(lengths) > _U64):
        bad = next(r for r in regions if not (0 <= r.address <= _U64 and 1 <= r.length <= _U64))
        raise WireFormatError(f"region [{bad.address:#x}, +{bad.length:#x}) is not inside the address space")
    starts = np.array(addresses, dtype=np.uint64)
    lengths_ = np.array(lengths, dtype=np.uint64)
    ends = starts + lengths_  # mod 2**64: an end past 2**64 - 1 wraps below its start
    wrapped = ends < starts
    if bool(wrapped.any()):
        index = np.flatnonzero(wrapped & (ends != 0))
        if len(index):
            bad = regions[int(index[0])]
            raise WireFormatError(f"region [{bad.address:#x}, +{bad.length:#x}) ends past 2**64")
        ends[wrapped] = _U64
    return starts, ends


class _Ranges:
    """Ranges sorted by start, and the search that finds one holding each fragment (:class:`RegionTable`'s;
    :class:`GrantTable` merges its ranges first and needs less).

    Ranges may overlap. A fragment ``[a, a + n)`` is inside iff some range with ``start <= a`` ends at or
    after ``a + n``; the range with the largest end among those starting at or before ``a`` decides, so one
    ``searchsorted`` over a running maximum answers every fragment at once.
    """

    __slots__ = ("_best", "_best_end", "_starts")

    _best: npt.NDArray[np.int64]
    _best_end: npt.NDArray[np.uint64]
    _starts: npt.NDArray[np.uint64]

    def _index(self, starts: npt.NDArray[np.uint64], ends: npt.NDArray[np.uint64]) -> None:
        """Build the search over ranges ``[starts[i], ends[i])`` (any order; index ``i`` names range ``i``)."""
        order = np.argsort(starts, kind="stable")
        # entry 0 is a sentinel, an empty range at address 0 (index -1): a search never lands before it
        self._starts = np.concatenate((np.zeros(1, dtype=np.uint64), starts[order]))
        sorted_ends = ends[order]
        best_end = np.maximum.accumulate(sorted_ends) if len(order) else sorted_ends
        # the range that first reached each running maximum (ties keep the earlier range)
        rises = np.ones(len(order), dtype=np.bool_)
        rises[1:] = sorted_ends[1:] > best_end[:-1]
        first = np.maximum.accumulate(np.where(rises, np.arange(len(order)), 0)) if len(order) else order
        self._best = np.concatenate((np.full(1, -1, dtype=np.int64), order[first].astype(np.int64)))
        self._best_end = np.concatenate((np.zeros(1, dtype=np.uint64), best_end))

    def _count(self) -> int:
        return len(self._starts) - 1

    def holding(self, fragments: Fragments, bounds: tuple[int, int] | None = None) -> npt.NDArray[np.int64]:
        """The index of a range holding each fragment, -1 for a fragment outside every range (no error).

        ``bounds``: the fragments' lowest address and a bound on their highest end (no fragment ends past it),
        when the caller has them: one range holding that span answers every fragment without a pass over
        them.
        """
        if len(fragments) == 0 or not self._count():
            return np.full(len(fragments), -1, dtype=np.int64)
        if len(fragments) > 1 and bounds is not None:
            one = self._one_range(*bounds, len(fragments))
            if one is not None:
                return one
            # not in one range (or the bound overshoots it): the rows' own ends decide below
        addresses = fragments[:, 0]
        ends = addresses + fragments[:, 1]
        if len(fragments) > 1:
            # every row inside the range that holds the lowest address (one buffer, the common case)
            one = self._one_range(int(addresses.min()), int(ends.max()), len(fragments))
            if one is not None:
                return one
        pos = np.searchsorted(self._starts, addresses, side="right")
        pos -= 1  # at least 0: the sentinel (whose end, 0, holds no fragment: -1)
        return np.where(self._best_end[pos] >= ends, self._best[pos], -1)

    def _one_range(self, lowest: int, highest: int, count: int) -> npt.NDArray[np.int64] | None:
        """The index of the range holding ``[lowest, highest)`` for each of ``count`` rows (a read-only
        broadcast, no search per row), or None when no range holds all of it."""
        first = int(np.searchsorted(self._starts, lowest, side="right")) - 1
        if int(self._best_end[first]) >= highest and lowest <= highest:
            return np.broadcast_to(self._best[first], count)
        return None

    def _outside(
        self, fragments: Fragments, bounds: tuple[int, int] | None
    ) -> tuple[npt.NDArray[np.int64], int | None]:
        """:meth:`holding`, and the first fragment outside every range (None: none is)."""
        index = self.holding(fragments, bounds)
        if len(index) and int(index.min()) < 0:
            return index, int(np.flatnonzero(index < 0)[0])
        return index, None


def _describe(fragments: Fragments, row: int) -> str:
    return f"fragment {row} [{int(fragments[row, 0]):#x}, +{int(fragments[row, 1])})"


class RegionTable(_Ranges):
    """Registered ranges, for checking that fragments lie inside them (see :class:`_Ranges`)."""

    __slots__ = ("_views", "device", "regions")

    def __init__(self, regions: Sequence[RegionInfo]) -> None:
        """:raises ~kvferry.errors.WireFormatError: (a ValueError) if a range is not inside the address space:
        a negative address, a length below 1, or an end past ``2**64``."""
        self.regions = tuple(regions)
        devices = {r.device for r in self.regions}
        #: the one device every range is on, or None (none, or several)
        self.device: str | None = devices.pop() if len(devices) == 1 else None
        self._views: dict[int, Any] = {}
        starts, ends = _bounds(self.regions)
        self._index(starts, ends)

    def __len__(self) -> int:
        return len(self.regions)

    def devices(self, index: npt.NDArray[np.int64]) -> set[str]:
        """The devices of the ranges ``index`` names (as :meth:`locate` returns them)."""
        if self.device is not None and len(index):
            return {self.device}
        return {self.regions[int(i)].device for i in np.unique(index)}

    def view(self, index: int) -> Any:
        """:func:`byte_view` of range ``index``, made once per table (the table is replaced when its ranges
        change; the owner keeps the ranges registered while the table is in use)."""
        view = self._views.get(index)
        if view is None:
            view = self._views[index] = byte_view(self.regions[index])
        return view

    def locate(
        self, fragments: Fragments, what: str, bounds: tuple[int, int] | None = None
    ) -> npt.NDArray[np.int64]:
        """The index (into ``regions``) of a registered range holding each fragment (``bounds``: as
        :meth:`holding`).

        :raises ~kvferry.errors.RegionError: naming the first fragment outside every range.
        """
        if len(fragments) == 0:
            return np.empty(0, dtype=np.int64)
        if not self.regions:
            raise RegionError(f"{what}: no memory is registered")
        index, bad = self._outside(fragments, bounds)
        if bad is not None:
            raise RegionError(f"{what}: {_describe(fragments, bad)} is outside every registered region")
        return index


def union_of(fragments: Fragments) -> Fragments:
    """The union of ``(address, length)`` rows (none wrapping around) as ranges in address order, rows that
    overlap or touch merged: ``(n, 2)`` uint64. Rows in that form already (ascending, none touching the next, as
    a granting side sends them) come back as they are, after one vectorised pass; others are sorted first."""
    rows = np.ascontiguousarray(fragments, dtype=np.uint64).reshape(-1, 2)
    if len(rows) <= 1:
        return rows
    starts = rows[:, 0]
    ends = starts + rows[:, 1]
    if bool((starts[1:] > ends[:-1]).all()):
        return rows
    order = np.argsort(starts)
    starts = starts[order]
    reach = np.maximum.accumulate(ends[order])
    # a merged range starts where a row starts past everything before it ends (touching rows merge)
    new = np.empty(len(starts), dtype=np.bool_)
    new[0] = True
    np.greater(starts[1:], reach[:-1], out=new[1:])
    first = np.flatnonzero(new)
    out = np.empty((len(first), 2), dtype=np.uint64)
    out[:, 0] = starts[first]
    # each merged range ends where the running reach stands just before the next one starts
    out[:-1, 1] = reach[first[1:] - 1]
    out[-1, 1] = reach[-1]
    out[:, 1] -= out[:, 0]
    return out


class GrantTable:
    """The union of granted ranges, for checking that a write's destination lies inside it: ranges that overlap
    or touch are merged first (a row across two grants that touch lies in the union). The merged ranges are
    disjoint and sorted, so one ``searchsorted`` finds the only range that may hold each fragment."""

    __slots__ = ("_ends", "_starts", "ranges")

    def __init__(self, fragments: Fragments) -> None:
        #: the merged ranges, ``(n, 2)`` ``(address, length)`` in address order
        self.ranges: Fragments = union_of(fragments)
        n = len(self.ranges)
        # entry 0 is a sentinel, an empty range at address 0: a search never lands before it
        self._starts = np.zeros(n + 1, dtype=np.uint64)
        self._ends = np.zeros(n + 1, dtype=np.uint64)
        self._starts[1:] = self.ranges[:, 0]
        np.add(self.ranges[:, 0], self.ranges[:, 1], out=self._ends[1:])

    def __len__(self) -> int:
        return len(self.ranges)

    @property
    def nbytes(self) -> int:
        return int(self.ranges[:, 1].sum(dtype=np.uint64)) if len(self.ranges) else 0

    def check(self, fragments: Fragments, what: str, bounds: tuple[int, int] | None = None) -> None:
        """:raises ~kvferry.errors.NotGranted: naming the first fragment outside every granted range.

        ``bounds``: the fragments' lowest address and a bound on their highest end, when the caller has them:
        one range holding that span answers every fragment without a pass over them."""
        if len(fragments) == 0:
            return
        if not len(self.ranges):
            raise NotGranted(f"{what}: nothing is granted")
        bad = self.first_outside(fragments, bounds)
        if bad is not None:
            raise NotGranted(f"{what}: {_describe(fragments, bad)} is outside every granted range")

    def holds(self, fragments: Fragments, bounds: tuple[int, int] | None = None) -> bool:
        """Every fragment lies inside the union."""
        return not len(fragments) or self.first_outside(fragments, bounds) is None

    def first_outside(self, fragments: Fragments, bounds: tuple[int, int] | None = None) -> int | None:
        """The index of the first fragment outside every granted range, or None (every one is inside)."""
        if bounds is not None and len(fragments) > 1:
            lowest, highest = bounds
            first = int(np.searchsorted(self._starts, lowest, side="right")) - 1
            if lowest <= highest and int(self._ends[first]) >= highest:
                return None
        addresses = fragments[:, 0]
        at = np.searchsorted(self._starts, addresses, side="right")
        at -= 1  # at least 0: the sentinel (whose end, 0, holds no fragment)
        inside = self._ends[at] >= addresses + fragments[:, 1]
        if bool(inside.all()):
            return None
        return int(np.argmin(inside))


#: a write is checked against this many of the latest grants one by one (each a search of the write's rows over
#: that grant's ranges alone) before the union of every live grant is made: one grant holds a typical write
#: (the transfer's own, made just before it), and those tables cost nothing more to keep when grants come and go
GRANTS_TRIED = 4


class Grants:
    """The live grants of one direction of one peer (ours to it, or its to us): their rows by grant id.

    A check tries the latest grants one by one (:data:`GRANTS_TRIED`; each one's :class:`GrantTable` is made when
    first needed, and sorts nothing when its rows come sorted and merged, as a granting transport sends them),
    then the union of every live grant (:attr:`table`, made when first asked for after a change), which holds
    every write the union holds: a row across two grants that touch, a write over several grants. So a grant
    or a revoke costs no rebuild of the union as long as the writes lie inside single grants."""

    __slots__ = ("_rows", "_tables", "_union")

    def __init__(self) -> None:
        self._rows: dict[int, Fragments] = {}
        self._tables: dict[int, GrantTable] = {}
        self._union: GrantTable | None = None

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, grant_id: object) -> bool:
        return grant_id in self._rows

    def add(self, grant_id: int, rows: Fragments) -> None:
        self._rows[grant_id] = rows
        self._union = None

    def remove(self, grant_id: int) -> bool:
        """Forget grant ``grant_id``; False if it was not live."""
        if self._rows.pop(grant_id, None) is None:
            return False
        self._tables.pop(grant_id, None)
        self._union = None
        return True

    def clear(self) -> None:
        self._rows.clear()
        self._tables.clear()
        self._union = None

    @property
    def table(self) -> GrantTable:
        """The union of every live grant."""
        if self._union is None:
            rows = list(self._rows.values())
            self._union = GrantTable(np.concatenate(rows) if rows else np.zeros((0, 2), dtype=np.uint64))
        return self._union

    def _in_one(self, fragments: Fragments, bounds: tuple[int, int] | None) -> bool:
        """Whether one of the latest grants holds every fragment."""
        for tried, grant_id in enumerate(reversed(self._rows)):
            if tried == GRANTS_TRIED:
                break
            table = self._tables.get(grant_id)
            if table is None:
                table = self._tables[grant_id] = GrantTable(self._rows[grant_id])
            if table.first_outside(fragments, bounds) is None:
                return True
        return False

    def check(self, fragments: Fragments, what: str, bounds: tuple[int, int] | None = None) -> None:
        """:raises ~kvferry.errors.NotGranted: naming the first fragment outside the union of the live grants
        (``bounds``: as :meth:`GrantTable.check`)."""
        if len(fragments) and not self._in_one(fragments, bounds):
            self.table.check(fragments, what, bounds)

    def holds(self, fragments: Fragments) -> bool:
        """Every fragment lies inside the union of the live grants."""
        return not len(fragments) or self._in_one(fragments, None) or self.table.holds(fragments)

    def __repr__(self) -> str:
        return f"<Grants {len(self._rows)} live, {self.table.nbytes} bytes>"


class _CudaArray:
    """Just enough of ``__cuda_array_interface__`` for torch to view a raw device range."""

    def __init__(self, address: int, length: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (length,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


def byte_view(info: RegionInfo) -> Any:
    """A uint8 view of a registered range: a numpy array for host memory, a torch tensor for CUDA memory.

    The caller guarantees the range stays registered (alive) while the view is used.
    """
    if info.device == "cpu":
        buffer = (ctypes.c_uint8 * info.length).from_address(info.address)
        return np.ctypeslib.as_array(buffer)
    import torch

    return torch.as_tensor(_CudaArray(info.address, info.length), device=info.device)


class CopyPlan:
    """Copies between two sets of registered ranges in one address space (same process, or a CUDA IPC mapping).

    Host rows are copied by ``memmove`` of their addresses, a short copy on the event loop's thread, a longer one
    in a worker thread in slices (:func:`_host_copy`). Rows between CUDA ranges of one device are one batched launch of :mod:`kvferry.kernels.span_copy`
    (absolute addresses, any number of region pairs) on the current stream; without Triton, per pair of regions,
    they are copied by rows of their granularity (:mod:`kvferry.kernels.rows`). The end is awaited once
    (:func:`synchronize_cuda`). Other rows (host <-> device) are single asynchronous copies.
    """

    def __init__(
        self,
        src: Fragments,
        src_regions: RegionTable,
        dst: Fragments,
        dst_regions: RegionTable,
        *,
        src_index: npt.NDArray[np.int64] | None = None,
        dst_index: npt.NDArray[np.int64] | None = None,
    ) -> None:
        """``src_index``/``dst_index``: the rows' regions when the caller has located them already."""
        self.src, self.dst = src, dst
        self.src_index = src_regions.locate(src, "source") if src_index is None else src_index
        self.dst_index = dst_regions.locate(dst, "destination") if dst_index is None else dst_index
        self.src_regions, self.dst_regions = src_regions, dst_regions

    async def run(self, *, poll: bool = True) -> None:
        """Copy every row; returns when the bytes are in place (CUDA copies synchronised).

        ``poll``: the end of CUDA copies may be polled on the event loop (:func:`synchronize_cuda`); callers
        with other copies in flight pass False (several pollers only slow each other down).

        A cancel while the copy runs waits (shielded) for what was queued on the device: nothing lands after
        the cancel returns, and the kernel's tables (read from pinned host memory) outlive it.
        """
        # what the device copies still read (the span copy's pinned tables), held until the stream passed them
        keep: list[Any] = []
        device = self.src_regions.device
        if device is not None and device != "cpu" and device == self.dst_regions.device:
            # every row between CUDA ranges of one device (the common case): no per-row sorting
            nbytes = total_bytes(self.src)
            try:
                self._device_rows(np.arange(len(self.src)), keep, nbytes)
            finally:
                await synchronize_cuda(nbytes, poll=poll)
            return
        codes: dict[str, int] = {"cpu": -1}
        s_code = np.array(
            [codes.setdefault(r.device, len(codes)) for r in self.src_regions.regions], dtype=np.int64
        )
        d_code = np.array(
            [codes.setdefault(r.device, len(codes)) for r in self.dst_regions.regions], dtype=np.int64
        )
        if len(self.src):
            s_dev, d_dev = s_code[self.src_index], d_code[self.dst_index]
            same_cuda = (s_dev >= 0) & (s_dev == d_dev)
        else:
            same_cuda = np.zeros(0, dtype=bool)
        uses_cuda = False
        try:
            if same_cuda.any():
                uses_cuda = True
                for code in np.unique(s_dev[same_cuda]):
                    rows = np.flatnonzero(same_cuda & (s_dev == code))
                    self._device_rows(rows, keep)
                    await anyio.lowlevel.checkpoint()
            others = np.flatnonzero(~same_cuda)
            if len(others):
                on_host = (s_code[self.src_index[others]] < 0) & (d_code[self.dst_index[others]] < 0)
                for row in others[~on_host].tolist():  # host <-> device: one copy each
                    uses_cuda = True
                    s_index, d_index = int(self.src_index[row]), int(self.dst_index[row])
                    _torch_copy(
                        self.dst_regions.view(d_index),
                        int(self.dst[row, 0]) - self.dst_regions.regions[d_index].address,
                        self.src_regions.view(s_index),
                        int(self.src[row, 0]) - self.src_regions.regions[s_index].address,
                        int(self.src[row, 1]),
                    )
                    await anyio.lowlevel.checkpoint()
                await _host_copy(self.src[others[on_host]], self.dst[others[on_host]])
        finally:
            # also when cancelled at a checkpoint above: what was queued has run before we return
            if uses_cuda:
                await synchronize_cuda(total_bytes(self.src), poll=poll)

    def _copy_rows(self, rows: npt.NDArray[np.int64]) -> None:
        """Queue one ``copy_`` per row."""
        for row in rows.tolist():
            s, d = int(self.src_index[row]), int(self.dst_index[row])
            _torch_copy(
                self.dst_regions.view(d),
                int(self.dst[row, 0]) - self.dst_regions.regions[d].address,
                self.src_regions.view(s),
                int(self.src[row, 0]) - self.src_regions.regions[s].address,
                int(self.src[row, 1]),
            )

    def _device_rows(self, rows: npt.NDArray[np.int64], keep: list[Any], nbytes: int | None = None) -> None:
        """Queue the copy of ``rows`` (all between CUDA ranges of one device): a ``copy_`` each when they are
        few, else one batched launch when Triton imports and builds the kernel, else indexed copies per pair of
        regions. ``keep`` gets what the queued copies read from host memory (hold it until the stream has passed
        them). ``nbytes``: the bytes of ``rows``, when the caller has them.

        Long rows among many short ones go to the batched launch too: the kernel moves them nearly as fast as
        ``copy_``, and each ``copy_`` from Python costs more host time before its launch than that difference.
        Only writes of mostly long rows, which take the device longer than the host needs to queue
        them, are ``copy_`` calls (:data:`DEVICE_COPY_BYTES`)."""
        import torch

        if len(rows) <= FEW_DEVICE_COPIES:
            self._copy_rows(rows)
            return
        # rows are ascending: as many as the plan has rows means all of them (views, no gathers)
        src, dst = (self.src, self.dst) if len(rows) == len(self.src) else (self.src[rows], self.dst[rows])
        longest = int(src[:, 1].max())
        if longest >= DEVICE_COPY_BYTES:
            long = src[:, 1] >= DEVICE_COPY_BYTES
            count = int(np.count_nonzero(long))
            if 2 * count >= len(rows) and count <= MAX_DEVICE_COPIES:
                self._copy_rows(rows[long])
                if count == len(rows):
                    return
                rows, src, dst = rows[~long], src[~long], dst[~long]
                longest, nbytes = int(src[:, 1].max()), None
        device = torch.device(self.src_regions.regions[int(self.src_index[rows[0]])].device)
        if (
            span_copy.available(device)
            and span_copy.copy_fragments(device, src, dst, keep=keep, longest=longest, total=nbytes)
            is not None
        ):
            return
        pairs = self.src_index[rows] * (1 << 32) + self.dst_index[rows]
        for key in np.unique(pairs):
            chosen = rows[pairs == key]
            s, d = int(self.src_index[chosen[0]]), int(self.dst_index[chosen[0]])
            device_copy(
                self.src_regions.view(s),
                self.src_regions.regions[s].address,
                self.src[chosen],
                self.dst_regions.view(d),
                self.dst_regions.regions[d].address,
                self.dst[chosen],
            )


async def _host_copy(src: Fragments, dst: Fragments) -> None:
    """Copy host rows of this process (checked: inside registered memory on both sides) by ``memmove`` of their
    addresses: at most :data:`HOST_INLINE_BYTES` on the event loop's thread, more in a worker thread,
    :data:`HOST_SLICE_BYTES` per call at most. A cancel is seen between calls: the rows of the calls made are
    copied, the rest not."""
    total = total_bytes(src)
    if total <= HOST_INLINE_BYTES:
        _memmove_rows(src[:, 0].tolist(), dst[:, 0].tolist(), src[:, 1].tolist())
        return
    from kvferry.transports._cma import slices, split_rows

    src, dst = split_rows(src, dst, HOST_SLICE_BYTES)
    for lo, hi in slices(src[:, 1], HOST_SLICE_BYTES):
        await anyio.to_thread.run_sync(
            _memmove_rows, src[lo:hi, 0].tolist(), dst[lo:hi, 0].tolist(), src[lo:hi, 1].tolist()
        )


def _memmove_rows(src: list[int], dst: list[int], lengths: list[int]) -> None:
    for s_addr, d_addr, length in zip(src, dst, lengths, strict=True):
        ctypes.memmove(d_addr, s_addr, length)


async def synchronize_cuda(nbytes: int = 0, *, poll: bool = True) -> None:
    """Wait until what this thread queued on the current stream ran, without blocking the event loop.

    With ``poll``, a wait the copy of ``nbytes`` should end soon is polled on the loop between its other tasks
    (at most :data:`POLL_SECONDS`; a hop to a worker thread costs more host time than such a copy takes);
    anything longer, or any wait without ``poll``, is waited for in a worker thread. A cancel
    during the wait is held off until the stream has passed the event (what was queued reads and writes
    memory the caller may free once we return).
    """
    import torch

    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    await wait_event(event, nbytes, poll=poll)


class _Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


async def wait_event(event: _Event, nbytes: int = 0, *, poll: bool = True) -> None:
    """The wait of :func:`synchronize_cuda` for a recorded ``event`` (anything with ``query`` and
    ``synchronize``): polled on the loop for at most the budget, then in a worker thread; a cancel is held
    off until the event has passed."""
    with anyio.CancelScope(shield=True):
        if event.query():
            return
        budget = min(POLL_SECONDS, POLL_BASE_SECONDS + nbytes / POLL_BYTES_PER_SECOND) if poll else 0.0
        end = time.perf_counter() + budget
        while time.perf_counter() < end:
            await anyio.lowlevel.checkpoint()
            if event.query():
                return
        await anyio.to_thread.run_sync(event.synchronize)


def device_copy(
    src_view: Any,
    src_base: int,
    src: Fragments,
    dst_view: Any,
    dst_base: int,
    dst: Fragments,
) -> None:
    """Queue the copy of ``src`` rows (inside ``src_view``, a uint8 CUDA tensor at ``src_base``) to ``dst`` rows
    (inside ``dst_view`` at ``dst_base``) on the current stream, as few indexed copies over ``[rows, g]`` views
    (:func:`kvferry.kernels.rows.copy_by_rows`).

    Returns at once; the caller synchronises. Rows must not overlap across the two views.
    """
    s_off = (src[:, 0] - np.uint64(src_base)).astype(np.int64)
    d_off = (dst[:, 0] - np.uint64(dst_base)).astype(np.int64)
    copy_by_rows(src_view, s_off, dst_view, d_off, src[:, 1].astype(np.int64))


def _torch_copy(dst: Any, d_off: int, src: Any, s_off: int, n: int) -> None:
    import torch

    d = dst[d_off : d_off + n] if isinstance(dst, torch.Tensor) else torch.from_numpy(dst[d_off : d_off + n])
    s = src[s_off : s_off + n] if isinstance(src, torch.Tensor) else torch.from_numpy(src[s_off : s_off + n])
    d.copy_(s, non_blocking=True)
