"""The public serving API: one :class:`Service` for aggregated and disaggregated serving.

::

    async with kvferry.open_service("tiny") as service:            # or disagg=DisaggOptions(...)
        handle = await service.submit(prompt_ids, max_tokens=32)
        async for token in handle:
            ...
        result = await handle.result()    # finish_reason stop / length / cancelled / error, timing

:meth:`Service.submit` validates the request (token ids, sampling, whether it can ever fit the pools) and
queues it with the engine before it returns; what cannot be served raises there, typed, and nothing is held.
Every request then runs in a task of the service (see :mod:`~kvferry.serving.handle`). Admission is the
engine's scheduler's, in arrival order: a request waits for a batch row, pages and a state slot, never fails
for lack of them while others run. Leaving the ``async with`` cancels every request still running (each
ends ``cancelled``) and frees everything it held.
"""

from __future__ import annotations

import itertools
import statistics as stats
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

import anyio
import anyio.abc
import attrs
from attrs import define

from kvferry._percentile import nearest_rank
from kvferry.engine.request import SamplingParams
from kvferry.errors import ConfigError, EngineClosed, KvferryError, RequestAborted, ServiceOverloaded
from kvferry.serving.backends import Backend, DisaggOptions, open_backend
from kvferry.serving.handle import CompletionResult, FinishReason, RequestHandle, RequestTiming

__all__ = [
    "Percentiles",
    "PoolOccupancy",
    "Service",
    "ServiceConversation",
    "ServiceStatistics",
    "open_service",
]

#: Requests submitted and not yet admitted by the engine that decodes them, past which submit() refuses.
DEFAULT_MAX_QUEUED = 1024
#: Finished requests whose timings feed the percentiles of statistics().
TIMING_WINDOW = 4096


class Percentiles(NamedTuple):
    """p50 / p99 of a window of seconds (None: no samples)."""

    p50: float | None
    p99: float | None
    samples: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Percentiles:
        ordered = sorted(values)
        if not ordered:
            return cls(None, None, 0)
        return cls(stats.median(ordered), nearest_rank(ordered, 99), len(ordered))


class PoolOccupancy(NamedTuple):
    """The decoding engine's rank-0 pools (every rank holds the same counts)."""

    pages_used: int
    pages_total: int
    slots_live: int
    slots_total: int
    draft_pages_used: int
    draft_pages_total: int
    #: suspended requests whose cache was moved to host memory
    requests_on_host: int


class ServiceStatistics(NamedTuple):
    submitted: int
    #: requests that ended, by :class:`~kvferry.serving.handle.FinishReason` value
    finished: dict[str, int]
    #: requests running now (submitted, not ended) / of them, not yet admitted
    active: int
    queued: int
    tokens_generated: int
    queue_seconds: Percentiles
    ttft_seconds: Percentiles
    inter_token_seconds: Percentiles
    handoff_seconds: Percentiles
    pools: PoolOccupancy
    #: the backend's counts (engine steps; transfers, bytes, in-doubt transfers, offloads when disaggregated)
    backend: dict[str, int]


