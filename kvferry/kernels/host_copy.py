"""Copies between rows of an arena (host or CUDA memory) and one host buffer, batched: what offload to the host
and restore from it move.

A :class:`RowSection` names rows of one arena's block view (``[count, row_bytes]``, rows ``stride`` bytes apart)
by id and the ``[len(ids), row_bytes]`` host tensor they are packed into, in id order. :func:`to_host` packs
every section, :func:`from_host` unpacks them. Few large copies, never one per row where it can be avoided:

- one row, or ids that form one run of consecutive rows, or few long ascending runs (on average at least
  :data:`RUN_BYTES` each; a request whose pages were handed out in order) are copied run by run, one slice copy
  each (on the host in chunks of :data:`HOST_RUN_CHUNK_BYTES`);
- other ids are copied by index, in chunks: on the host one ``numpy.take`` (offload) or indexed assignment
  (restore) per chunk of at most :data:`HOST_CHUNK_BYTES`; on CUDA one ``index_select`` (``index_copy_``) per
  chunk of at most :data:`DEVICE_CHUNK_BYTES` through a device staging buffer, and one copy between it and the
  host buffer;
- on CUDA, when every section's host tensor lies in one host allocation within :data:`DEVICE_CHUNK_BYTES` (a
  request's host buffer, up to that size), all of them go through one device staging buffer laid out as that
  span: the rows are gathered (scattered) on the device and the host sees a single copy, where the per-section
  copies cost one transfer's fixed cost each. Every index is uploaded once, from pinned memory.

On CUDA everything is queued on the *current* stream and the functions return at once: the caller chooses the
stream, orders it after the work that wrote (or last read) the rows, and waits for it (an event) before the
bytes are used or the memory is given back. The host buffer should be pinned (else each copy to or from it
blocks). On the host the copies run in the calling thread, with the GIL released inside each chunk.

``stop`` is asked between chunks: when it returns True the copy ends early and the functions return False
(on CUDA, what is queued already still runs). Nothing here validates ids: callers own them (they come from
the pools' bookkeeping).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
from attrs import frozen

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEVICE_CHUNK_BYTES",
    "HOST_CHUNK_BYTES",
    "HOST_RUN_CHUNK_BYTES",
    "RUN_BYTES",
    "RowSection",
    "from_host",
    "to_host",
]

#: Rows copied by index are copied in chunks of about this many bytes on the host: each chunk is one C call
#: with the GIL released, and ``stop`` is asked between them.
HOST_CHUNK_BYTES = 8 << 20
#: One contiguous run is copied on the host in chunks of this many bytes: large enough that each chunk's memcpy
#: still uses non-temporal stores (about twice the speed of a cached copy for large runs), small enough that
#: ``stop`` is asked every few tens of milliseconds.
HOST_RUN_CHUNK_BYTES = 64 << 20
#: The device staging buffer of an indexed copy on CUDA holds this many bytes at most (or one row, if larger).
DEVICE_CHUNK_BYTES = 64 << 20
#: Runs of consecutive ids at least this long on average are copied run by run (one slice copy each).
RUN_BYTES = 1 << 20

Int64Array = npt.NDArray[np.int64]


@frozen(eq=False)
class RowSection:
    """Rows ``ids`` of the block view ``rows`` and the host tensor ``host`` they are packed into, in order."""

    #: ``[count, row_bytes]`` uint8 view of an arena (host or CUDA), rows any stride apart
    rows: torch.Tensor
    #: the rows, int64, each in ``[0, count)``
    ids: Int64Array
    #: ``[len(ids), row_bytes]`` contiguous uint8 host memory
    host: torch.Tensor

    @property
    def nbytes(self) -> int:
        return int(self.host.numel())


def _one_run(section: RowSection) -> int | None:
    """The first row when the section's rows are one contiguous run of memory (one row, or consecutive ids of
    rows with no padding between them), else None."""
    rows, ids = section.rows, section.ids
    first = int(ids[0])
    if ids.size == 1:
        return first
    if int(rows.stride(0)) != int(rows.shape[1]) or int(ids[-1]) - first != ids.size - 1:
        return None
    return first if bool(np.all(np.diff(ids) == 1)) else None


def _long_runs(section: RowSection) -> tuple[Int64Array, Int64Array] | None:
    """Starts (indices into ids) and lengths of the runs of consecutive ids, when they are long enough to be
    copied run by run (at least :data:`RUN_BYTES` on average, rows not padded apart), else None."""
    rows, ids = section.rows, section.ids
    row_bytes = int(rows.shape[1])
    if int(rows.stride(0)) != row_bytes:
        return None
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    if ids.size * row_bytes < RUN_BYTES * (breaks.size + 1):
        return None
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    lengths = np.diff(np.concatenate((starts, [ids.size]))).astype(np.int64)
    return starts, lengths


def _row_chunk(row_bytes: int, limit: int) -> int:
    return max(1, limit // max(row_bytes, 1))


def to_host(sections: Sequence[RowSection], *, stop: Callable[[], bool] | None = None) -> bool:
    """Pack every section's rows into its host tensor. False if ``stop`` ended it early (the host tensors hold
    some of the bytes only)."""
    return _copy(sections, stop, restore=False)


def from_host(sections: Sequence[RowSection], *, stop: Callable[[], bool] | None = None) -> bool:
    """Unpack every section's host tensor into its rows. False if ``stop`` ended it early (some rows are
    written, others not)."""
    return _copy(sections, stop, restore=True)


def _copy(sections: Sequence[RowSection], stop: Callable[[], bool] | None, *, restore: bool) -> bool:
    live = [section for section in sections if section.ids.size]
    if not live:
        return True
    if live[0].rows.device.type != "cpu":
        return _device_copy(live, stop, restore=restore)
    return all(_host_section(section, stop, restore=restore) for section in live)  # stops at the first False


def _host_section(section: RowSection, stop: Callable[[], bool] | None, *, restore: bool) -> bool:
    rows, host, ids = section.rows.numpy(), section.host.numpy(), section.ids
    first = _one_run(section)
    if first is not None:
        return _host_run(rows, first, host, 0, ids.size, stop, restore=restore)
    runs = _long_runs(section)
    if runs is not None:
        for start, length in zip(*(r.tolist() for r in runs), strict=True):
            if not _host_run(rows, int(ids[start]), host, start, length, stop, restore=restore):
                return False
        return True
    step = _row_chunk(rows.shape[1], HOST_CHUNK_BYTES)
    for lo in range(0, ids.size, step):
        if stop is not None and stop():
            return False
        chunk = ids[lo : lo + step]
        if restore:
            rows[chunk] = host[lo : lo + chunk.size]
        else:
            # mode="clip": no bounds check, and no buffered copy of out (ids are the pools' own)
            np.take(rows, chunk, axis=0, out=host[lo : lo + chunk.size], mode="clip")
    return True


def _host_run(
    rows: np.ndarray,
    first: int,
    host: np.ndarray,
    at: int,
    count: int,
    stop: Callable[[], bool] | None,
    *,
    restore: bool,
) -> bool:
    """Rows ``first ..`` (one contiguous run of memory) <-> host rows ``at ..``, in chunks of bytes."""
    arena_bytes = rows[first : first + count].reshape(-1)
    host_bytes = host[at : at + count].reshape(-1)
    for lo in range(0, arena_bytes.size, HOST_RUN_CHUNK_BYTES):
        if stop is not None and stop():
            return False
        hi = lo + HOST_RUN_CHUNK_BYTES
        if restore:
            np.copyto(arena_bytes[lo:hi], host_bytes[lo:hi])
        else:
            np.copyto(host_bytes[lo:hi], arena_bytes[lo:hi])
    return True


def _runs(section: RowSection) -> tuple[Int64Array, Int64Array] | None:
    """The section's runs when it is copied run by run, else None (by index)."""
    if _one_run(section) is not None:
        return np.zeros(1, dtype=np.int64), np.array([section.ids.size], dtype=np.int64)
    return _long_runs(section)


