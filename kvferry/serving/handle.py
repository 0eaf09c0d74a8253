"""One submitted request as its caller holds it: a :class:`RequestHandle` (tokens as they come, ``cancel()``,
the final :class:`CompletionResult`).

The request runs in a task of its service, not in the caller's: tokens are buffered in the handle whether or
not anyone iterates, so a slow reader never stalls the engine, and any number of readers may iterate (each
from the first token). ``cancel()`` (or a service that closes) ends the request at once: the engine frees its
cache at its next step boundary, a disaggregated request's context side is told to drop it, and a transfer in
flight is cancelled (its pages stay quarantined until every writer reported).
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import AsyncIterator

import anyio
import attrs
from attrs import define, frozen

from kvferry.errors import KvferryError

__all__ = ["CompletionResult", "FinishReason", "RequestHandle", "RequestTiming"]


class FinishReason(enum.Enum):
    """Why a request ended (``value`` is the OpenAI ``finish_reason`` string)."""

    #: it produced one of its stop tokens (which is its last token)
    STOP = "stop"
    #: it produced ``max_tokens`` tokens
    LENGTH = "length"
    #: ``cancel()``, a client that went away, or a service that closed
    CANCELLED = "cancelled"
    #: it failed: :attr:`CompletionResult.error` says why
    ERROR = "error"


@frozen
class RequestTiming:
    """Where one request's time went, in seconds (None: that point was not reached)."""

    #: submit -> admitted by the engine that decodes it (a batch row, pages and a slot were reserved)
    queue_seconds: float | None
    #: submit -> first token
    ttft_seconds: float | None
    #: the gaps between consecutive tokens (tokens of one speculative step arrive together: gap 0)
    inter_token_seconds: tuple[float, ...]
    #: disaggregated: the cache's transfer, receive request -> last writer's report (None: aggregated)
    handoff_seconds: float | None
    #: submit -> end
    total_seconds: float | None


@frozen
class CompletionResult:
    """What a request produced and why it ended."""

    request_id: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    #: the error of a request that failed (None otherwise)
    error: KvferryError | None
    timing: RequestTiming

    @property
    def ok(self) -> bool:
        return self.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


@define(eq=False)
class RequestHandle:
    """A request submitted to a :class:`~kvferry.serving.service.Service`.

    ``async for token in handle`` yields every token (from the first, whenever the iteration starts) and ends
    when the request does; it raises the request's error if it failed, and simply ends if it was cancelled.
    :meth:`result` waits for the end and never raises. :meth:`cancel` is synchronous and idempotent.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    stop_ids: frozenset[int]
    submitted_at: float = attrs.field(factory=time.perf_counter)
    tokens: list[int] = attrs.field(factory=list, init=False)
    token_times: list[float] = attrs.field(factory=list, init=False)
    admitted_at: float | None = attrs.field(default=None, init=False)
    handoff_seconds: float | None = attrs.field(default=None, init=False)
    finished_at: float | None = attrs.field(default=None, init=False)
    finish_reason: FinishReason | None = attrs.field(default=None, init=False)
    error: KvferryError | None = attrs.field(default=None, init=False)
    #: the request's task runs under it: cancel() cancels it
    scope: anyio.CancelScope = attrs.field(factory=anyio.CancelScope, init=False)
    _changed: anyio.Event = attrs.field(factory=anyio.Event, init=False)

    # --- the service's side ----------------------------------------------------------------------------

    def push(self, token: int) -> None:
        """A new token (the service's task)."""
        self.tokens.append(token)
        self.token_times.append(time.perf_counter())
        self._wake()

    def finish(self, reason: FinishReason | None = None, error: KvferryError | None = None) -> None:
        """The request ended (once; later calls do nothing). Without a reason it is read off the tokens."""
        if self.finish_reason is not None:
            return
        if error is not None:
            reason = FinishReason.ERROR
        elif reason is None:
            reason = self._reason_from_tokens()
        self.finish_reason, self.error = reason, error
        self.finished_at = time.perf_counter()
        self._wake()

    def _reason_from_tokens(self) -> FinishReason:
        if self.tokens and self.tokens[-1] in self.stop_ids:
            return FinishReason.STOP
        if len(self.tokens) >= self.max_tokens:
            return FinishReason.LENGTH
        return FinishReason.CANCELLED

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    # --- the caller's side -----------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        """End the request now (nothing happens if it already ended). What it held is freed by its task."""
        self.scope.cancel()

    def __aiter__(self) -> AsyncIterator[int]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[int]:
        read = 0
        while True:
            while read < len(self.tokens):
                read += 1
                yield self.tokens[read - 1]
            if self.finish_reason is not None:
                break
            await self._changed.wait()
        if self.error is not None:
            raise self.error

    async def wait(self) -> None:
        """Wait for the end."""
        while self.finish_reason is None:
            await self._changed.wait()

    async def result(self) -> CompletionResult:
        """Wait for the end and return what the request produced (never raises)."""
        await self.wait()
        assert self.finish_reason is not None
        return CompletionResult(
            self.request_id,
            self.prompt_ids,
            tuple(self.tokens),
            self.finish_reason,
            self.error,
            self.timing(),
        )

    def timing(self) -> RequestTiming:
        start = self.submitted_at
        times = self.token_times
        return RequestTiming(
            queue_seconds=None if self.admitted_at is None else max(0.0, self.admitted_at - start),
            ttft_seconds=times[0] - start if times else None,
            inter_token_seconds=tuple(b - a for a, b in itertools.pairwise(times)),
            handoff_seconds=self.handoff_seconds,
            total_seconds=None if self.finished_at is None else self.finished_at - start,
        )

    def __repr__(self) -> str:
        state = "running" if self.finish_reason is None else self.finish_reason.value
        return (
            f"<RequestHandle {self.request_id} {state} prompt={len(self.prompt_ids)} "
            f"tokens={len(self.tokens)}/{self.max_tokens}>"
        )
