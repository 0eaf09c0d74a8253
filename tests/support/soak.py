"""A seeded, randomized soak of disaggregated serving: :func:`run_soak`.

The system under test runs in this process: a generation engine with tight pools behind a
:class:`~kvferry.serving.service.Service`, fed by context engines (:func:`~kvferry.disagg.serve.serve_context`,
each in its own cancel scope with its own transport). Requests come at seeded random gaps (at most
``concurrency`` at once) with random prompts, lengths, sampling and speculation; some are cancelled after a
random delay, some clients stop reading after a few tokens and cancel (a disconnect), and context engines are
restarted at random points (the scope is cancelled: its transport closes and the generation side sees the peer
gone; a fresh engine is connected).

Every request must end; one that finished (stop / length) has exactly the tokens of an unconstrained aggregated
engine (computed meanwhile by another process), a cancelled one a prefix of them, and an errored one ended with
a typed error, before its cache landed, on a context engine that was killed (or while none was up). Afterwards
every pool, hold, receiver session, grant, registration, open descriptor and thread is back where it was after a
warm-up. What went wrong is listed in :attr:`SoakReport.problems` (empty: the soak passed).
"""

from __future__ import annotations

import os
import random
import threading
import time
import traceback
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any, cast

import anyio
import anyio.abc
import attrs
from attrs import define, frozen

from kvferry.disagg.roles import ContextWorker, GenerationWorker
from kvferry.disagg.roles.generation import ContextLink
from kvferry.disagg.router import RoutedGeneration, Router
from kvferry.disagg.serve import _options, serve_context
from kvferry.engine.runner import BuiltEngine, EngineOptions, build_engine
from kvferry.errors import KvferryError
from kvferry.serving.backends import DisaggOptions, DisaggregatedBackend
from kvferry.serving.handle import CompletionResult, FinishReason, RequestHandle
from kvferry.serving.service import Service
from kvferry.transports import Peer, Transport, get_transport, new_secret
from tests.support.disagg_pair import counts
from tests.support.soak_plan import SPEC_K, Client, ReferenceProcess, SoakPlan, SoakRequest, make_plan

__all__ = ["SoakReport", "run_soak"]

#: seconds a context engine has to build, register and listen
START_DEADLINE = 30.0
#: seconds the pools, holds and sessions have to come back once the last request ended
SETTLE_DEADLINE = 10.0


# --- the system under test ------------------------------------------------------------------------------


@define(eq=False)
class _TracingRouter(Router):
    """A router that remembers the latest generation it made (:attr:`last`; its ``link`` says where it went)."""

    last: RoutedGeneration | None = attrs.field(default=None, init=False)

    def generate(self, prompt_ids: Iterable[int], **kwargs: Any) -> RoutedGeneration:
        self.last = super().generate(prompt_ids, **kwargs)
        return self.last


@define(eq=False)
class _Context:
    """One context engine run by :func:`~kvferry.disagg.serve.serve_context` in its own cancel scope."""

    name: str
    scope: anyio.CancelScope = attrs.field(factory=anyio.CancelScope)
    listening: anyio.Event = attrs.field(factory=anyio.Event)
    ended: anyio.Event = attrs.field(factory=anyio.Event)
    address: str = ""
    worker: ContextWorker | None = None
    #: the generation side's connection to it and its link
    peer: Peer | None = None
    link: ContextLink | None = None
    initial: tuple[int, ...] = ()
    registrations: int = 0
    #: perf_counter() when its scope was cancelled (None: alive)
    killed_at: float | None = None

    @property
    def killed(self) -> bool:
        return self.killed_at is not None

    @property
    def built(self) -> BuiltEngine:
        assert self.worker is not None
        return self.worker.built

    def bind(self, worker: ContextWorker) -> None:
        self.worker = worker

    def listen(self, address: str) -> None:
        self.address = address
        self.listening.set()


