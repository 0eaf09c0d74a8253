"""Bounded staging memory for bounced transfers, and the two halves of a bounce.

A transfer whose fragments are many and small is *bounced*: the writer packs them into its staging memory
(:class:`StagedWrite`, one gather kernel), writes a few large fragments into a staging area the receiver
reserved for it, and the receiver unpacks them into its pages (:class:`ReceiveStaging`, one scatter kernel)
after the writer's notification says they landed.

Staging memory is one registered tensor per side, handed out in leases by a :class:`StagingPool`: never more
than its capacity. A transfer that finds no room falls back to direct writes (or waits a bounded time).
A receiver's lease is kept as long as a posted write may still reach it, exactly like its pages: it is
released when every writer reported, or when the peer is gone, never on a timeout.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping

import anyio
import attrs
import numpy as np
import numpy.typing as npt
import torch
from attrs import define

from kvferry.disagg.mapping import StagingPlan, StagingSegment
from kvferry.disagg.protocol import StagingArea
from kvferry.errors import ConfigError
from kvferry.kernels.copy import gather_fragments, scatter_fragments

__all__ = ["ReceiveStaging", "StagedWrite", "StagingLease", "StagingPool"]

#: Leases start at multiples of this many bytes (enough for any vector load of the kernels).
ALIGNMENT = 256


def _synchronize(tensor: torch.Tensor) -> None:
    if tensor.device.type == "cuda":
        torch.cuda.synchronize(tensor.device)


def _range(segment: StagingSegment, start: int, end: int) -> tuple[npt.NDArray[np.int64], int, int]:
    """The fragments of ``segment`` that fill staging bytes ``[start, end)``, trimmed to it, and the staging
    range they fill (empty when the segment lies outside)."""
    lo, hi = max(start, segment.offset), min(end, segment.offset + segment.nbytes)
    table = np.asarray(segment.fragments, dtype=np.int64).reshape(-1, 2)
    if lo >= hi:
        return table[:0], lo, lo
    ends = segment.offset + np.cumsum(table[:, 1])
    first = int(np.searchsorted(ends, lo, side="right"))
    last = int(np.searchsorted(ends, hi, side="left"))
    sub = table[first : last + 1].copy()
    starts = ends[first : last + 1] - sub[:, 1]
    cut = lo - int(starts[0])  # trim the head of the first fragment and the tail of the last
    sub[0, 0] += cut
    sub[0, 1] -= cut
    sub[-1, 1] -= int(ends[last]) - hi
    return sub, lo, hi


def _copy(
    plan: StagingPlan,
    pools: Mapping[str, torch.Tensor],
    staging: torch.Tensor,
    start: int,
    end: int,
    *,
    pack: bool,
) -> None:
    """Pack (or unpack) staging bytes ``[start, end)`` of ``plan`` with kernels.copy's fragment copies (one
    torch call per segment for small fragments: it runs without the GIL, so packing in a worker thread
    overlaps the writes and the event loop)."""
    for segment in plan.segments:
        table, lo, hi = _range(segment, start, end)
        if lo >= hi:
            continue
        if pack:
            gather_fragments(pools[segment.pool], table, staging[lo:hi])
        else:
            scatter_fragments(pools[segment.pool], table, staging[lo:hi])


@define(eq=False)
class StagingLease:
    """``nbytes`` of a :class:`StagingPool`'s buffer starting at ``offset``; give it back with :meth:`release`."""

    pool: StagingPool
    offset: int
    nbytes: int
    released: bool = False

    @property
    def tensor(self) -> torch.Tensor:
        """The leased bytes (a view of the pool's buffer)."""
        return self.pool.buffer[self.offset : self.offset + self.nbytes]

    @property
    def address(self) -> int:
        return self.pool.buffer.data_ptr() + self.offset

    def release(self) -> None:
        """Return the bytes to the pool (idempotent)."""
        self.pool.release(self)

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<StagingLease {self.nbytes} bytes at +{self.offset} {state}>"


