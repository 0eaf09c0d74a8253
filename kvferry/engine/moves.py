"""Running two-phase cache moves (offload to the host, restore to the device) off the event loop.

:func:`run_moves` takes the moves a cache started on each of its ranks (``start_offload`` / ``start_restore`` of
:class:`~kvferry.engine.runner.LockstepCache`, or of the managers), runs each rank's copy in a worker thread, and
finishes them together; :mod:`.host_moves` builds its request-level calls on it, and the engine its ``offload``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import anyio

from kvferry.errors import ConfigError
from kvferry.pools.manager import PendingMove

__all__ = ["MovingCache", "move_cache", "run_moves"]


class MovingCache(Protocol):
    """What ends the moves a cache started (:meth:`LockstepCache.finish
    <kvferry.engine.runner.LockstepCache.finish>`)."""

    def finish(self, moves: Sequence[PendingMove], *, commit: bool = True) -> bool: ...


async def run_moves(cache: MovingCache, moves: Sequence[PendingMove]) -> bool:
    """Run every rank's copy in a worker thread, then finish them all: True when they committed.

    Cancelled (or a copy failed): the copies are asked to stop and waited for, shielded, and every rank rolls
    back (the request is where it was); then the cancel (or the copy's error) propagates.
    """
    try:
        async with anyio.create_task_group() as tg:
            for move in moves:
                if not move.done:
                    tg.start_soon(_copy, move)
    except BaseException:
        for move in moves:
            move.abort()
        with anyio.CancelScope(shield=True):
            # the threads go on after a cancel: nothing is freed before every copy ended
            for move in moves:
                await anyio.to_thread.run_sync(move.wait)
            cache.finish(moves, commit=False)
        raise
    return cache.finish(moves)


async def move_cache(cache: Any, request_id: int, *, to_host: bool) -> bool:
    """Move a suspended request's cache to the host (or back) with the cache's two-phase moves (a cache without
    them offloads synchronously, and restores on the request's next resume); whether it moved.

    :raises ~kvferry.errors.ConfigError: the cache cannot move caches to the host.
    :raises ~kvferry.errors.PoolExhausted: a restore finds no free room (nothing changed).
    """
    start = getattr(cache, "start_offload" if to_host else "start_restore", None)
    if start is None:
        if not to_host:
            return False
        offload = getattr(cache, "offload", None)
        if offload is None:
            raise ConfigError("this engine's cache cannot move caches to the host")
        offload(request_id)
        return True
    return await run_moves(cache, start(request_id))


async def _copy(move: PendingMove) -> None:
    # abandoned on cancel: the caller waits for the copy's end itself, shielded, after asking it to stop
    await anyio.to_thread.run_sync(move.run, abandon_on_cancel=True)