@define(eq=False)
class _System:
    transport: str
    ctx_options: EngineOptions
    secret: bytes
    gen: BuiltEngine
    gen_transport: Transport
    worker: GenerationWorker
    router: _TracingRouter
    service: Service
    tg: anyio.abc.TaskGroup
    rng: random.Random
    contexts: list[_Context] = attrs.field(factory=list)
    #: (start, end) perf_counter windows during which no context engine was up
    outages: list[tuple[float, float]] = attrs.field(factory=list)
    restarts: int = 0
    failures: list[str] = attrs.field(factory=list)
    _lock: anyio.Lock = attrs.field(factory=anyio.Lock)

    @property
    def live(self) -> list[_Context]:
        return [c for c in self.contexts if not c.killed]

    async def _run_context(self, ctx: _Context) -> None:
        """Run a context engine until its scope is cancelled; anything it raises is one of :attr:`failures`
        (the soak goes on without it)."""
        try:
            with ctx.scope:
                await serve_context(
                    "tiny",
                    self.ctx_options,
                    transport=self.transport,
                    secret=self.secret,
                    on_listening=ctx.listen,
                    on_worker=ctx.bind,
                )
        except Exception:
            self.failures.append(f"{ctx.name} raised: {traceback.format_exc()}")
        finally:
            ctx.ended.set()

    async def start_context(self) -> _Context:
        """Start a context engine and connect the generation worker to it."""
        ctx = _Context(f"ctx{len(self.contexts)}")
        self.tg.start_soon(self._run_context, ctx)
        with anyio.fail_after(START_DEADLINE):
            await ctx.listening.wait()
        assert ctx.worker is not None
        ctx.initial = counts(ctx.built)
        ctx.registrations = ctx.worker.transport.statistics().registrations
        ctx.peer = await self.gen_transport.connect(ctx.address)
        await self.worker.connect(ctx.peer, self.tg)
        ctx.link = self.worker.links[-1]
        self.contexts.append(ctx)
        return ctx

    async def kill(self, ctx: _Context) -> None:
        """Cancel the context engine's scope (its transport closes) and close our side of the connection once
        the generation side saw the peer go."""
        ctx.killed_at = time.perf_counter()
        ctx.scope.cancel()
        with anyio.fail_after(SETTLE_DEADLINE):
            await ctx.ended.wait()
            while ctx.link is not None and not ctx.link.gone:  # noqa: ASYNC110 (the link exposes no event)
                await anyio.sleep(0.005)
        if ctx.peer is not None:
            await ctx.peer.aclose()

    async def restart(self) -> None:
        """Kill a random live context engine, then start a new one (one restart at a time); a failure is one of
        :attr:`failures`."""
        async with self._lock:
            victim = self.rng.choice(self.live) if self.live else None  # none: an earlier restart failed
            alone = len(self.live) <= 1
            began = time.perf_counter()
            try:
                if victim is not None:
                    await self.kill(victim)
                await self.start_context()
            except Exception:
                self.failures.append(f"a restart failed: {traceback.format_exc()}")
                return
            finally:
                if alone:
                    self.outages.append((began, time.perf_counter()))
            self.restarts += 1

    async def close(self) -> None:
        self.service.close()
        for ctx in self.live:
            ctx.scope.cancel()


@asynccontextmanager
async def _system(
    transport: str,
    ctx_tp: int,
    gen_tp: int,
    *,
    contexts: int,
    gen_pages: int,
    ctx_pages: int,
    max_running: int,
    max_queued: int,
    seed: int,
) -> AsyncIterator[_System]:
    gen_options = _options(gen_tp, SPEC_K, 0, "float64", num_pages=gen_pages, max_running=max_running)
    ctx_options = _options(ctx_tp, SPEC_K, 0, "float64", num_pages=ctx_pages, max_running=max_running)
    gen = build_engine("tiny", gen_options)
    secret = new_secret()
    async with (
        get_transport(transport)(secret=secret) as gen_transport,
        gen.engine,
        anyio.create_task_group() as tg,
    ):
        worker = GenerationWorker(gen, gen_transport)
        await worker.register()
        router = _TracingRouter(worker)
        backend = DisaggregatedBackend(
            router, "tiny", DisaggOptions(transport=transport, ctx_tp=ctx_tp, separate_process=False)
        )
        system = _System(
            transport,
            ctx_options,
            secret,
            gen,
            gen_transport,
            worker,
            router,
            Service(backend, tg, max_queued),
            tg,
            random.Random(seed ^ 0x5EED),
        )
        try:
            for _ in range(contexts):
                await system.start_context()
            yield system
        finally:
            await system.close()
            tg.cancel_scope.cancel()


