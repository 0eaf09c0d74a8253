"""Host memory of another process on this host, written or read with batched ``process_vm_writev`` /
``process_vm_readv`` calls (cross-memory attach).

UCX's CMA transport (what NIXL uses between processes of one host) makes one ``process_vm_writev`` call per
descriptor, so a write of thousands of small fragments (a mismatched-TP KV mapping) spends more time in system
calls than in copying. Here one call carries up to ``IOV_MAX`` (1024) fragments. And a failed call is an
:class:`OSError` here, where UCX 1.21 without endpoint error handling aborts the process.

The kernel copies whole iovec elements or stops at the first one it cannot copy, so a short count means the
peer's memory is gone (it unmapped it or exited): an :class:`OSError`. Callers check every range of their own
side against what they registered, and the other side's against what the peer registered or announced (the
kernel only checks that the pages are mapped).

The calls block (the kernel copies): run :func:`write` and :func:`read` in a worker thread, or let
:func:`copy_slices` cut a long copy into slices for several worker threads at once (the kernel's copy within one
call is bound by one core, so more threads move more bytes). ctypes releases the GIL for the call. A short copy
(:data:`INLINE_BYTES`) is made on the caller's thread: handing it to a worker thread and back costs more than
the copy (100-300 us on a loaded ``cpu-2core``, against about 50 us for 256 KiB).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import itertools
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt

from kvferry.transports.base import Fragments

__all__ = [
    "INLINE_BYTES",
    "IOV_MAX",
    "MIN_PARALLEL_SLICE",
    "SLICE_BYTES",
    "available",
    "copy_slices",
    "copy_threads",
    "inline",
    "read",
    "slices",
    "split_rows",
    "write",
]

#: iovec elements per system call (Linux's UIO_MAXIOV)
IOV_MAX = 1024
#: bytes per worker-thread call of a long copy at most (a cancel or a stall is seen between slices)
SLICE_BYTES = 64 << 20
#: a copy is cut into slices of at least this many bytes for parallel worker threads
MIN_PARALLEL_SLICE = 8 << 20
#: a copy of at most this many bytes (and at most :data:`IOV_MAX` rows: one system call) runs on the caller's
#: thread, blocking it for about as long as a hand-off to a worker thread would take
INLINE_BYTES = 256 << 10


@functools.cache
def _libc(name: str = "process_vm_writev") -> Any:
    """libc's ``process_vm_writev`` or ``process_vm_readv`` (one signature), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        function = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    function.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    function.restype = ctypes.c_ssize_t
    return function


def available() -> bool:
    """True on Linux with a libc that has ``process_vm_writev`` and ``process_vm_readv``."""
    return _libc("process_vm_writev") is not None and _libc("process_vm_readv") is not None


def write(pid: int, src: Fragments, dst: Fragments) -> None:
    """Copy every ``src`` row of this process to the ``dst`` row of process ``pid`` (rows pair one to one).

    :raises OSError: the kernel refused (``EPERM``: not allowed to attach; ``ESRCH``: no such process) or wrote
        short (``EFAULT``: a range is not mapped in one of the processes). Rows before the failing call are written.
    """
    _copy("process_vm_writev", pid, src, dst)


def read(pid: int, src: Fragments, dst: Fragments) -> None:
    """Copy every ``src`` row of process ``pid`` to the ``dst`` row of this process (rows pair one to one).

    :raises OSError: as :func:`write` (``ESRCH`` once the other process has exited). Rows before the failing call
        are copied; the failing call may have copied some of its rows.
    """
    _copy("process_vm_readv", pid, dst, src)


