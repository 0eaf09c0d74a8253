"""Host copies of fragments near a memcpy: glibc's non-temporal store threshold, set for the process.

glibc's ``memcpy`` on x86 switches to non-temporal stores (no read of the destination into the cache first)
only for copies above ``glibc.cpu.x86_non_temporal_threshold``, by default about three quarters of the
last-level cache's share per thread: tens of MiB. Below it a large copy runs at about 0.65 of the rate above it
(``cpu-2core``: 1 MiB pieces 5.9 GB/s, one 64 MiB copy 9.2 GB/s), so a write of 1 MiB fragments copied row by
row (the local transport, a peer in this process, staging packs and unpacks on the host) could not come near one
memcpy of the same bytes. With the threshold at :data:`THRESHOLD` every row of 512 KiB or more is copied with
non-temporal stores, as the one large copy is (1 MiB pieces: 10 GB/s). The cost: such rows are not left in the
cache, which a KV transfer's destination, read next by a device or another process, does not miss.

glibc reads the setting only when a process starts, so the ``kvferry`` command sets ``GLIBC_TUNABLES`` and runs
itself again once (:func:`reexec_tuned`); its child processes inherit the setting. A ``GLIBC_TUNABLES`` already
set, or ``KVFERRY_GLIBC_TUNED`` set to anything, is left alone (the latter keeps glibc's default).
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping

__all__ = ["MARK", "THRESHOLD", "TUNABLE", "reexec_tuned", "tuned_env"]

TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
#: copies of at least this many bytes use non-temporal stores
THRESHOLD = 512 << 10
#: set in the environment once the process runs tuned (or to keep glibc's default)
MARK = "KVFERRY_GLIBC_TUNED"


def tuned_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """``env`` with ``GLIBC_TUNABLES`` naming :data:`THRESHOLD` and :data:`MARK` set, or None where nothing is to
    change: not Linux on x86-64 with glibc, ``GLIBC_TUNABLES`` set already, or :data:`MARK` set."""
    if MARK in env or "GLIBC_TUNABLES" in env:
        return None
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return None
    if platform.libc_ver()[0] != "glibc":
        return None
    return {**env, "GLIBC_TUNABLES": f"{TUNABLE}={THRESHOLD:#x}", MARK: "1"}


def reexec_tuned() -> None:
    """Run this process's command again with :func:`tuned_env` (never returns then); returns at once where
    nothing is to change, or where the command line cannot be run again (``sys.orig_argv`` unknown)."""
    env = tuned_env(os.environ)
    argv = getattr(sys, "orig_argv", None)
    if env is None or not argv or not sys.executable:
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        os.execve(sys.executable, [sys.executable, *argv[1:]], env)
    except OSError:
        os.environ[MARK] = "0"  # cannot run again: go on untuned, and let children not try either