@define(eq=False)
class StagingPool:
    """Leases of one preallocated 1-D uint8 ``buffer`` (register it with the transport once).

    First fit over a sorted free list; freed neighbours merge. Never allocates beyond ``buffer``: a request
    that does not fit gets None (:meth:`try_reserve`) or waits a bounded time (:meth:`reserve`).
    """

    buffer: torch.Tensor
    _free: list[tuple[int, int]] = attrs.field(init=False)
    _held: dict[int, StagingLease] = attrs.field(factory=dict, init=False)
    _changed: anyio.Event | None = attrs.field(default=None, init=False)
    _counts: dict[str, int] = attrs.field(
        factory=lambda: dict.fromkeys(("leases", "refused", "waited", "peak_bytes"), 0), init=False
    )

    def __attrs_post_init__(self) -> None:
        if self.buffer.dim() != 1 or self.buffer.dtype != torch.uint8 or not self.buffer.is_contiguous():
            raise ConfigError("a staging buffer is a contiguous 1-D uint8 tensor")
        self._free = [(0, self.buffer.numel())] if self.buffer.numel() else []

    @classmethod
    def allocate(cls, nbytes: int, device: str | torch.device = "cpu") -> StagingPool:
        """A pool over a new buffer of ``nbytes`` on ``device``."""
        if nbytes < 0:
            raise ConfigError(f"staging capacity must be >= 0, got {nbytes}")
        return cls(torch.empty(nbytes, dtype=torch.uint8, device=device))

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    @property
    def used(self) -> int:
        return sum(lease.nbytes for lease in self._held.values())

    @property
    def available(self) -> int:
        """The largest lease that would be granted now."""
        return max((length for _, length in self._free), default=0)

    def try_reserve(self, nbytes: int) -> StagingLease | None:
        """A lease of ``nbytes`` (> 0), or None when no free range is that large (nothing changes then)."""
        if nbytes <= 0:
            raise ConfigError(f"a staging lease needs a positive size, got {nbytes}")
        size = -(-nbytes // ALIGNMENT) * ALIGNMENT
        for i, (offset, length) in enumerate(self._free):
            if length >= size:
                if length == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, length - size)
                lease = StagingLease(self, offset, nbytes)
                self._held[offset] = lease
                self._counts["leases"] += 1
                self._counts["peak_bytes"] = max(self._counts["peak_bytes"], self.used)
                return lease
        self._counts["refused"] += 1
        return None

    async def reserve(self, nbytes: int, *, wait: float = 0.0) -> StagingLease | None:
        """:meth:`try_reserve`, waiting up to ``wait`` seconds for releases; None if it never fit (or can
        never fit). A cancel while waiting leaves nothing reserved."""
        lease = self.try_reserve(nbytes)
        if lease is not None or wait <= 0 or nbytes > self.capacity:
            return lease
        self._counts["waited"] += 1
        with anyio.move_on_after(wait):
            while lease is None:
                if self._changed is None:
                    self._changed = anyio.Event()
                await self._changed.wait()
                lease = self.try_reserve(nbytes)
        return lease

    def release(self, lease: StagingLease) -> None:
        """Give ``lease`` back (idempotent); wakes waiters of :meth:`reserve`."""
        if lease.released:
            return
        if lease.pool is not self or self._held.get(lease.offset) is not lease:
            raise ConfigError(f"{lease!r} is not a lease of this pool")
        del self._held[lease.offset]
        lease.released = True
        size = -(-lease.nbytes // ALIGNMENT) * ALIGNMENT
        i = bisect.bisect(self._free, (lease.offset, 0))
        start, end = lease.offset, lease.offset + size
        if i < len(self._free) and self._free[i][0] == end:  # merge with the next free range
            end += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == start:  # and with the previous one
            start = self._free[i - 1][0]
            self._free[i - 1] = (start, end - start)
        else:
            self._free.insert(i, (start, end - start))
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def statistics(self) -> dict[str, int]:
        return {
            **self._counts,
            "capacity": self.capacity,
            "used": self.used,
            "held": len(self._held),
            "free_ranges": len(self._free),
        }

    def __repr__(self) -> str:
        return (
            f"<StagingPool {self.used}/{self.capacity} bytes used in {len(self._held)} leases "
            f"on {self.buffer.device}, {len(self._free)} free ranges>"
        )


@define(eq=False)
class StagedWrite:
    """The writer's half of one bounce: pack ``plan``'s fragments of ``pools`` into ``lease`` once.

    The lease is the writer's own staging; it is released by :meth:`release` once no posted write reads it.
    """

    plan: StagingPlan
    pools: Mapping[str, torch.Tensor]
    lease: StagingLease
    packed: int = 0

    def pack(self, start: int = 0, end: int | None = None) -> None:
        """Gather the fragments that fill staging bytes ``[start, end)`` (default all) into the lease and wait
        for the device: a transport may read them next. Chunks pack their own ranges, so packing the next
        chunk overlaps writing this one.

        :raises ~kvferry.errors.ConfigError: a pool is missing or the range is outside (nothing is packed).
        """
        end = self.plan.nbytes if end is None else end
        if not 0 <= start <= end <= self.plan.nbytes:
            raise ConfigError(f"staging range [{start}, {end}) outside [0, {self.plan.nbytes})")
        self.plan._check(self.pools, self.lease.tensor)
        _copy(self.plan, self.pools, self.lease.tensor, start, end, pack=True)
        _synchronize(self.lease.tensor)
        self.packed += end - start

    def pack_chunk(self, src: npt.NDArray[np.uint64]) -> None:
        """Pack the staging bytes a chunk's ``src`` fragments (addresses in the lease) will write (one range per
        run of contiguous fragments)."""
        table = np.asarray(src, dtype=np.int64).reshape(-1, 2)
        if not len(table):
            return
        ends = table[:, 0] + table[:, 1]
        starts = np.flatnonzero(np.concatenate(([True], ends[:-1] != table[1:, 0])))
        stops = [*starts[1:].tolist(), len(table)]
        base = self.lease.address
        for a, b in zip(starts.tolist(), stops, strict=True):
            self.pack(int(table[a, 0]) - base, int(ends[b - 1]) - base)

    def release(self) -> None:
        self.lease.release()

    def __repr__(self) -> str:
        return (
            f"<StagedWrite {self.plan.nbytes} bytes, {self.plan.num_fragments} fragments, "
            f"{self.packed} bytes packed>"
        )


@define(eq=False)
class _Area:
    lease: StagingLease
    plan: StagingPlan
    pools: Mapping[str, torch.Tensor]
    scattered: bool = False
    #: bytes unpacked so far (ranges of chunks)
    unpacked: int = 0


@define(eq=False)
class ReceiveStaging:
    """The receiver's half of one session's bounces: a staging area per writer that may bounce.

    :meth:`areas` goes into the :class:`~.protocol.ReceiveRequest`; :meth:`scatter` unpacks a writer's area
    into the pages once all its chunks landed; :meth:`release` returns the leases (call it only when no
    posted write can reach them any more: every writer reported, or the peer is gone).
    """

    _areas: dict[int, _Area] = attrs.field(factory=dict)

    def add(
        self, writer: int, lease: StagingLease, plan: StagingPlan, pools: Mapping[str, torch.Tensor]
    ) -> None:
        """Offer ``lease`` to ``writer`` (``plan``: the receiver's scatter plan of that writer's bytes)."""
        if lease.nbytes < plan.nbytes:
            raise ConfigError(f"staging lease of {lease.nbytes} bytes < {plan.nbytes} to scatter")
        if writer in self._areas:
            raise ConfigError(f"writer {writer} already has a staging area")
        self._areas[writer] = _Area(lease, plan, pools)

    def areas(self) -> tuple[StagingArea, ...]:
        return tuple(StagingArea(w, a.lease.address, a.plan.nbytes) for w, a in sorted(self._areas.items()))

    @property
    def writers(self) -> frozenset[int]:
        return frozenset(self._areas)

    def scatter(self, writer: int, start: int = 0, end: int | None = None) -> None:
        """Unpack bytes ``[start, end)`` (default: all, once) of ``writer``'s area into its pages and wait for the
        device. A chunk's range may be unpacked as soon as it landed.

        :raises ~kvferry.errors.ConfigError: no area for ``writer``, a range outside it, or a pool is missing.
        """
        area = self._areas.get(writer)
        if area is None:
            raise ConfigError(f"writer {writer} has no staging area")
        whole = start == 0 and end is None
        end = area.plan.nbytes if end is None else end
        if not 0 <= start <= end <= area.plan.nbytes:
            raise ConfigError(f"staging range [{start}, {end}) outside [0, {area.plan.nbytes})")
        if whole and area.scattered:
            return
        area.plan._check(area.pools, area.lease.tensor)
        _copy(area.plan, area.pools, area.lease.tensor, start, end, pack=False)
        _synchronize(area.lease.tensor)
        area.unpacked += end - start
        area.scattered = area.scattered or whole or area.unpacked >= area.plan.nbytes

    def release(self) -> None:
        """Give every lease back (idempotent)."""
        for area in self._areas.values():
            area.lease.release()

    @property
    def nbytes(self) -> int:
        return sum(a.lease.nbytes for a in self._areas.values())

    def __repr__(self) -> str:
        scattered = sum(a.scattered for a in self._areas.values())
        return f"<ReceiveStaging {len(self._areas)} writers, {self.nbytes} bytes, {scattered} scattered>"