def _host_span(sections: Sequence[RowSection]) -> tuple[torch.Tensor, list[int]] | None:
    """When every section's host tensor lies in one host allocation, within :data:`DEVICE_CHUNK_BYTES`: the span
    that covers them all (one tensor) and each section's offset in it; else None."""
    storage = sections[0].host.untyped_storage()
    base = storage.data_ptr()
    starts = [s.host.data_ptr() for s in sections]
    if any(s.host.untyped_storage().data_ptr() != base for s in sections[1:]):
        return None
    low = min(starts)
    high = max(start + s.nbytes for start, s in zip(starts, sections, strict=True))
    if high - low > DEVICE_CHUNK_BYTES:
        return None
    span = sections[0].host.new_empty(0).set_(storage, low - base, (high - low,), (1,))
    return span, [start - low for start in starts]


def _device_copy(sections: Sequence[RowSection], stop: Callable[[], bool] | None, *, restore: bool) -> bool:
    """Queue every section's copies on the current stream (the rows of every section on one CUDA device)."""
    import torch

    plans = [(section, _runs(section)) for section in sections]
    indexed = [section for section, runs in plans if runs is None]
    device = sections[0].rows.device
    index = staging = None
    if indexed:
        ids = np.concatenate([s.ids for s in indexed]) if len(indexed) > 1 else indexed[0].ids
        # every index in one upload, from pinned memory: an upload from pageable memory would first wait for
        # everything queued on the stream, the previous section's copies included
        index = torch.from_numpy(ids).pin_memory().to(device, non_blocking=True)
    packed = _host_span(sections)
    if packed is not None:
        return _packed_copy(plans, index, *packed, stop, restore=restore)
    if indexed:
        # one staging buffer for every chunk: the stream runs each chunk's two copies before the next chunk's
        staging_bytes = max(
            min(_row_chunk(int(s.rows.shape[1]), DEVICE_CHUNK_BYTES), s.ids.size) * int(s.rows.shape[1])
            for s in indexed
        )
        staging = torch.empty(staging_bytes, dtype=torch.uint8, device=device)
    at = 0
    for section, runs in plans:
        rows, host, ids = section.rows, section.host, section.ids
        if runs is not None:
            for start, length in zip(*(r.tolist() for r in runs), strict=True):
                if stop is not None and stop():
                    return False
                a = int(ids[start])
                arena_part, host_part = rows[a : a + length], host[start : start + length]
                if restore:
                    arena_part.copy_(host_part, non_blocking=True)
                else:
                    host_part.copy_(arena_part, non_blocking=True)
            continue
        assert index is not None and staging is not None
        row_bytes = int(rows.shape[1])
        step = _row_chunk(row_bytes, DEVICE_CHUNK_BYTES)
        for lo in range(0, ids.size, step):
            if stop is not None and stop():
                return False
            n = min(step, ids.size - lo)
            stage, part = staging[: n * row_bytes].view(n, row_bytes), index[at + lo : at + lo + n]
            if restore:
                stage.copy_(host[lo : lo + n], non_blocking=True)
                rows.index_copy_(0, part, stage)
            else:
                torch.index_select(rows, 0, part, out=stage)
                host[lo : lo + n].copy_(stage, non_blocking=True)
        at += ids.size
    return True


