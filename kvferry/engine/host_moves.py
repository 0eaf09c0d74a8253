"""Offload of a suspended request's cache to the host and its restore, off the event loop, on every TP rank: the
async edge of the cache managers' two-phase moves.

:func:`offload_request` and :func:`restore_request` start the move on every rank (bookkeeping on the loop's
thread: all or nothing, a refusal raises before anything changed), run each rank's copy in a worker thread of
its own (on CUDA the copy is queued on the manager's side stream and the thread sleeps on its event), and finish
every rank together once every copy ended. The loop's thread only pays the bookkeeping at either end (about a
millisecond for a gigabyte of 512 KiB pages); the bytes move while it serves.

What the caller (the engine, between steps) must keep:

- Move only SUSPENDED requests that no step and no transfer uses (a transfer's request is ``Offload.NEVER``;
  moving it anyway is the caller's bug). Make sure the model steps that wrote the request's pages were
  queued before the call (on CUDA the copy waits for everything queued on the current stream when it starts).
- While it moves (:meth:`~kvferry.engine.runner.LockstepCache.is_moving`) the request may not be resumed,
  pinned, offloaded or restored again, nor get replay state or draft KV: those raise
  :class:`~kvferry.errors.CacheMoving` and change nothing. Schedule it again once the call returned.
- It may be closed while it moves: its memory goes back when the copy ended (the call finishes the move).
- A rebalance is refused while any move is in flight.
- After a restore, read the block tables and the slot again: the request holds new pages and a new slot.
- A restore takes free pages only: when it raises :class:`~kvferry.errors.PoolExhausted`, offload the
  requests :meth:`~kvferry.engine.runner.LockstepCache.restore_victims` names first (or resume it, which moves
  them synchronously).
"""

from __future__ import annotations

from kvferry.engine.moves import run_moves
from kvferry.engine.runner import LockstepCache
from kvferry.pools.manager import CacheManager

__all__ = ["offload_request", "restore_request"]


def _lockstep(cache: LockstepCache | CacheManager) -> LockstepCache:
    return cache if isinstance(cache, LockstepCache) else LockstepCache((cache,))


async def offload_request(cache: LockstepCache | CacheManager, request_id: int) -> bool:
    """Move a SUSPENDED request's pages, slot and replay state to the host on every rank, without blocking the
    event loop for the copy. Returns True when it moved (False: it was on the host already or never resumed).

    Cancelled (or a copy failed): the copies are asked to stop (a host copy stops at its next chunk of a few
    megabytes, a CUDA copy runs to its end), the cancel waits for them, shielded, and every rank rolls back:
    the request stays on the device as it was, its host buffer goes back; then the cancel (or the copy's
    error) propagates.

    :raises ~kvferry.errors.InvalidTransition: the request is not SUSPENDED (:class:`~kvferry.errors.
        CacheMoving` while it moves already); nothing changed.
    :raises ~kvferry.errors.UnknownRequest: it does not exist.
    """
    lockstep = _lockstep(cache)
    return await run_moves(lockstep, lockstep.start_offload(request_id))


async def restore_request(cache: LockstepCache | CacheManager, request_id: int, *, pin: bool = False) -> bool:
    """Bring an offloaded SUSPENDED request back to the device on every rank, without blocking the event loop
    for the copy; it stays SUSPENDED, in new pages and a new slot. Returns True when it moved (False: it was on
    the device already).

    :param pin: keep it on the device (``Offload.NEVER``) until its next resume or close.

    Cancelled (or a copy failed): as :func:`offload_request`, and every rank rolls back: the request stays on
    the host as it was, the pages and slot taken for it go back to the pools.

    :raises ~kvferry.errors.PoolExhausted: the free pages or slots do not suffice (see
        :meth:`~kvferry.engine.runner.LockstepCache.restore_victims`); nothing changed.
    :raises ~kvferry.errors.InvalidTransition: the request is not SUSPENDED (:class:`~kvferry.errors.
        CacheMoving` while it moves already); nothing changed.
    :raises ~kvferry.errors.UnknownRequest: it does not exist.
    """
    lockstep = _lockstep(cache)
    return await run_moves(lockstep, lockstep.start_restore(request_id, pin=pin))
