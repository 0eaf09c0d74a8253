"""One request's stream of tokens: what :meth:`Engine.generate <kvferry.engine.engine.Engine.generate>` returns.

A :class:`Generation` is iterated once; it can be cancelled, suspended (held aside with its cache kept), moved to
the host and resumed by its owner. Each of those takes effect at the engine's next step boundary.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, NamedTuple

import attrs
from attrs import define

from kvferry.engine.request import Request, RequestState
from kvferry.errors import ConfigError, KvferryError, RequestAborted

if TYPE_CHECKING:
    from kvferry.engine.engine import Engine

__all__ = ["Generation", "GenerationStatistics"]


class GenerationStatistics(NamedTuple):
    request_id: int
    state: RequestState
    finish_reason: str | None
    num_prompt: int
    num_generated: int
    reused_tokens: int
    num_drafted: int
    num_accepted: int
    acceptance_rate: float
    num_preemptions: int


# --- one request's stream --------------------------------------------------------------------------------


@define(eq=False)
class Generation:
    """The tokens of one request, as an async iterable (iterate it once).

    Nothing is submitted until iteration starts. Leaving the ``async for`` early, or a cancel scope around
    it, cancels the request: whatever it held in the cache manager is freed at the engine's next step
    boundary, and the engine keeps serving the others. :meth:`statistics` reads the request's counters at
    any time (also after the end).
    """

    _engine: Engine
    request: Request
    _started: bool = attrs.field(default=False, init=False)
    _submitted: bool = attrs.field(default=False, init=False)

    def __aiter__(self) -> AsyncIterator[int]:
        if self._started:
            raise ConfigError("a Generation can be iterated once")
        self._started = True
        return self._tokens()

    def submit(self) -> None:
        """Queue the request with the engine now (iterating does it otherwise); idempotent. Once submitted, the
        request runs until it ends or :meth:`cancel` (or an iteration that stops early) ends it.

        :raises ~kvferry.errors.EngineClosed: the engine is not running.
        """
        if not self._submitted:
            self._engine._submit(self.request)
            self._submitted = True

    def cancel(self) -> None:
        """End the request at the engine's next step boundary, freeing what it holds (no-op once it ended)."""
        self._engine._cancel(self.request)

    async def suspend(self) -> None:
        """Hold the request aside at the engine's next step boundary and wait until it is: it stops being
        scheduled and its cache is suspended, kept on the device (or moved to the host under pressure, or with
        :meth:`offload`) until :meth:`resume`. A stream being iterated simply waits meanwhile.

        A cancel while waiting leaves the suspend asked for (it still happens at the next step boundary).

        :raises ~kvferry.errors.ConfigError: the request is not submitted, or its cache is in transit
            (disaggregated serving), so it cannot be suspended.
        :raises ~kvferry.errors.RequestAborted: the request ended before it was suspended.
        """
        request = self.request
        self._engine._hold(request, suspend=True)
        while request.state is not RequestState.SUSPENDED and not request.state.is_terminal:
            await self._engine._step_done.wait()
        if request.state is not RequestState.SUSPENDED:
            raise RequestAborted(
                f"request {request.request_id} ended {request.state.name} before its suspend"
            )

    def resume(self) -> None:
        """Queue a suspended request again (last in line): its cache is restored from the host if it was moved
        there, and it goes on where it stopped, with the same tokens as if never suspended. A no-op unless
        suspended (or being suspended: then it is not)."""
        self._engine._hold(self.request, suspend=False)

    async def offload(self) -> None:
        """Move the suspended request's cache (pages, state slot, replay state, draft pages) to host memory now;
        :meth:`resume` brings it back. A request that holds no cache yet has nothing to move.

        The copy runs off the event loop; a cancel while it runs rolls it back (the cache stays on the device).

        :raises ~kvferry.errors.ConfigError: the request is not suspended (:meth:`suspend` first).
        :raises ~kvferry.errors.CacheMoving: its cache is moving already.
        """
        await self._engine._offload(self.request)

    async def _tokens(self) -> AsyncIterator[int]:
        engine, request = self._engine, self.request
        self.submit()
        read = 0
        try:
            while True:
                output = request.output_ids
                while read < len(output):
                    read += 1
                    yield output[read - 1]
                if request.state.is_terminal:
                    break
                # no await between the checks above and taking the event: a step that appends tokens (or ends
                # the request) after them sets exactly this event
                await engine._step_done.wait()
            if request.state is RequestState.FAILED:
                error = request.error
                if isinstance(error, KvferryError):
                    raise error
                raise RequestAborted(f"request {request.request_id} failed: {error!r}") from error
            if request.state is not RequestState.FINISHED:
                raise RequestAborted(f"request {request.request_id} ended {request.state.name}")
        finally:
            # synchronous on purpose: this also runs when the generator is finalised without an event loop turn
            engine._cancel(request)

    async def collect(self) -> list[int]:
        """All tokens, as a list."""
        return [token async for token in self]

    def statistics(self) -> GenerationStatistics:
        r = self.request
        return GenerationStatistics(
            request_id=r.request_id,
            state=r.state,
            finish_reason=r.finish_reason,
            num_prompt=r.num_prompt,
            num_generated=len(r.output_ids),
            reused_tokens=r.reused_tokens,
            num_drafted=r.num_drafted,
            num_accepted=r.num_accepted,
            acceptance_rate=r.acceptance_rate,
            num_preemptions=r.num_preemptions,
        )