@define(eq=False)
class Service:
    """Serves requests over a backend (see the module docstring). Build it with :func:`open_service`."""

    backend: Backend
    task_group: anyio.abc.TaskGroup
    max_queued: int = DEFAULT_MAX_QUEUED
    _ids: itertools.count[int] = attrs.field(factory=itertools.count, init=False)
    _active: dict[str, RequestHandle] = attrs.field(factory=dict, init=False)
    _timings: deque[RequestTiming] = attrs.field(factory=lambda: deque(maxlen=TIMING_WINDOW), init=False)
    _finished: dict[str, int] = attrs.field(
        factory=lambda: {reason.value: 0 for reason in FinishReason}, init=False
    )
    _listeners: list[Callable[[RequestHandle], None]] = attrs.field(factory=list, init=False)
    _submitted: int = attrs.field(default=0, init=False)
    _tokens: int = attrs.field(default=0, init=False)
    _closed: bool = attrs.field(default=False, init=False)

    @property
    def model_name(self) -> str:
        return self.backend.model_name

    @property
    def vocab_size(self) -> int:
        return self.backend.vocab_size

    @property
    def max_spec_k(self) -> int:
        return self.backend.max_spec_k

    def add_listener(self, listener: Callable[[RequestHandle], None]) -> None:
        """Call ``listener(handle)`` (synchronously, on the event loop) whenever a request ends."""
        self._listeners.append(listener)

    async def submit(
        self,
        prompt_ids: Iterable[int],
        *,
        max_tokens: int,
        stop_ids: Iterable[int] = (),
        seed: int | None = None,
        temperature: float = 1.0,
        spec_k: int | None = None,
    ) -> RequestHandle:
        """Validate and queue a request; return its handle (the request runs whether or not it is read).

        ``spec_k`` defaults to the engine's ``max_spec_k`` (0: no speculative decoding).

        :raises ~kvferry.errors.ConfigError: bad token ids, ``max_tokens``, ``spec_k`` or sampling arguments.
        :raises ~kvferry.errors.RequestTooLarge: the request can never fit the pools (the message says how
            big it is and which option would make it fit).
        :raises ~kvferry.errors.ServiceOverloaded: ``max_queued`` requests already wait for admission.
        :raises ~kvferry.errors.EngineClosed: the service is closed.
        """
        return self._submit(
            prompt_ids,
            max_tokens=max_tokens,
            stop_ids=stop_ids,
            seed=seed,
            temperature=temperature,
            spec_k=spec_k,
        )

    def conversation(self, *, spec_k: int | None = None) -> ServiceConversation:
        """A multi-turn conversation: each :meth:`ServiceConversation.submit` is its next turn (it sees every
        earlier prompt and answer), and the engine keeps its cache between turns (in disaggregated serving, the
        generation engine; each transfer sends only what that cache lacks). ``spec_k`` is fixed for its life.

        :raises ~kvferry.errors.ConfigError: a bad ``spec_k``.
        :raises ~kvferry.errors.EngineClosed: the service is closed.
        """
        if self._closed:
            raise EngineClosed("the service is closed")
        k = self._spec_k(spec_k)
        return ServiceConversation(self, self.backend.conversation(k))

    def _spec_k(self, spec_k: int | None) -> int:
        k = self.backend.max_spec_k if spec_k is None else spec_k
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.backend.max_spec_k:
            raise ConfigError(f"spec_k must be an int in [0, {self.backend.max_spec_k}], got {spec_k!r}")
        return k

    def _submit(
        self,
        prompt_ids: Iterable[int],
        *,
        max_tokens: int,
        stop_ids: Iterable[int],
        seed: int | None,
        temperature: float,
        spec_k: int | None,
        conversation: Any = None,
        history: tuple[int, ...] = (),
    ) -> RequestHandle:
        if self._closed:
            raise EngineClosed("the service is closed")
        turn = _token_ids(prompt_ids, "prompt")
        prompt = history + turn
        stops = frozenset(_token_ids(stop_ids, "stop_ids", allow_empty=True))
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ConfigError(f"max_tokens must be a positive int, got {max_tokens!r}")
        k = self._spec_k(spec_k)
        SamplingParams(seed=seed, temperature=temperature)  # raises ConfigError on a bad one
        vocab = self.backend.vocab_size
        if any(not 0 <= t < vocab for t in turn):
            raise ConfigError(f"prompt token ids must be in [0, {vocab})")
        self.backend.check_fits(len(prompt), max_tokens, k)
        queued = sum(1 for h in self._active.values() if h.admitted_at is None)
        if queued >= self.max_queued:
            raise ServiceOverloaded(f"{queued} requests wait for admission (max_queued {self.max_queued})")
        handle = RequestHandle(f"req-{next(self._ids)}", prompt, max_tokens, stops)
        # builds the engine's request (validating the sampling arguments) and queues it before returning
        run = self.backend.start(
            handle,
            stop_ids=stops,
            seed=seed,
            temperature=temperature,
            spec_k=k,
            conversation=conversation,
            turn_prompt=turn,
        )
        self._submitted += 1
        self._active[handle.request_id] = handle
        self.task_group.start_soon(self._run, handle, run)
        return handle

    async def generate(
        self, prompt_ids: Iterable[int], *, max_tokens: int, **kwargs: Any
    ) -> CompletionResult:
        """:meth:`submit`, then wait for the result (a cancel of the caller cancels the request)."""
        handle = await self.submit(prompt_ids, max_tokens=max_tokens, **kwargs)
        try:
            return await handle.result()
        finally:
            handle.cancel()  # no-op once it ended

    async def _run(self, handle: RequestHandle, run: AsyncIterator[int]) -> None:
        error: KvferryError | None = None
        try:
            with handle.scope:
                async for token in run:
                    handle.push(token)
                    self._tokens += 1
        except KvferryError as exc:
            error = exc
        except Exception as exc:  # a bug below us: this request fails, the service keeps serving
            error = RequestAborted(f"request {handle.request_id} failed: {type(exc).__name__}: {exc}")
        finally:
            with anyio.CancelScope(shield=True):
                await _close(run)
            cancelled = handle.scope.cancelled_caught or self._closed
            handle.finish(FinishReason.CANCELLED if cancelled and error is None else None, error)
            self._ended(handle)

    def _ended(self, handle: RequestHandle) -> None:
        self._active.pop(handle.request_id, None)
        assert handle.finish_reason is not None
        self._finished[handle.finish_reason.value] += 1
        if handle.finish_reason is not FinishReason.CANCELLED:
            self._timings.append(handle.timing())
        for listener in self._listeners:
            listener(handle)

    def statistics(self) -> ServiceStatistics:
        timings = list(self._timings)
        return ServiceStatistics(
            submitted=self._submitted,
            finished=dict(self._finished),
            active=len(self._active),
            queued=sum(1 for h in self._active.values() if h.admitted_at is None),
            tokens_generated=self._tokens,
            queue_seconds=Percentiles.of(t.queue_seconds for t in timings if t.queue_seconds is not None),
            ttft_seconds=Percentiles.of(t.ttft_seconds for t in timings if t.ttft_seconds is not None),
            inter_token_seconds=Percentiles.of(g for t in timings for g in t.inter_token_seconds),
            handoff_seconds=Percentiles.of(
                t.handoff_seconds for t in timings if t.handoff_seconds is not None
            ),
            pools=self.backend.pools(),
            backend=self.backend.counts(),
        )

    def close(self) -> None:
        """Refuse new requests and cancel every running one (what they hold is freed by their tasks)."""
        self._closed = True
        for handle in list(self._active.values()):
            handle.cancel()

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<Service {self.backend.describe()} [{s.active} active, {s.queued} queued | "
            f"submitted {s.submitted}, tokens {s.tokens_generated}]>"
        )