# --- driving and judging --------------------------------------------------------------------------------


@define(eq=False)
class _Outcome:
    request: SoakRequest
    handle: RequestHandle
    routed: RoutedGeneration
    #: what the client read by iterating the handle
    read: list[int] = attrs.field(factory=list)
    result: CompletionResult | None = None


async def _client(outcome: _Outcome) -> None:
    request, handle = outcome.request, outcome.handle
    if request.client is Client.CANCEL:
        with anyio.move_on_after(request.cancel_after):
            await handle.wait()
        handle.cancel()
    else:
        stream = cast(AsyncGenerator[int, None], handle.__aiter__())
        try:
            async for token in stream:
                outcome.read.append(token)
                if request.client is Client.DISCONNECT and len(outcome.read) >= request.disconnect_after:
                    break
        except KvferryError:
            pass  # the result says it
        finally:
            await stream.aclose()
        if request.client is Client.DISCONNECT:
            handle.cancel()
    outcome.result = await handle.result()


async def _submit(system: _System, request: SoakRequest) -> _Outcome:
    handle = await system.service.submit(
        request.prompt,
        max_tokens=request.max_tokens,
        stop_ids=request.stop_ids,
        seed=request.seed,
        temperature=request.temperature,
        spec_k=request.spec_k,
    )
    # submit() awaits nothing: the router's latest generation is this request's
    routed = system.router.last
    assert routed is not None
    return _Outcome(request, handle, routed)


async def _drive(system: _System, plan: SoakPlan, concurrency: int, deadline: float) -> list[_Outcome]:
    """Submit the requests in order, each its gap after the previous one and once fewer than ``concurrency``
    are running (restarting context engines at the plan's points); wait until every client got its result, at
    most ``deadline`` seconds."""
    outcomes: list[_Outcome] = []
    restart_at = set(plan.restarts)
    slots = anyio.Semaphore(concurrency)

    async def client(outcome: _Outcome) -> None:
        try:
            await _client(outcome)
        finally:
            slots.release()

    with anyio.move_on_after(deadline):
        async with anyio.create_task_group() as clients:
            for request in plan.requests:
                if request.index in restart_at:
                    clients.start_soon(system.restart)
                await anyio.sleep(request.gap)
                await slots.acquire()
                outcome = await _submit(system, request)
                outcomes.append(outcome)
                clients.start_soon(client, outcome)
    return outcomes


def _judge(system: _System, outcome: _Outcome, expected: list[int]) -> str | None:
    """What is wrong with one request's outcome (None: nothing)."""
    request, result = outcome.request, outcome.result
    what = f"request {request.index} ({outcome.handle!r}, client {request.client.value})"
    if result is None:
        link = outcome.routed.link
        return f"{what} never ended; routed to {link!r}"
    tokens = list(result.token_ids)
    if request.client is Client.READ and outcome.read != tokens:
        return f"{what}: read {outcome.read}, its result holds {tokens}"
    reason = result.finish_reason
    if reason in (FinishReason.STOP, FinishReason.LENGTH):
        if result.error is not None or tokens != expected:
            return (
                f"{what} finished {reason.value} with {tokens}, expected {expected} (error {result.error!r})"
            )
        return None
    if tokens != expected[: len(tokens)]:
        return f"{what} ended {reason.value} with {tokens}: not a prefix of {expected}"
    if reason is FinishReason.CANCELLED:
        if request.client is Client.READ:
            return f"{what} was cancelled, and nobody cancelled it"
        return None
    if not isinstance(result.error, KvferryError):
        return f"{what} errored without a typed error: {result.error!r}"
    link = outcome.routed.link
    if link is None:
        began, ended = outcome.handle.submitted_at, outcome.handle.finished_at or 0.0
        if not any(a <= ended and began <= b for a, b in system.outages):
            return f"{what} found no context engine up, outside every restart: {result.error!r}"
        return None
    if outcome.routed.transfer is not None:
        return f"{what} failed after its cache landed (it decoded here): {result.error!r}"
    ended = outcome.handle.finished_at or 0.0
    if not any(c.link is link and c.killed_at is not None and c.killed_at <= ended for c in system.contexts):
        return f"{what} failed on a context engine not killed before it ended ({link!r}): {result.error!r}"
    return None