def slices(lengths: npt.NDArray[np.uint64], slice_bytes: int) -> list[tuple[int, int]]:
    """Rows ``[lo, hi)`` cut into runs of about ``slice_bytes`` (a run ends on the row that crosses a multiple of
    it), so that a long copy can be done in several worker-thread calls with a cancel seen between them."""
    if not len(lengths):
        return []
    ends = np.cumsum(lengths, dtype=np.uint64)
    cuts = np.searchsorted(ends, np.arange(1, 1 + int(ends[-1]) // slice_bytes) * slice_bytes)
    bounds = [0, *sorted({int(c) + 1 for c in cuts if int(c) + 1 < len(lengths)}), len(lengths)]
    return list(itertools.pairwise(bounds))


def _copy(name: str, pid: int, local: Fragments, remote: Fragments) -> None:
    function = _libc(name)
    if function is None:
        raise OSError(errno.ENOSYS, f"{name} is not available")
    # (address, length) rows are struct iovec on 64-bit Linux
    here = np.ascontiguousarray(local, dtype=np.uint64)
    there = np.ascontiguousarray(remote, dtype=np.uint64)
    for first in range(0, len(here), IOV_MAX):
        rows = slice(first, first + IOV_MAX)
        count = len(here[rows])
        expected = int(here[rows, 1].sum())
        got = function(pid, here[rows].ctypes.data, count, there[rows].ctypes.data, count, 0)
        if got < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"{name} with pid {pid}: {os.strerror(code)}")
        if got != expected:
            raise OSError(errno.EFAULT, f"{name} with pid {pid} copied {got} of {expected} bytes")


async def copy_slices(
    copy: Callable[[int, Fragments, Fragments], None],
    pid: int,
    src: Fragments,
    dst: Fragments,
    *,
    after_slice: Callable[[], Awaitable[None]],
    slice_bytes: int | None = None,
    threads: int | None = None,
) -> None:
    """``copy(pid, src[lo:hi], dst[lo:hi])`` (:func:`read` or :func:`write`) over every row, in slices of at most
    ``slice_bytes`` (default :data:`SLICE_BYTES`; at least :data:`MIN_PARALLEL_SLICE` when cut for threads), up to
    ``threads`` (default :func:`copy_threads`) of them at once in worker threads; ``after_slice()`` after each.
    A copy of at most :data:`INLINE_BYTES` in at most :data:`IOV_MAX` rows is one call on this thread instead.

    :raises OSError: the first a slice raised, once every slice already running has ended (none starts after it).
    A cancel, likewise, takes effect once the running slices have ended: their rows are written, others maybe not.
    """
    slice_bytes = SLICE_BYTES if slice_bytes is None else slice_bytes
    threads = copy_threads() if threads is None else threads
    total = int(src[:, 1].sum()) if len(src) else 0
    if inline(src, total):
        copy(pid, src, dst)  # one short system call: cheaper here than a hand-off to a worker thread
        await after_slice()
        return
    per_thread = -(-total // max(1, threads))
    cut = max(1, min(slice_bytes, max(MIN_PARALLEL_SLICE, per_thread)))
    src, dst = split_rows(src, dst, cut)
    runs = slices(src[:, 1], cut)
    if len(runs) == 1:  # one slice: no task group on the way of a short write
        await anyio.to_thread.run_sync(copy, pid, src, dst)
        await after_slice()
        return
    pending = iter(runs)
    failed: list[OSError] = []

    async def worker() -> None:
        for lo, hi in pending:  # shared: every slice is taken by one worker
            if failed:
                return
            try:
                await anyio.to_thread.run_sync(copy, pid, src[lo:hi], dst[lo:hi])
            except OSError as exc:
                failed.append(exc)
                return
            await after_slice()

    async with anyio.create_task_group() as tg:
        for _ in range(min(threads, len(runs))):
            tg.start_soon(worker)
    if failed:
        raise failed[0]


def inline(src: Fragments, total: int | None = None) -> bool:
    """Whether :func:`copy_slices` copies ``src`` (``total``: its bytes, when known) in one call on the caller's
    thread: at most :data:`INLINE_BYTES` in at most :data:`IOV_MAX` rows."""
    if len(src) > IOV_MAX:
        return False
    return (int(src[:, 1].sum()) if total is None else total) <= INLINE_BYTES


def split_rows(src: Fragments, dst: Fragments, longest: int) -> tuple[Fragments, Fragments]:
    """``src`` and ``dst`` (pairing row for row) with every row longer than ``longest`` cut into rows of at most
    ``longest`` bytes, in order: the same bytes to the same places, in pieces a slice can hold."""
    lengths = src[:, 1]
    if not len(src) or int(lengths.max()) <= longest:
        return src, dst
    pieces = (lengths + np.uint64(longest - 1)) // np.uint64(longest)
    row = np.repeat(np.arange(len(src)), pieces.astype(np.int64))
    first = np.concatenate(([0], np.cumsum(pieces)[:-1])).astype(np.int64)
    offset = (np.arange(len(row)) - first[row]).astype(np.uint64) * np.uint64(longest)
    length = np.minimum(lengths[row] - offset, np.uint64(longest))
    return (
        np.stack([src[row, 0] + offset, length], axis=1),
        np.stack([dst[row, 0] + offset, length], axis=1),
    )


@functools.cache
def copy_threads() -> int:
    """Worker threads a long copy may use at once: half the cores this process may run on (when first asked),
    2 to 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(2, min(8, cores // 2))
