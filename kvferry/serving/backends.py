"""What a :class:`~kvferry.serving.service.Service` serves over: one aggregated engine, or a generation engine in
this process fed by context engines over a transport.

A backend turns one submitted request into an async iterator of its tokens (:meth:`Backend.start`), checks that a
request can ever fit (:meth:`Backend.check_fits`) and reports its pools and counts.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
from attrs import define, frozen

from kvferry.errors import ConfigError, RequestTooLarge

if TYPE_CHECKING:
    from kvferry.disagg.router import Router
    from kvferry.engine.engine import Engine
    from kvferry.engine.runner import BuiltEngine, EngineOptions
    from kvferry.serving.handle import RequestHandle
    from kvferry.serving.service import PoolOccupancy

__all__ = [
    "AggregatedBackend",
    "Backend",
    "DisaggOptions",
    "DisaggregatedBackend",
    "check_fits",
    "open_backend",
]


def check_fits(manager: Any, num_prompt: int, max_tokens: int, *, engine: str = "the engine") -> None:
    """Raise :class:`~kvferry.errors.RequestTooLarge` unless one request of ``num_prompt`` prompt tokens that
    generates ``max_tokens`` fits ``manager``'s attention pages on its own (the last token's KV is never
    written, so ``num_prompt + max_tokens - 1`` tokens need pages)."""
    config = manager.config
    per_block = config.tokens_per_block
    pages = config.num_pages - 1  # page 0 is reserved
    needed = -(-(num_prompt + max_tokens - 1) // per_block)
    if needed <= pages:
        return
    most = pages * per_block - num_prompt + 1
    fix = f"lower max_tokens to {most} or less, or " if most >= 1 else ""
    raise RequestTooLarge(
        f"a prompt of {num_prompt} tokens with max_tokens {max_tokens} needs {needed} pages of {per_block} "
        f"tokens; {engine} has {pages}: {fix}start it with --num-pages {needed + 1} or more"
    )


@frozen
class DisaggOptions:
    """Disaggregated serving: where the context engines run and how their caches travel.

    With ``contexts`` empty a context engine is started on this host (another OS process when ``separate_process``,
    else in this process); otherwise ``contexts`` are the transport addresses of running context engines
    (``kvferry serve --role context``), and requests are spread over them.
    """

    transport: str = "auto"
    ctx_tp: int = 1
    contexts: tuple[str, ...] = ()
    separate_process: bool = True
    #: the secret both sides authenticate with (None: a fresh one for a context engine started here)
    secret: bytes | None = None
    #: context engine attention pages per rank (0: as many as the generation engine)
    ctx_num_pages: int = 0
    #: where a context engine started here keeps its weights and caches (None: the generation engine's device)
    ctx_device: str | None = None
    #: requests each context engine is asked to work on at once; the rest wait in arrival order
    context_window: int = 32

    def __attrs_post_init__(self) -> None:
        if self.ctx_tp < 1:
            raise ConfigError(f"ctx_tp must be at least 1, got {self.ctx_tp}")


class Backend(abc.ABC):
    """One way of running requests (see the module docstring), over the engine that decodes them."""

    #: the served model's name
    name: str

    @property
    @abc.abstractmethod
    def built(self) -> BuiltEngine:
        """The engine that decodes (its pools are the ones reported)."""

    @property
    def model_name(self) -> str:
        return self.name

    @property
    def vocab_size(self) -> int:
        return self.built.runner.vocab_size

    @property
    def max_spec_k(self) -> int:
        return self.built.engine.config.scheduler.max_spec_k

    @abc.abstractmethod
    def check_fits(self, num_prompt: int, max_tokens: int, spec_k: int) -> None:
        """Raise :class:`~kvferry.errors.RequestTooLarge` for a request that can never fit."""

    @abc.abstractmethod
    def start(
        self,
        handle: RequestHandle,
        *,
        stop_ids: frozenset[int],
        seed: int | None,
        temperature: float,
        spec_k: int,
        conversation: Any = None,
        turn_prompt: tuple[int, ...] = (),
    ) -> AsyncIterator[int]:
        """Queue the request now (raising what refuses it) and return the iterator of its tokens; closing the
        iterator early cancels the request and frees what it held. With ``conversation`` (from
        :meth:`conversation`) it is that conversation's next turn, of new prompt ``turn_prompt``."""

    @abc.abstractmethod
    def conversation(self, spec_k: int) -> Any:
        """A new conversation whose turns :meth:`start` runs (it keeps their cache between them)."""

    def pools(self) -> PoolOccupancy:
        return _occupancy(self.built)

    def counts(self) -> dict[str, int]:
        return _engine_counts(self.built.engine, self.built)

    @abc.abstractmethod
    def describe(self) -> str: ...


def _occupancy(built: BuiltEngine) -> PoolOccupancy:
    from kvferry.serving.service import PoolOccupancy

    s = built.cache.primary.statistics()
    return PoolOccupancy(
        s.pages_used,
        s.pages_total,
        s.slots_live,
        s.slots_total,
        s.draft_pages_used,
        s.draft_pages_total,
        s.requests_offloaded,
    )