async def _close(run: AsyncIterator[int]) -> None:
    aclose = getattr(run, "aclose", None)
    if aclose is not None:
        await aclose()


def _token_ids(values: Iterable[int], what: str, *, allow_empty: bool = False) -> tuple[int, ...]:
    if isinstance(values, str | bytes):
        raise ConfigError(f"{what} must be token ids, not text")
    try:
        out = tuple(values)
    except TypeError:
        raise ConfigError(f"{what} must be a sequence of token ids") from None
    if any(isinstance(t, bool) or not isinstance(t, int) for t in out):
        raise ConfigError(f"{what} must hold ints only")
    if not out and not allow_empty:
        raise ConfigError(f"{what} needs at least one token")
    return out


@asynccontextmanager
async def open_service(
    model: str = "tiny",
    *,
    engine: Any = None,
    disagg: DisaggOptions | None = None,
    max_queued: int = DEFAULT_MAX_QUEUED,
) -> AsyncIterator[Service]:
    """A running :class:`Service` over ``model`` (``"tiny"`` or a NemotronH checkpoint directory).

    ``engine`` (:class:`~kvferry.engine.runner.EngineOptions`) sizes the engine that decodes; ``disagg``
    serves disaggregated (a context engine prefills, its cache moves over a transport, this process decodes;
    see :class:`~kvferry.serving.backends.DisaggOptions`). Leaving the block cancels every running request,
    waits for their tasks (shielded), then stops the engines and closes the transports.

    :raises ~kvferry.errors.ConfigError: a bad model or option (nothing was started).
    """
    if max_queued < 1:
        raise ConfigError(f"max_queued must be at least 1, got {max_queued}")
    async with open_backend(model, engine, disagg) as backend, anyio.create_task_group() as tg:
        service = Service(backend, tg, max_queued)
        try:
            yield service
        finally:
            service.close()


@define(eq=False)
class ServiceConversation:
    """A conversation on a :class:`Service` (:meth:`Service.conversation`): one turn at a time, each a request
    with its own :class:`~kvferry.serving.handle.RequestHandle`. :meth:`close` (or leaving ``with``) frees the
    cache it keeps."""

    service: Service
    #: the backend's conversation (an engine's :class:`~kvferry.engine.conversation.Conversation` or a router's
    #: :class:`~kvferry.disagg.router.RoutedConversation`)
    inner: Any

    @property
    def history(self) -> tuple[int, ...]:
        """Every token so far (prompts and answers of the turns that ended)."""
        conversation = getattr(self.inner, "conversation", self.inner)
        return tuple(conversation.history)

    async def submit(
        self,
        prompt_ids: Iterable[int],
        *,
        max_tokens: int,
        stop_ids: Iterable[int] = (),
        seed: int | None = None,
        temperature: float = 1.0,
    ) -> RequestHandle:
        """Validate and queue the next turn (its prompt: the new tokens); as :meth:`Service.submit`.

        :raises ~kvferry.errors.ConfigError: also while the previous turn has not ended.
        """
        conversation = getattr(self.inner, "conversation", self.inner)
        return self.service._submit(
            prompt_ids,
            max_tokens=max_tokens,
            stop_ids=stop_ids,
            seed=seed,
            temperature=temperature,
            spec_k=conversation.spec_k,
            conversation=self.inner,
            history=tuple(conversation.history),
        )

    async def generate(
        self, prompt_ids: Iterable[int], *, max_tokens: int, **kwargs: Any
    ) -> CompletionResult:
        """:meth:`submit`, then wait for the result (a cancel of the caller cancels the turn)."""
        handle = await self.submit(prompt_ids, max_tokens=max_tokens, **kwargs)
        try:
            return await handle.result()
        finally:
            handle.cancel()

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> ServiceConversation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
