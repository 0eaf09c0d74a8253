"""Host memory of another process on this host, written with batched ``process_vm_writev`` (cross-memory attach).

UCX's CMA transport (what NIXL uses between processes of one host) makes one ``process_vm_writev`` call per
descriptor: about 3 us each here, so a write of thousands of 16-32 KiB fragments (a mismatched-TP KV mapping)
spends more time in system calls than in copying. Here one call carries up to ``IOV_MAX`` (1024) fragments.

The kernel copies whole iovec elements or stops at the first one it cannot write, so a short count means the
peer's memory is gone (it unmapped it or exited): an :class:`OSError`. Callers check every destination range
against what the peer registered before calling (the kernel only checks that the pages are mapped).

The calls block (the kernel copies): run :func:`write` in a worker thread. ctypes releases the GIL for the call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import sys
from typing import Any

import numpy as np

from kvferry.transports.base import Fragments

__all__ = ["IOV_MAX", "available", "write"]

#: iovec elements per system call (Linux's UIO_MAXIOV)
IOV_MAX = 1024


@functools.cache
def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        function = libc.process_vm_writev
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
    """True on Linux with a libc that has ``process_vm_writev``."""
    return _libc() is not None


def write(pid: int, src: Fragments, dst: Fragments) -> None:
    """Copy every ``src`` row of this process to the ``dst`` row of process ``pid`` (rows pair one to one).

    :raises OSError: the kernel refused (``EPERM``: not allowed to attach; ``ESRCH``: no such process) or wrote
        short (``EFAULT``: a range is not mapped in one of the processes). Rows before the failing call are written.
    """
    function = _libc()
    if function is None:
        raise OSError(errno.ENOSYS, "process_vm_writev is not available")
    # (address, length) rows are struct iovec on 64-bit Linux
    local = np.ascontiguousarray(src, dtype=np.uint64)
    remote = np.ascontiguousarray(dst, dtype=np.uint64)
    for first in range(0, len(local), IOV_MAX):
        rows = slice(first, first + IOV_MAX)
        count = len(local[rows])
        expected = int(local[rows, 1].sum())
        got = function(pid, local[rows].ctypes.data, count, remote[rows].ctypes.data, count, 0)
        if got < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"process_vm_writev to pid {pid}: {os.strerror(code)}")
        if got != expected:
            raise OSError(errno.EFAULT, f"process_vm_writev to pid {pid} wrote {got} of {expected} bytes")
