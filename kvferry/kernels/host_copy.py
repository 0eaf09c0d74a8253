"""Copies between rows of an arena (host or CUDA memory) and one host buffer, batched: what offload to the host
and restore from it move.

A :class:`RowSection` names rows of one arena's block view (``[count, row_bytes]``, rows ``stride`` bytes apart)
by id and the ``[len(ids), row_bytes]`` host tensor they are packed into, in id order. :func:`to_host` packs
every section, :func:`from_host` unpacks them. Few large copies, never one per row where it can be avoided:

- ids that form few long ascending runs (on average at least :data:`RUN_BYTES` each; a state slot, a request
  whose pages were handed out in order) are copied run by run, one slice copy each;
- other ids are copied by index, in chunks: on the host one ``numpy.take`` (offload) or indexed assignment
  (restore) per chunk of at most :data:`HOST_CHUNK_BYTES`; on CUDA one ``index_select`` (``index_copy_``) per
  chunk of at most :data:`DEVICE_CHUNK_BYTES` through a device staging buffer, and one copy between it and the
  host buffer.

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

__all__ = ["DEVICE_CHUNK_BYTES", "HOST_CHUNK_BYTES", "RUN_BYTES", "RowSection", "from_host", "to_host"]

#: Rows copied by index are copied in chunks of about this many bytes on the host: each chunk is one C call
#: with the GIL released, and ``stop`` is asked between them.
HOST_CHUNK_BYTES = 8 << 20
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


def _runs(ids: Int64Array) -> tuple[Int64Array, Int64Array]:
    """Starts (indices into ``ids``) and lengths of the maximal runs ``a, a+1, ...`` of ``ids``."""
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    lengths = np.diff(np.concatenate((starts, [ids.size]))).astype(np.int64)
    return starts, lengths


def _by_runs(section: RowSection) -> tuple[Int64Array, Int64Array] | None:
    """The runs of the section when it is copied run by run, else None (copied by index)."""
    rows, ids = section.rows, section.ids
    row_bytes = int(rows.shape[1])
    if ids.size > 1 and int(rows.stride(0)) != row_bytes:
        return None  # rows are padded apart: a run is no one slice
    starts, lengths = _runs(ids)
    if ids.size * row_bytes < RUN_BYTES * starts.size:
        return None
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
    for section in sections:
        if not section.ids.size:
            continue
        if section.rows.device.type == "cpu":
            done = _host_section(section, stop, restore=restore)
        else:
            done = _device_section(section, stop, restore=restore)
        if not done:
            return False
    return True


def _host_section(section: RowSection, stop: Callable[[], bool] | None, *, restore: bool) -> bool:
    rows, host, ids = section.rows.numpy(), section.host.numpy(), section.ids
    row_bytes = rows.shape[1]
    step = _row_chunk(row_bytes, HOST_CHUNK_BYTES)
    runs = _by_runs(section)
    if runs is not None:
        for first, length in zip(*(r.tolist() for r in runs), strict=True):
            a = int(ids[first])
            for lo in range(0, length, step):
                if stop is not None and stop():
                    return False
                n = min(step, length - lo)
                arena_part, host_part = rows[a + lo : a + lo + n], host[first + lo : first + lo + n]
                if restore:
                    np.copyto(arena_part, host_part)
                else:
                    np.copyto(host_part, arena_part)
        return True
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


def _device_section(section: RowSection, stop: Callable[[], bool] | None, *, restore: bool) -> bool:
    import torch

    rows, host, ids = section.rows, section.host, section.ids
    runs = _by_runs(section)
    if runs is not None:
        for first, length in zip(*(r.tolist() for r in runs), strict=True):
            if stop is not None and stop():
                return False
            a = int(ids[first])
            arena_part, host_part = rows[a : a + length], host[first : first + length]
            if restore:
                arena_part.copy_(host_part, non_blocking=True)
            else:
                host_part.copy_(arena_part, non_blocking=True)
        return True
    row_bytes = int(rows.shape[1])
    step = _row_chunk(row_bytes, DEVICE_CHUNK_BYTES)
    staging = torch.empty((min(step, ids.size), row_bytes), dtype=torch.uint8, device=rows.device)
    index = torch.from_numpy(ids).to(rows.device, non_blocking=True)
    # one staging buffer for every chunk: the stream runs each chunk's two copies before the next chunk's
    for lo in range(0, ids.size, step):
        if stop is not None and stop():
            return False
        n = min(step, ids.size - lo)
        stage, part = staging[:n], index[lo : lo + n]
        if restore:
            stage.copy_(host[lo : lo + n], non_blocking=True)
            rows.index_copy_(0, part, stage)
        else:
            torch.index_select(rows, 0, part, out=stage)
            host[lo : lo + n].copy_(stage, non_blocking=True)
    return True