#: the name anyio gives the threads of its worker pool (engine steps, scatters, copies)
_ANYIO_WORKER = "AnyIO worker thread"


@frozen
class Resources:
    """What the process holds: open descriptors, threads (but anyio's worker threads: a pool bounded by its
    limiter, which keeps idle threads for a while), the generation transport's registrations."""

    fds: int
    threads: int
    registrations: int

    @classmethod
    def now(cls, system: _System) -> Resources:
        return cls(
            len(os.listdir("/proc/self/fd")),
            sum(1 for t in threading.enumerate() if t.name != _ANYIO_WORKER),
            system.gen_transport.statistics().registrations,
        )


async def _settled(condition: Callable[[], bool], seconds: float = SETTLE_DEADLINE) -> bool:
    with anyio.move_on_after(seconds):
        while not condition():  # noqa: ASYNC110 (polls state no event exposes)
            await anyio.sleep(0.01)
        return True
    return False


async def _leaks(
    system: _System, gen_initial: tuple[int, ...], outcomes: Sequence[_Outcome] = ()
) -> list[str]:
    """What did not come back once every request ended (empty: nothing)."""
    problems: list[str] = []
    with anyio.move_on_after(SETTLE_DEADLINE):
        await system.gen.engine.wait_idle()
    if not await _settled(lambda: counts(system.gen) == gen_initial):
        problems.append(f"generation pools {counts(system.gen)} != initial {gen_initial}")
    by_key = {o.routed.key: o for o in outcomes}
    for ctx in system.live:
        problems += await _context_leaks(ctx, by_key)
    for link in system.worker.links:
        stats = link.receiver.statistics()
        if stats["sessions"] or stats["quarantined"] or stats["staging_bytes"]:
            problems.append(f"receiver of {link!r} left {stats}")
        if link.in_flight or link.waiting:
            problems.append(f"{link!r} left {len(link.waiting)} prefills waiting")
    service = system.service.statistics()
    if service.active:
        problems.append(f"the service has {service.active} requests active")
    tx = system.gen_transport.statistics()
    if tx.peers != len(system.live) or tx.grants or tx.writes_in_flight:
        problems.append(f"generation transport: {tx}")
    if system.worker.statistics()["staging_used"]:
        problems.append(f"generation staging in use: {system.worker.statistics()}")
    return problems


async def _context_leaks(ctx: _Context, by_key: dict[str, _Outcome]) -> list[str]:
    worker = ctx.worker
    assert worker is not None
    problems = []
    if not await _settled(lambda: counts(ctx.built) == ctx.initial and worker.statistics()["held"] == 0):
        held = [_story(by_key.get(key)) or key for _, key in worker._held]
        problems.append(
            f"{ctx.name}: pools {counts(ctx.built)} != initial {ctx.initial}, {worker!r}, holding {held}"
        )
    registrations = worker.transport.statistics().registrations
    if registrations != ctx.registrations:
        problems.append(f"{ctx.name}: {registrations} registrations, {ctx.registrations} after it started")
    return problems


def _story(outcome: _Outcome | None) -> str | None:
    if outcome is None:
        return None
    r, result = outcome.request, outcome.result
    return (
        f"{outcome.routed.key}: request {r.index} client {r.client.value} cancel_after {r.cancel_after:.3f} "
        f"-> {None if result is None else (result.finish_reason.value, len(result.token_ids), result.error)}"
    )


def _no_growth(now: Resources, baseline: Resources) -> bool:
    return (
        now.fds <= baseline.fds
        and now.threads <= baseline.threads
        and now.registrations == baseline.registrations
    )