def _engine_counts(engine: Engine, built: BuiltEngine) -> dict[str, int]:
    e = engine.statistics()
    m = built.cache.primary.statistics()
    return {
        "steps": e.num_steps,
        "running": e.num_running,
        "waiting": e.num_waiting,
        "drafted": e.num_drafted,
        "accepted": e.num_accepted,
        "offloads": m.offloads,
        "restores": m.restores,
        "preemptions": engine.scheduler.statistics().num_preemptions,
    }


@define(eq=False)
class AggregatedBackend(Backend):
    """Every request prefills and decodes on one engine."""

    built: BuiltEngine
    name: str

    def check_fits(self, num_prompt: int, max_tokens: int, spec_k: int) -> None:
        check_fits(self.built.cache.primary, num_prompt, max_tokens)

    def start(
        self,
        handle: RequestHandle,
        *,
        stop_ids: frozenset[int],
        seed: int | None,
        temperature: float,
        spec_k: int,
        conversation: Any = None,
        turn_prompt: tuple[int, ...] = (),
    ) -> AsyncIterator[int]:
        sampling = {
            "max_tokens": handle.max_tokens,
            "stop_ids": stop_ids,
            "seed": seed,
            "temperature": temperature,
        }
        if conversation is not None:
            return self._tokens(handle, conversation.turn(turn_prompt, **sampling))  # submitted by turn()
        generation = self.built.engine.generate(handle.prompt_ids, spec_k=spec_k, **sampling)  # type: ignore[arg-type]
        generation.submit()
        return self._tokens(handle, generation)

    def conversation(self, spec_k: int) -> Any:
        return self.built.engine.conversation(spec_k=spec_k)

    @staticmethod
    async def _tokens(handle: RequestHandle, generation: Any) -> AsyncIterator[int]:
        request = generation.request
        try:
            async for token in generation:
                handle.admitted_at = request.admitted_at
                yield token
        finally:
            generation.cancel()  # no-op once it ended
            handle.admitted_at = request.admitted_at

    def describe(self) -> str:
        return f"aggregated {self.name} tp={len(self.built.arenas)}"


@define(eq=False)
class DisaggregatedBackend(Backend):
    """Context engines prefill; this process's generation engine receives each cache and decodes."""

    router: Router
    name: str
    options: DisaggOptions
    parts: dict[str, Any] = attrs.field(factory=dict)

    @property
    def built(self) -> BuiltEngine:
        return self.router.worker.built

    def check_fits(self, num_prompt: int, max_tokens: int, spec_k: int) -> None:
        check_fits(self.built.cache.primary, num_prompt, max_tokens, engine="the generation engine")
        self.router.check_fits(num_prompt)

    def start(
        self,
        handle: RequestHandle,
        *,
        stop_ids: frozenset[int],
        seed: int | None,
        temperature: float,
        spec_k: int,
        conversation: Any = None,
        turn_prompt: tuple[int, ...] = (),
    ) -> AsyncIterator[int]:
        sampling = {
            "max_tokens": handle.max_tokens,
            "stop_ids": stop_ids,
            "seed": seed,
            "temperature": temperature,
        }
        if conversation is not None:
            return self._tokens(handle, conversation.turn(turn_prompt, **sampling))
        routed = self.router.generate(handle.prompt_ids, spec_k=spec_k, **sampling)  # type: ignore[arg-type]
        return self._tokens(handle, routed)

    def conversation(self, spec_k: int) -> Any:
        return self.router.conversation(spec_k=spec_k)

    @staticmethod
    async def _tokens(handle: RequestHandle, routed: Any) -> AsyncIterator[int]:
        stream = routed.__aiter__()
        try:
            async for token in stream:
                handle.admitted_at = routed.admitted_at
                if routed.transfer is not None:
                    handle.handoff_seconds = routed.transfer.seconds
                yield token
        finally:
            await stream.aclose()
            handle.admitted_at = routed.admitted_at

    def counts(self) -> dict[str, int]:
        worker = self.router.worker.statistics()
        return {
            **super().counts(),
            "transfers": worker.get("transfers", 0),
            "bytes": worker.get("bytes", 0),
            "in_doubt": worker.get("in_doubt", 0),
            "quarantined": worker.get("quarantined", 0),
            "context_queue": self.router.queued,
        }

    def describe(self) -> str:
        return (
            f"disaggregated {self.name} over {self.options.transport} "
            f"ctx_tp={self.options.ctx_tp} gen_tp={len(self.built.arenas)}"
        )


@asynccontextmanager
async def open_backend(
    model: str, engine: EngineOptions | None, disagg: DisaggOptions | None
) -> AsyncIterator[Backend]:
    from kvferry.engine.runner import EngineOptions, build_engine

    options = engine if engine is not None else EngineOptions()
    name = "tiny" if str(model) == "tiny" else str(model).rstrip("/").rsplit("/", 1)[-1]
    if disagg is None:
        built = build_engine(model, options)
        async with built.engine:
            yield AggregatedBackend(built, name)
        return
    from kvferry.disagg.serve import disaggregated

    async with disaggregated(
        model=str(model),
        options=options,
        transport=disagg.transport,
        ctx_tp=disagg.ctx_tp,
        contexts=disagg.contexts,
        context_window=disagg.context_window,
        separate_process=disagg.separate_process,
        secret=disagg.secret,
        ctx_num_pages=disagg.ctx_num_pages,
        ctx_device=disagg.ctx_device,
    ) as (router, parts):
        yield DisaggregatedBackend(router, name, disagg, parts)
