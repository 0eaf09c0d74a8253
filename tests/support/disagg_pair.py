"""Both engine roles in this process over the local transport, for tests that reach into either side: the
router, both workers and both built engines, with the options each test needs; a gate that holds a model step
in its worker thread; free-memory counts and a polling wait with a deadline."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.from_thread
import attrs
import pytest
import torch
from attrs import define

from kvferry.disagg.roles import ContextWorker, GenerationWorker
from kvferry.disagg.router import Router
from kvferry.disagg.serve import _options
from kvferry.engine.engine import ForwardItem
from kvferry.engine.runner import BuiltEngine, EngineOptions, PagedRunner, build_engine
from kvferry.transports import Peer, get_transport
from tests.support.disagg_reference import SPEC_K


def options(**changes: Any) -> EngineOptions:
    """The reference options (see ``reference.py``) with ``changes``."""
    return attrs.evolve(_options(1, SPEC_K, 0, "float64"), **changes)


@define(eq=False)
class Pair:
    router: Router
    worker: GenerationWorker
    context: ContextWorker
    gen: BuiltEngine
    ctx: BuiltEngine
    #: the generation side's peer (the context side)
    peer: Peer


@asynccontextmanager
async def pair(
    *,
    gen_options: EngineOptions | None = None,
    ctx_options: EngineOptions | None = None,
    worker: dict[str, Any] | None = None,
    context: dict[str, Any] | None = None,
    wrap_gen: Callable[[Any], Any] = lambda t: t,
    wrap_ctx: Callable[[Any], Any] = lambda t: t,
) -> AsyncIterator[Pair]:
    """A connected pair; ``worker`` / ``context``: keyword arguments of the two workers; ``wrap_gen`` /
    ``wrap_ctx``: what each worker gets as its transport (a test wrapper around it)."""
    gen = build_engine("tiny", gen_options or options())
    ctx = build_engine("tiny", ctx_options or options())
    factory = get_transport("local")
    async with factory() as gen_transport, gen.engine, anyio.create_task_group() as tg:
        gen_worker = GenerationWorker(gen, wrap_gen(gen_transport), **(worker or {}))
        async with factory() as ctx_transport, ctx.engine:
            ctx_worker = ContextWorker(ctx, wrap_ctx(ctx_transport), **(context or {}))
            peer = await gen_transport.connect(ctx_transport.address)
            ctx_peer = await ctx_transport.accept()
            tg.start_soon(ctx_worker.serve, ctx_peer)
            await gen_worker.connect(peer, tg)
            yield Pair(Router(gen_worker), gen_worker, ctx_worker, gen, ctx, peer)
            await peer.aclose()
        tg.cancel_scope.cancel()


class StepGate:
    """Holds the context engine's model step in its worker thread, after the model ran, when ``match`` says the
    step is the one: the step is *running* (its results not applied) until :meth:`open`."""

    def __init__(self, match: Callable[[Sequence[ForwardItem]], bool]) -> None:
        self.match = match
        self.entered = anyio.Event()
        self._open = threading.Event()
        self.used = False

    def hold(self, items: Sequence[ForwardItem]) -> None:
        if self.used or not self.match(items):
            return
        self.used = True
        anyio.from_thread.run_sync(self.entered.set)
        assert self._open.wait(30), "the test never opened the step gate"

    def open(self) -> None:
        self._open.set()


def first_chunk_of(prompt: Sequence[int]) -> Callable[[Sequence[ForwardItem]], bool]:
    """Whether a step holds the first prefill chunk of ``prompt`` (as long as the step's budget left it)."""
    whole = tuple(prompt)
    return lambda items: any(
        item.start == 0
        and 0 < len(item.token_ids) < len(whole)
        and tuple(item.token_ids) == whole[: len(item.token_ids)]
        for item in items
    )


def gate_steps(monkeypatch: pytest.MonkeyPatch, runner: PagedRunner, gate: StepGate) -> None:
    original = PagedRunner.forward

    def forward(self: PagedRunner, items: Sequence[ForwardItem]) -> torch.Tensor:
        out = original(self, items)
        if self is runner:
            gate.hold(items)
        return out

    monkeypatch.setattr(PagedRunner, "forward", forward)


def counts(built: BuiltEngine) -> tuple[int, ...]:
    """Free pages, draft pages and slots (snapshots are evictable prefix cache), quarantines, live requests."""
    s = built.cache.statistics()
    return (
        s.pages_free,
        s.draft_pages_free,
        s.slots_free + s.slots_snapshot,
        s.quarantines,
        s.requests_active + s.requests_suspended,
    )


async def until(condition: Callable[[], bool], seconds: float, what: Callable[[], object]) -> None:
    """Poll ``condition`` until it holds; fail the test with ``what()`` after ``seconds``."""
    try:
        with anyio.fail_after(seconds):
            while not condition():  # noqa: ASYNC110 (polls state no event exposes)
                await anyio.sleep(0.005)
    except TimeoutError:
        pytest.fail(f"not within {seconds}s: {what()}")