@frozen
class SoakReport:
    transport: str
    ctx_tp: int
    gen_tp: int
    seed: int
    requests: int
    completed: int
    cancelled: int
    errored: int
    #: tokens every request's client got, all together
    tokens: int
    restarts: int
    #: the measured run (warm-up and reference excluded)
    wall_seconds: float
    #: the reference process, from its start (after the warm-up, alongside the run) to its end
    reference_seconds: float
    #: transfers that landed, preemptions on the generation engine
    transfers: int
    preemptions: int
    #: requests routed to each context engine, in the order they started (the router spreads them)
    routed: tuple[int, ...]
    baseline: Resources
    final: Resources
    problems: tuple[str, ...]

    def summary(self) -> str:
        return (
            f"soak {self.transport} ctx_tp={self.ctx_tp} gen_tp={self.gen_tp} seed={self.seed}: "
            f"{self.requests} requests ({self.completed} completed, {self.cancelled} cancelled, "
            f"{self.errored} errored), {self.tokens} tokens, {self.restarts} context restarts, "
            f"{self.transfers} transfers, {self.preemptions} preemptions, routed to contexts {self.routed}, "
            f"{self.wall_seconds:.1f} s (reference alongside: {self.reference_seconds:.1f} s); fds {self.baseline.fds}->{self.final.fds}, "
            f"threads {self.baseline.threads}->{self.final.threads}; {len(self.problems)} problems"
        )


async def run_soak(
    requests: int,
    seed: int,
    transport: str = "local",
    ctx_tp: int = 2,
    gen_tp: int = 1,
    restarts: int = 2,
    *,
    contexts: int = 2,
    gen_pages: int = 49,
    ctx_pages: int = 97,
    max_running: int = 4,
    concurrency: int = 16,
    mean_gap: float = 0.02,
    mean_cancel: float = 0.5,
    deadline: float = 600.0,
) -> SoakReport:
    """Soak disaggregated serving with ``requests`` seeded random requests over ``transport`` (see the module
    docstring); ``contexts`` context engines are up at the start (restarts keep the count), at most
    ``concurrency`` requests run at once, ``deadline`` bounds the measured run. Checks never raise: read :attr:`SoakReport.problems`."""
    plan = make_plan(requests, seed, restarts, mean_gap, mean_cancel)
    async with _system(
        transport,
        ctx_tp,
        gen_tp,
        contexts=contexts,
        gen_pages=gen_pages,
        ctx_pages=ctx_pages,
        max_running=max_running,
        max_queued=requests + len(plan.warm_up) + 1,
        seed=seed,
    ) as system:
        return await _soak(system, plan, concurrency, deadline)


async def _soak(system: _System, plan: SoakPlan, concurrency: int, deadline: float) -> SoakReport:
    problems: list[str] = []
    gen_initial = counts(system.gen)
    warm = [await _submit(system, r) for r in plan.warm_up]
    with anyio.fail_after(deadline):
        async with anyio.create_task_group() as tg:
            for outcome in warm:
                tg.start_soon(_client, outcome)
    problems += await _leaks(system, gen_initial)
    baseline = Resources.now(system)
    async with anyio.create_task_group() as tg:
        # after the baseline, closed before the final count: its pipes and watcher are not counted
        ref = await ReferenceProcess.start(plan)
        tg.start_soon(ref.run)
        try:
            began = time.perf_counter()
            outcomes = await _drive(system, plan, concurrency, deadline)
            wall = time.perf_counter() - began
            problems += await _leaks(system, gen_initial, outcomes)
            expected = await ref.result(deadline)
        finally:
            await ref.close()
    if not await _settled(lambda: _no_growth(Resources.now(system), baseline), 5.0):
        problems.append(f"resources {Resources.now(system)} grew from {baseline} after the warm-up")
    final = Resources.now(system)
    problems += system.failures
    problems += [p for o in warm + outcomes if (p := _judge(system, o, expected[o.request.index]))]
    if len(outcomes) < len(plan.requests):
        problems.append(f"only {len(outcomes)} of {len(plan.requests)} requests were submitted in time")
    results = [o.result for o in outcomes if o.result is not None]
    reasons = [r.finish_reason for r in results]
    return SoakReport(
        system.transport,
        system.ctx_options.tp,
        len(system.gen.arenas),
        plan.seed,
        len(outcomes),
        sum(1 for r in reasons if r in (FinishReason.STOP, FinishReason.LENGTH)),
        reasons.count(FinishReason.CANCELLED),
        reasons.count(FinishReason.ERROR),
        sum(len(r.token_ids) for r in results),
        system.restarts,
        wall,
        ref.seconds,
        system.worker.statistics()["transfers"],
        system.gen.engine.scheduler.statistics().num_preemptions,
        tuple(sum(1 for o in outcomes if o.routed.link is c.link) for c in system.contexts),
        baseline,
        final,
        tuple(problems),
    )