def _packed_copy(
    plans: Sequence[tuple[RowSection, tuple[Int64Array, Int64Array] | None]],
    index: torch.Tensor | None,
    span: torch.Tensor,
    offsets: Sequence[int],
    stop: Callable[[], bool] | None,
    *,
    restore: bool,
) -> bool:
    """Every section through one device staging buffer laid out as the host span: the rows gathered (scattered)
    on the device, and one copy between the staging buffer and the host (few DMA transfers cost less than one
    per section)."""
    import torch

    staging = torch.empty(span.numel(), dtype=torch.uint8, device=plans[0][0].rows.device)
    if restore:
        staging.copy_(span, non_blocking=True)
    at = 0
    for (section, runs), offset in zip(plans, offsets, strict=True):
        if stop is not None and stop():
            return False
        rows, ids = section.rows, section.ids
        stage = staging[offset : offset + section.nbytes].view(ids.size, int(rows.shape[1]))
        if runs is None:
            assert index is not None
            part = index[at : at + ids.size]
            at += ids.size
            if restore:
                rows.index_copy_(0, part, stage)
            else:
                torch.index_select(rows, 0, part, out=stage)
            continue
        for start, length in zip(*(r.tolist() for r in runs), strict=True):
            a = int(ids[start])
            if restore:
                rows[a : a + length].copy_(stage[start : start + length])
            else:
                stage[start : start + length].copy_(rows[a : a + length])
    if not restore:
        span.copy_(staging, non_blocking=True)
    return True
