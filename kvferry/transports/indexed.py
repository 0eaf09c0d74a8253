"""Indexed writes: rows whose addresses come from ids, checked once as a template and per write by their ids.

A disaggregated writer moves the same shape of bytes for every request: per page of a paged group, the same runs
of layers and heads at the same offsets in the page; per state slot, the same sections. Only the page ids and
the slot change. :class:`IndexedRows` is that shape, a *template*: row ``i`` moves ``length[i]`` bytes from

    ``src_base[i] + src_ids[src_slot[i]] * src_stride[i]``  to  ``dst_base[i] + dst_ids[dst_slot[i]] * dst_stride[i]``

where ``src_ids`` / ``dst_ids`` are one write's id vectors (:class:`IndexedWrite`) and every id at position ``j``
must lie in ``[0, src_limit[j])`` (``dst_limit`` on the other side). The addresses any allowed ids can reach on a
row lie in ``[base, base + (limit - 1) * stride + length)``: :meth:`IndexedRows.extents`. A transport that checks
those extents against the registered memory once, and the ids against the limits on every write, refuses
exactly what a plain write of the same bytes would (nothing outside registered memory is ever written), while a
write's host work shrinks to a check of a few hundred ids: the device works the addresses out
(:func:`kvferry.kernels.span_copy.copy_indexed`).

Where a transport has no indexed path it writes :meth:`IndexedRows.expand`'s fragments as a plain write
(:meth:`~kvferry.transports.Transport.write_indexed`).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
from attrs import frozen

from kvferry.errors import RegionError
from kvferry.transports.base import Fragments, coalesce

__all__ = ["IndexedRows", "IndexedWrite"]

Int64Array = npt.NDArray[np.int64]


def _int64(value: Any) -> Int64Array:
    if (
        type(value) is np.ndarray
        and value.dtype == np.int64
        and value.ndim == 1
        and not value.flags.writeable
    ):
        return value  # read-only already (a mapping's ids): as it is
    # a read-only view: the caller's array keeps its own flags
    array = np.ascontiguousarray(value, dtype=np.int64).reshape(-1).view()
    array.flags.writeable = False
    return array


@frozen(eq=False)
class IndexedRows:
    """A template of rows whose addresses come from per-write ids (see the module docstring). Frozen and
    compared by identity: a transport keeps what it checked of one template for the writes that reuse it.

    :raises ValueError: columns of different lengths, a slot position outside its id vector, a negative base,
        stride or limit, or a row of no bytes.
    """

    src_slot: Int64Array = attrs.field(converter=_int64)
    src_base: Int64Array = attrs.field(converter=_int64)
    src_stride: Int64Array = attrs.field(converter=_int64)
    dst_slot: Int64Array = attrs.field(converter=_int64)
    dst_base: Int64Array = attrs.field(converter=_int64)
    dst_stride: Int64Array = attrs.field(converter=_int64)
    length: Int64Array = attrs.field(converter=_int64)
    #: per position of a write's source id vector: ids there lie in ``[0, limit)``
    src_limit: Int64Array = attrs.field(converter=_int64)
    dst_limit: Int64Array = attrs.field(converter=_int64)
    #: bytes of one write (the sum of ``length``)
    nbytes: int = attrs.field(init=False)
    #: :meth:`destination_runs`' template: per run, its first row's slot position, base and stride, and its bytes
    _dst_runs: tuple[Int64Array, Int64Array, Int64Array, Int64Array] | None = attrs.field(
        init=False, default=None, repr=False
    )

    def __attrs_post_init__(self) -> None:
        n = len(self.length)
        columns = (
            self.src_slot,
            self.src_base,
            self.src_stride,
            self.dst_slot,
            self.dst_base,
            self.dst_stride,
        )
        if any(len(c) != n for c in columns):
            raise ValueError(f"indexed rows: columns of lengths {[len(c) for c in columns]} for {n} rows")
        if n:
            if int(self.length.min()) <= 0:
                raise ValueError("indexed rows: a row of no bytes")
            if min(int(c.min()) for c in columns) < 0:
                raise ValueError("indexed rows: a negative slot position, base or stride")
            if int(self.src_slot.max()) >= len(self.src_limit) or int(self.dst_slot.max()) >= len(
                self.dst_limit
            ):
                raise ValueError("indexed rows: a slot position outside the id vector")
        if min(int(self.src_limit.min(initial=1)), int(self.dst_limit.min(initial=1))) <= 0:
            raise ValueError("indexed rows: a limit below 1")
        object.__setattr__(self, "nbytes", int(self.length.sum()))

    def __len__(self) -> int:
        return len(self.length)

    def extents(self) -> tuple[Fragments, Fragments]:
        """Per row and side, the ``(address, length)`` range every address the row may touch lies in, for any ids
        within the limits: check these against registered memory once per template.

        :raises RegionError: a range that wraps around the address space (no registered memory holds it).
        """
        out = []
        for slot, base, stride, limit in (
            (self.src_slot, self.src_base, self.src_stride, self.src_limit),
            (self.dst_slot, self.dst_base, self.dst_stride, self.dst_limit),
        ):
            rows = np.empty((len(self), 2), dtype=np.uint64)
            if len(self):
                steps = limit[slot] - 1
                # every value is below 2**63: the reach is exact in uint64 unless it could pass 2**64
                bound = int(base.max()) + int(steps.max()) * int(stride.max()) + int(self.length.max())
                if bound >= 1 << 64:
                    raise RegionError("indexed rows reach past the end of the address space")
                rows[:, 0] = base
                rows[:, 1] = steps.astype(np.uint64) * stride.astype(np.uint64) + self.length.astype(
                    np.uint64
                )
            out.append(rows)
        return out[0], out[1]

    def check_ids(self, src_ids: Int64Array, dst_ids: Int64Array) -> None:
        """:raises RegionError: an id vector of another length than the template's, or an id outside its
        limit (the bytes it would name may lie outside registered memory); nothing is written then."""
        for what, ids, limit in (
            ("source", src_ids, self.src_limit),
            ("destination", dst_ids, self.dst_limit),
        ):
            if ids.shape != limit.shape:
                raise RegionError(f"indexed write: {len(ids)} {what} ids for a template of {len(limit)}")
            # as unsigned, a negative id is larger than any limit: one comparison checks both bounds
            if len(ids) and not bool(np.less(ids.view(np.uint64), limit.view(np.uint64)).all()):
                bad = int(np.flatnonzero((ids < 0) | (ids >= limit))[0])
                raise RegionError(
                    f"indexed write: {what} id {int(ids[bad])} at position {bad} outside [0, {int(limit[bad])})"
                )

    def destinations(self, dst_ids: Int64Array) -> Fragments:
        """The destination rows (one per template row, not merged) that ``dst_ids`` name; the ids must have
        passed :meth:`check_ids`."""
        rows = np.empty((len(self), 2), dtype=np.uint64)
        rows[:, 0] = self.dst_base + dst_ids[self.dst_slot] * self.dst_stride
        rows[:, 1] = self.length
        return rows

    def destination_runs(self, dst_ids: Int64Array) -> Fragments:
        """The bytes :meth:`destinations` names, in fewer rows: rows merged where the template makes them
        contiguous on the destination whatever the ids (consecutive rows at the same id position, of the same
        stride, each starting where the one before ends there). What a writer checks against the peer's grants
        (a search per run, not per row); the ids must have passed :meth:`check_ids`."""
        runs = self._dst_runs
        if runs is None:
            slot, base, stride, length = self.dst_slot, self.dst_base, self.dst_stride, self.length
            joins = (
                (slot[1:] == slot[:-1]) & (stride[1:] == stride[:-1]) & (base[:-1] + length[:-1] == base[1:])
            )
            first = np.flatnonzero(np.concatenate(([True], ~joins))) if len(self) else np.zeros(0, np.intp)
            runs = (
                slot[first],
                base[first],
                stride[first],
                np.add.reduceat(length, first) if len(first) else first,
            )
            object.__setattr__(self, "_dst_runs", runs)
        slot, base, stride, length = runs
        rows = np.empty((len(slot), 2), dtype=np.uint64)
        rows[:, 0] = base + dst_ids[slot] * stride
        rows[:, 1] = length
        return rows

    def expand(self, src_ids: Int64Array, dst_ids: Int64Array) -> tuple[Fragments, Fragments]:
        """One write's rows as plain fragments (rows contiguous on both sides merged), for a transport without
        an indexed path.

        :raises RegionError: as :meth:`check_ids`."""
        self.check_ids(src_ids, dst_ids)
        src_f = np.empty((len(self), 2), dtype=np.uint64)
        dst_f = np.empty((len(self), 2), dtype=np.uint64)
        src_f[:, 0] = self.src_base + src_ids[self.src_slot] * self.src_stride
        dst_f[:, 0] = self.dst_base + dst_ids[self.dst_slot] * self.dst_stride
        src_f[:, 1] = dst_f[:, 1] = self.length
        return coalesce(src_f, dst_f)

    def __repr__(self) -> str:
        return (
            f"<IndexedRows {len(self)} rows, {self.nbytes} bytes, ids {len(self.src_limit)} -> "
            f"{len(self.dst_limit)}>"
        )


@frozen(eq=False)
class IndexedWrite:
    """One write of a template: its id vectors (int64, one id per position of the template's limits) and the
    notification delivered once its bytes landed."""

    rows: IndexedRows
    src_ids: Int64Array = attrs.field(converter=_int64)
    dst_ids: Int64Array = attrs.field(converter=_int64)
    notify: bytes | None = None

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes

    def expand(self) -> tuple[Fragments, Fragments]:
        """:meth:`IndexedRows.expand` of this write's ids."""
        return self.rows.expand(self.src_ids, self.dst_ids)

    def check(self) -> None:
        """:meth:`IndexedRows.check_ids` of this write's ids."""
        self.rows.check_ids(self.src_ids, self.dst_ids)

    def __repr__(self) -> str:
        return f"<IndexedWrite {self.rows!r}{' +notify' if self.notify is not None else ''}>"
