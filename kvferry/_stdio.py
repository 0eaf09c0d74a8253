"""Where output goes: a command's result alone on stdout, every library's and child process's log on stderr.

NIXL's Python logger writes INFO lines to ``sys.stdout`` (its own handler, installed when nixl is imported),
and UCX's C code prints its warnings to file descriptor 1. Neither can be steered per call, so kvferry steers
them per process:

- :func:`quiet_library_env` sets (unless already set) ``NIXL_LOG_LEVEL=WARN``, ``UCX_LOG_FILE=stderr`` and
  ``UCX_WARN_UNUSED_ENV_VARS=n``; child processes inherit them;
- :func:`stdout_to_stderr` points file descriptor 1 at stderr for the length of a block (a command's run), so
  whatever a library writes there lands on stderr; the command prints its result after the block;
- :func:`reserve_stdout` does the same for the rest of a helper process's life and returns a stream on the
  original stdout for the process's own protocol lines.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TextIO

__all__ = ["QUIET_ENV", "quiet_library_env", "reserve_stdout", "stdout_to_stderr"]

#: what the libraries read at load time (setdefault: a user's own setting wins)
QUIET_ENV: dict[str, str] = {
    "NIXL_LOG_LEVEL": "WARN",
    "UCX_LOG_FILE": "stderr",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}


def quiet_library_env() -> None:
    """Set :data:`QUIET_ENV` in ``os.environ`` where unset (before nixl or ucxx is loaded; inherited by children)."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    import logging

    # if nixl is already loaded, its handler already exists: quiet it here too
    if os.environ.get("NIXL_LOG_LEVEL", "").upper() in ("WARN", "WARNING", "ERROR", "FATAL"):
        logger = logging.getLogger("nixl")
        if logger.level < logging.WARNING:
            logger.setLevel(logging.WARNING)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """File descriptor 1 writes to stderr inside the block (libraries, C code, child processes started
    inside it with an inherited stdout); restored after it. A no-op where fd 1 or 2 is not open."""
    _flush()
    try:
        saved = os.dup(1)
    except OSError:
        yield
        return
    try:
        os.dup2(2, 1)
    except OSError:
        os.close(saved)
        yield
        return
    try:
        yield
    finally:
        _flush()
        os.dup2(saved, 1)
        os.close(saved)


def reserve_stdout() -> TextIO:
    """For a helper process whose stdout is its protocol: from now on fd 1 (so ``sys.stdout`` and C code)
    writes to stderr; the stream returned writes to the original stdout, line-buffered."""
    quiet_library_env()
    _flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    return os.fdopen(saved, "w", buffering=1)
