"""The engine's cache, adapted for hand-off: a context engine *holds* a prefilled request for its push.

A generation engine's request that expects a transfer is created like any other: the prefix cache may match part
of its prompt, and the transfer then writes only what follows (the receive request starts there).

:class:`HandoffCache` wraps the engine's :class:`~kvferry.engine.runner.LockstepCache` and changes nothing
inside the engine: :func:`install` swaps it in before the engine starts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
from attrs import define

from kvferry.engine.runner import BuiltEngine, LockstepCache
from kvferry.pools.manager import CacheState, Offload, Resumed

__all__ = ["HandoffCache", "install"]


@define(eq=False)
class HandoffCache:
    """The engine's cache operations over a :class:`~kvferry.engine.runner.LockstepCache`, plus hand-off.

    ``hold(rid, callback)``: the engine's close of ``rid`` once its whole prompt is committed keeps the request
    (suspended; moved to the host when the engine needs the room) and calls ``callback(rid)`` instead.
    ``release(rid)`` closes it for good (see there: never under a step the engine may still run).
    """

    inner: LockstepCache
    _hold: dict[int, Callable[[int], None]] = attrs.field(factory=dict, init=False)
    #: requests the engine created and has not closed (it may still step them and commit their tokens), with
    #: their prompt lengths
    _engine_owned: dict[int, int] = attrs.field(factory=dict, init=False)

    @property
    def managers(self) -> tuple[Any, ...]:
        return self.inner.managers

    def hold(self, request_id: int, callback: Callable[[int], None]) -> None:
        self._hold[request_id] = callback

    def create(self, request_id: int, prompt_token_ids: Sequence[int]) -> None:
        self.inner.create(request_id, prompt_token_ids)
        self._engine_owned[request_id] = len(prompt_token_ids)

    def resume(self, request_id: int) -> Resumed:
        return self.inner.resume(request_id)

    def close(self, request_id: int) -> None:
        prompt = self._engine_owned.pop(request_id, None)
        manager = self.inner.primary
        if (
            request_id in self._hold
            and request_id in manager.request_ids()
            and prompt is not None
            and manager.num_committed_tokens(request_id) >= prompt
        ):
            # only a request whose prompt is all committed is held: the scheduler also closes a request whose
            # admission did not fit (it creates it again later) and one cancelled before its prefill ended
            callback = self._hold.pop(request_id)
            if manager.state(request_id) is CacheState.ACTIVE:
                for m in self.inner.managers:
                    # the room may go to the engine's next prompts: the push brings it back (ContextWorker)
                    m.suspend(request_id, offload=Offload.ON_PRESSURE)
            callback(request_id)  # synchronous: nothing moves the pages before it returns
            return
        self.inner.close(request_id)

    def release(self, request_id: int) -> None:
        """Close request ``request_id`` for good: now if the engine is done with it (held, or never created),
        else when the engine closes it.

        The engine still has a request whose stream ended before its prefill did (a cancel): it frees it at its
        next step boundary, and until then may run a step that writes its pages and commit that step's tokens.
        Closing it here would free the pages under that step and make the engine's commit fail
        (:class:`~kvferry.errors.UnknownRequest` in its step loop), so the hold is dropped instead and the
        engine's own close frees it. The caller must have ended the request's stream (the engine then closes
        it at its next step boundary)."""
        self._hold.pop(request_id, None)
        if request_id not in self._engine_owned:
            self.inner.close(request_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def install(built: BuiltEngine) -> HandoffCache:
    """Swap the engine's (and its scheduler's) cache for a :class:`HandoffCache`, before the engine starts."""
    cache = HandoffCache(built.cache)
    built.engine.cache = cache
    built.engine.scheduler.cache = cache
    return cache
