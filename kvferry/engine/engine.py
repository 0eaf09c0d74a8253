"""The anyio engine: many concurrent ``generate()`` streams over one step loop.

::

    async with Engine(runner, cache) as engine:
        async for token in engine.generate(prompt_ids, max_tokens=16, spec_k=2):
            ...

The engine owns one background task, the step loop, in a task group that lives exactly as long as the
``async with`` block. That task group runs in a task of the event loop that the engine starts and owns (not
in the task that enters the block), so ``async with`` may be entered in one task and left in another: an async
fixture of pytest-asyncio or anyio sets up and tears down in different tasks. Leaving the block still cancels
the loop and waits for it (shielded), as a task group of the caller's would. Each iteration of the loop:

1. frees what cancelled requests held (the caller left its ``async for``, or a cancel scope hit it);
2. asks the :class:`~kvferry.engine.scheduler.Scheduler` for a step plan (admission, chunks, preemption);
3. runs the model step: the drafter proposes ``k`` tokens for every speculative decode, then the target runs
   every prompt chunk and every ``1 + k`` verify window in one batch. With ``step_in_thread`` (the default)
   this runs in a worker thread so the event loop stays responsive; the scheduler and the manager are only
   ever touched from the loop. With ``overlap`` too, the loop works for the next step while this one runs
   (below); otherwise it touches them only between steps. With ``launch_on_loop`` (on CUDA) a step of plain
   decodes is launched from the loop instead, and its tokens polled while the device computes;
4. samples, accepts drafts, commits the new tokens to the manager, records ``num_accepted`` for the replay
   state, and wakes every waiting stream once (each reads its request's new tokens).

Overlap (``EngineConfig.overlap``, with ``step_in_thread``): while step N's model runs in its thread, the loop
hands step N-1's commits to the manager (the prefix index's hashing) and grows the pages step N+1's plain decodes
will need, so the next schedule finds them done; and it wakes the streams for step N-1's tokens then, so they take
them while the model computes (a cancel seen then frees its request one step later). Neither the commits nor the
grows touch what the step reads: commits change no block table or slot (commits that take a recurrent snapshot,
which copies a live slot, are handed over before the step instead), and a grow only appends pages past the ones
the step uses. The next step's plan itself (which requests, their tokens) and sampling stay between steps: they
depend on step N's sampled tokens. The tokens are the same with and without overlap.

Cancellation: a request is freed at the next step boundary (never while a step that reads its pages runs).
Leaving the engine's ``async with`` cancels the loop, waits for a running step to end, then (shielded) closes
every request's cache and ends every open stream with :class:`~kvferry.errors.RequestAborted`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any

import anyio
import attrs
import torch
from anyio.abc import TaskGroup, TaskStatus
from attrs import define

from kvferry.engine.config import EngineConfig, EngineStatistics, StepTiming
from kvferry.engine.conversation import Conversation, ConversationCache, drop_past_host_memory
from kvferry.engine.generation import Generation
from kvferry.engine.model_runner import DraftItem, ForwardItem, ModelRunner
from kvferry.engine.model_step import launch_model, launch_ready, plain_decodes, run_model
from kvferry.engine.moves import move_cache
from kvferry.engine.overlap import OverlapWindow, run_launched, run_overlapped
from kvferry.engine.request import Request, RequestState, SamplingParams
from kvferry.engine.resize import RebalanceCall, rebalance_pools
from kvferry.engine.sampling import accept_drafts, sample_seeded
from kvferry.engine.scheduler import CacheOps, ItemKind, Scheduler, StepPlan
from kvferry.errors import ConfigError, EngineClosed, RequestAborted

__all__ = [
    "DraftItem",
    "Engine",
    "EngineConfig",
    "EngineStatistics",
    "ForwardItem",
    "ModelRunner",
    "StepTiming",
]


def start_owned_task(function: Callable[..., Coroutine[Any, Any, None]], *args: object) -> object:
    """Start ``function(*args)`` in a new task of the running event loop that belongs to no task group of the
    caller's (asyncio: a task, returned so that its owner keeps it referenced; trio: a system task). The
    function must handle its own errors and end when its owner asks it to (or when the event loop ends)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not asyncio: trio
        import trio  # type: ignore[import-not-found,unused-ignore]

        trio.lowlevel.spawn_system_task(function, *args)
        return None
    return loop.create_task(function(*args), name=getattr(function, "__qualname__", "kvferry task"))


def unwrap_group(exc: BaseException) -> BaseException:
    """The one exception inside (nested) single-member exception groups; ``exc`` otherwise."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


# --- the engine --------------------------------------------------------------------------------------------


@define(eq=False)
class Engine:
    """Serves :meth:`generate` streams from one step loop over a model runner and a cache manager.

    ``cache`` is the manager (or an adapter of it) the scheduler drives; ``runner`` reads the same caches.
    Not thread-safe: use it from the event loop that entered it.
    """

    runner: ModelRunner
    cache: CacheOps
    config: EngineConfig = attrs.field(factory=EngineConfig)
    scheduler: Scheduler = attrs.field(init=False)
    #: set (and replaced) after every step and every batch of request endings: wakes every stream at once,
    #: so delivering tokens costs the step nothing per request
    _step_done: anyio.Event = attrs.field(factory=anyio.Event, init=False)
    _requests: dict[int, Request] = attrs.field(factory=dict, init=False)
    #: how many of them sample with a seed (none: a step has no seeded draws to batch)
    _num_seeded: int = attrs.field(default=0, init=False)
    _to_cancel: list[Request] = attrs.field(factory=list, init=False)
    _conversations: dict[int, Conversation] = attrs.field(factory=dict, init=False)
    _rebalances: list[RebalanceCall] = attrs.field(factory=list, init=False)
    _rebalance_callbacks: list[Callable[[Sequence[Any]], None]] = attrs.field(factory=list, init=False)
    #: suspends (True) and resumes (False) asked for by requests' owners, done at the next step boundary
    _holds: list[tuple[Request, bool]] = attrs.field(factory=list, init=False)
    #: transferred requests whose cache arrived, with their first tokens (they land at the next step boundary)
    _landed: list[tuple[Request, int]] = attrs.field(factory=list, init=False)
    _wakeup: anyio.Event = attrs.field(factory=anyio.Event, init=False)
    #: the last step's tokens are appended but the streams not woken yet (overlap: they wake once the next step
    #: runs, so that they take their tokens meanwhile; or before the loop idles)
    _deliver: bool = attrs.field(default=False, init=False)
    _idle: anyio.Event = attrs.field(factory=anyio.Event, init=False)
    _task_group: TaskGroup | None = attrs.field(default=None, init=False)
    #: set by __aexit__ (stop the loop) / by the owner task when it has ended and everything is freed
    _stop: anyio.Event | None = attrs.field(default=None, init=False)
    _done: anyio.Event | None = attrs.field(default=None, init=False)
    #: the task that runs the loop's task group (kept referenced while it runs)
    _owner: object = attrs.field(default=None, init=False)
    #: what ended the loop on its own (None: it was stopped)
    _crash: BaseException | None = attrs.field(default=None, init=False)
    _closed: bool = attrs.field(default=False, init=False)
    _next_id: int = attrs.field(default=0, init=False)
    _counts: dict[str, int] = attrs.field(
        factory=lambda: dict.fromkeys(
            ("steps", "generated", "drafted", "accepted", "finished", "cancelled", "failed", "rebalances"), 0
        ),
        init=False,
    )
    #: the last steps' timings (a bounded window, for benchmarks and monitoring)
    step_timings: deque[StepTiming] = attrs.field(factory=lambda: deque(maxlen=4096), init=False)
    #: tokens (prompt and output) of the last finished requests (a bounded window, for auto-balance)
    recent_lengths: deque[int] = attrs.field(factory=lambda: deque(maxlen=256), init=False)
    _host_seconds: float = attrs.field(default=0.0, init=False)
    #: when the last step ended (None: no step yet, or the loop idled since)
    _last_step_end: float | None = attrs.field(default=None, init=False)
    _model_seconds: float = attrs.field(default=0.0, init=False)

    def __attrs_post_init__(self) -> None:
        self.scheduler = Scheduler(self.cache, self.config.scheduler)

    # --- lifetime -----------------------------------------------------------------------------------------

    async def __aenter__(self) -> Engine:
        if self._closed or self._stop is not None:
            raise EngineClosed("an Engine can be entered once")
        self._stop = anyio.Event()
        self._done = anyio.Event()
        started = anyio.Event()
        self._owner = start_owned_task(self._own, started)
        try:
            await started.wait()
        except BaseException:
            # cancelled while starting: stop the loop we started before giving up
            self._stop.set()
            with anyio.CancelScope(shield=True):
                await self._done.wait()
            raise
        if self._crash is not None:
            raise self._crash
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if self._stop is None or self._done is None:
            raise EngineClosed("the engine was not entered")
        self._stop.set()
        with anyio.CancelScope(shield=True):
            # the loop is cancelled; a running step ends first, then every request is freed
            await self._done.wait()
        crash, self._crash = self._crash, None
        if crash is not None and exc is None:
            # the body's own exception wins; a loop that failed on its own (a bug) is raised here, unwrapped
            raise crash
        return None

    async def _own(self, started: anyio.Event) -> None:
        """The engine's own task: the step loop's task group, from ``__aenter__`` until ``__aexit__`` (or the event
        loop itself ends, cancelling this task)."""
        assert self._stop is not None and self._done is not None
        try:
            async with anyio.create_task_group() as tg:
                self._task_group = tg
                await tg.start(self._step_loop)
                started.set()
                await self._stop.wait()
                tg.cancel_scope.cancel()
        except Exception as exc:
            self._crash = unwrap_group(exc)
        finally:
            # synchronous: no cancellation can interrupt it (also when the event loop cancels this task)
            self._shutdown(self._crash)
            self._done.set()
            started.set()

    def _shutdown(self, error: BaseException | None = None) -> None:
        self._closed = True
        for request in list(self._requests.values()):
            if error is None:
                self._end(request, RequestState.CANCELLED)
            else:
                self._end(request, RequestState.FAILED, error)
        self._to_cancel.clear()
        for call in self._rebalances:
            call.error = EngineClosed("the engine stopped before the rebalance")
            call.done.set()
        self._rebalances.clear()
        self._idle.set()
        self._notify()

    # --- requests -----------------------------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: Iterable[int],
        *,
        max_tokens: int,
        stop_ids: Iterable[int] = (),
        seed: int | None = None,
        temperature: float = 1.0,
        spec_k: int = 0,
    ) -> Generation:
        """A stream of generated tokens for ``prompt_ids`` (greedy unless ``seed`` is given).

        Stops after ``max_tokens`` tokens or after a token in ``stop_ids`` (which is yielded). ``spec_k`` drafts
        per step (0: no speculative decoding; at most the engine's ``max_spec_k``).

        :raises ~kvferry.errors.ConfigError: bad arguments (nothing is submitted)
        :raises ~kvferry.errors.EngineClosed: the engine is not running
        """
        request = self._new_request(
            self._next_id,
            prompt_ids,
            max_tokens=max_tokens,
            stop_ids=stop_ids,
            seed=seed,
            temperature=temperature,
            spec_k=spec_k,
        )
        self._next_id += 1
        return Generation(self, request)

    def conversation(self, *, spec_k: int = 0) -> Conversation:
        """A new multi-turn conversation (:class:`~kvferry.engine.conversation.Conversation`): its turns keep
        the whole cache between them. ``spec_k``: drafts per step for every turn.

        :raises ~kvferry.errors.ConfigError: bad ``spec_k``, or this engine's cache cannot keep conversations.
        """
        if not isinstance(self.cache, ConversationCache):
            raise ConfigError("this engine's cache cannot keep conversations")
        if not 0 <= spec_k <= self.config.scheduler.max_spec_k:
            raise ConfigError(f"spec_k {spec_k} outside [0, {self.config.scheduler.max_spec_k}]")
        conversation = Conversation(self, self.cache, self._next_id, spec_k)
        self._next_id += 1
        self._conversations[conversation.conversation_id] = conversation
        return conversation

    def _new_request(
        self,
        request_id: int,
        prompt_ids: Iterable[int],
        *,
        max_tokens: int,
        stop_ids: Iterable[int],
        seed: int | None,
        temperature: float,
        spec_k: int,
    ) -> Request:
        prompt = tuple(int(t) for t in prompt_ids)
        vocab = self.runner.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ConfigError(f"prompt token ids must be in [0, {vocab})")
        if spec_k > self.config.scheduler.max_spec_k:
            raise ConfigError(
                f"spec_k {spec_k} exceeds the engine's max_spec_k {self.config.scheduler.max_spec_k}"
            )
        return Request(
            request_id,
            prompt,
            max_tokens=max_tokens,
            stop_ids=stop_ids,
            sampling=SamplingParams(seed=seed, temperature=temperature),
            spec_k=spec_k,
        )

    def _generation(self, request: Request) -> Generation:
        return Generation(self, request)

    async def rebalance(
        self,
        *,
        num_pages: int | None = None,
        num_slots: int | None = None,
        num_draft_pages: int | None = None,
    ) -> None:
        """Resize the cache pools while serving (None: a size unchanged); returns once done.

        At the next step boundary every running request is suspended, every cache moves to the host (each is
        restored on its next resume; the prefix cache is dropped), the pools are rebuilt with the new sizes (the
        replay buffers grow with the state pool), the model and the drafter are bound to the new memory, the
        callbacks of :meth:`on_rebalance` run, and the suspended requests are admitted again: their tokens are
        those of a run without a rebalance. A disaggregated engine's worker then registers the new memory and
        sends its peers the new page tables, before it next transfers at the latest (:meth:`Worker.publish_tables
        <kvferry.disagg.roles.worker.Worker.publish_tables>`).

        A cancel while waiting leaves the rebalance asked for (it still happens at the next step boundary).

        :raises ~kvferry.errors.RebalanceRefused: a transfer may touch the pools (a request waits for its cache,
            a cache is marked for a transfer or quarantined), a request would not fit the new pools, or the
            sizes are invalid; the pools are unchanged (running requests resume where they were).
        :raises ~kvferry.errors.ConfigError: this engine's cache or runner cannot be rebalanced.
        :raises ~kvferry.errors.EngineClosed: the engine is not running.
        """
        if self._closed or self._task_group is None:
            raise EngineClosed("the engine is not running (use it inside `async with engine:`)")
        if getattr(self.cache, "rebalance", None) is None or getattr(self.runner, "rebind", None) is None:
            raise ConfigError("this engine's cache or runner cannot be rebalanced")
        call = RebalanceCall(
            {"num_pages": num_pages, "num_slots": num_slots, "num_draft_pages": num_draft_pages}
        )
        self._rebalances.append(call)
        self._busy()
        await call.done.wait()
        if call.error is not None:
            raise call.error

    @contextlib.contextmanager
    def admissions_paused(self) -> Iterator[None]:
        """While inside, no waiting request is admitted (running ones go on and free what they hold at their end):
        the room goes to what the caller needs first (a context engine bringing a held cache back for its
        push). Nestable; leaving it (a cancel too) lets admissions go on at the next step."""
        self.scheduler.admissions_paused += 1
        try:
            yield
        finally:
            self.scheduler.admissions_paused -= 1
            self._busy()

    def on_rebalance(self, callback: Callable[[Sequence[Any]], None]) -> None:
        """Call ``callback(arenas)`` (the new memory, one per rank) after each rebalance, before any step runs
        on the new pools. A callback that raises fails that rebalance's caller (the pools are already new)."""
        self._rebalance_callbacks.append(callback)

    def _rebalance_now(self, call: RebalanceCall) -> None:
        """One rebalance at a step boundary (see :meth:`rebalance`)."""
        if rebalance_pools(self.cache, self.runner, self.scheduler, call, self._rebalance_callbacks):
            self._counts["rebalances"] += 1
        if self.config.host_memory is not None:
            self._check_host_memory()

    def _forget_conversation(self, conversation: Conversation) -> None:
        self._conversations.pop(conversation.conversation_id, None)

    def _check_host_memory(self) -> None:
        """Past ``host_memory`` bytes of caches on the host, drop idle conversations there (least recently used
        first); the running requests' host bytes count too but are never dropped."""
        limit = self.config.host_memory
        nbytes = getattr(self.cache, "host_nbytes", None)
        if limit is None or nbytes is None or not self._conversations:
            return
        running = sum(nbytes(rid) for rid, r in self._requests.items() if r.state is not RequestState.WAITING)
        drop_past_host_memory(self._conversations.values(), limit - running)

    def _submit(self, request: Request) -> None:
        if self._closed or self._task_group is None:
            raise EngineClosed("the engine is not running (use it inside `async with engine:`)")
        self.scheduler.add(request)
        self._requests[request.request_id] = request
        self._num_seeded += request.sampling.seed is not None
        self._busy()

    # --- requests whose prompt another engine prefilled ----------------------------------------------------

    async def admit_transfer(self, generation: Generation) -> None:
        """Queue ``generation``'s request as one whose prompt is prefilled elsewhere and wait until the scheduler
        admits it (in arrival order, with every other request): it then holds a batch row, a state slot and
        pages for its whole prompt (the cache's block table), and waits in TRANSFERRING for its cache. Call
        :meth:`transfer_landed` when the cache arrived, or ``generation.cancel()`` to give everything back.

        A cancel while waiting leaves the request queued: the caller cancels the generation (its ``finally``).

        :raises ~kvferry.errors.RequestAborted: the request ended before it was admitted (the engine closed).
        :raises ~kvferry.errors.EngineClosed: the engine is not running.
        """
        request = generation.request
        request.awaits_transfer = True
        generation.submit()
        while request.state is RequestState.WAITING:
            await self._step_done.wait()
        if request.state is not RequestState.TRANSFERRING:
            raise RequestAborted(
                f"request {request.request_id} ended {request.state.name} before its transfer"
            )

    def transfer_landed(self, generation: Generation, first_token: int) -> None:
        """The cache of ``generation``'s TRANSFERRING request is written: at the next step boundary its prompt is
        committed, ``first_token`` becomes its first output and it decodes (iterate the generation for its
        tokens, the first one included). Nothing happens if the request ended meanwhile."""
        self._landed.append((generation.request, int(first_token)))
        self._busy()

    def _notify(self) -> None:
        self._deliver = False
        self._step_done.set()
        self._step_done = anyio.Event()

    def _cancel(self, request: Request) -> None:
        """Mark ``request`` for freeing at the next step boundary (no-op once it ended)."""
        if request.request_id in self._requests and request not in self._to_cancel:
            self._to_cancel.append(request)
            self._busy()

    def _hold(self, request: Request, *, suspend: bool) -> None:
        """Ask for ``request`` to be suspended (or resumed) at the next step boundary."""
        if request.request_id not in self._requests or self._requests[request.request_id] is not request:
            if request.state.is_terminal:
                raise RequestAborted(f"request {request.request_id} ended {request.state.name}")
            raise ConfigError(f"request {request.request_id} is not submitted")
        if suspend and (request.awaits_transfer or request.state is RequestState.TRANSFERRING):
            raise ConfigError(
                f"request {request.request_id}: its cache is in transit; it cannot be suspended"
            )
        self._holds = [(r, s) for r, s in self._holds if r is not request]  # the last wish wins
        self._holds.append((request, suspend))
        self._busy()

    async def _offload(self, request: Request) -> None:
        if request.state is not RequestState.SUSPENDED:
            raise ConfigError(
                f"request {request.request_id} is {request.state.name}: suspend it before offloading it"
            )
        if self.scheduler.holds_cache(request):
            await self._move(request.request_id, to_host=True)

    async def _move(self, request_id: int, *, to_host: bool) -> bool:
        """Move a suspended cache to the host (or back) with its copies off the event loop; whether it moved.
        Meanwhile the scheduler leaves the request waiting (a cancel rolls the move back)."""
        moved = await move_cache(self.cache, request_id, to_host=to_host)
        if self.config.host_memory is not None:
            self._check_host_memory()
        return moved

    def _busy(self) -> None:
        if self._idle.is_set():
            self._idle = anyio.Event()
        self._wakeup.set()

    def _end(self, request: Request, state: RequestState, error: BaseException | None = None) -> None:
        """Terminal bookkeeping: close the cache, forget runner state (the stream sees it at the next notify)."""
        if request.request_id not in self._requests:
            return
        if error is not None and request.error is None:
            request.error = error
        kept = False
        try:
            kept = self.scheduler.finish(request, state)
        finally:
            if not kept:
                self.runner.release(request.request_id)
            del self._requests[request.request_id]
            self._num_seeded -= request.sampling.seed is not None
            self._counts[request.state.name.lower()] += 1
            if request.state is RequestState.FINISHED:
                self.recent_lengths.append(request.num_tokens)
            if request.on_end is not None:
                request.on_end(request, kept)

    # --- the loop -----------------------------------------------------------------------------------------

    async def _step_loop(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            self._reap()
            if not self.scheduler.has_work and not self._landed and not self._holds and not self._rebalances:
                if self._deliver:
                    self._notify()
                self._last_step_end = None
                self._idle.set()
                await self._wakeup.wait()
                self._wakeup = anyio.Event()
                continue
            await self._step()
            # let consumers take their tokens (and cancel) before the next step (with overlap: they are woken
            # while the next step runs; a cancel then frees its request one step later)
            await anyio.lowlevel.checkpoint()
            if not self.config.step_in_thread:
                # and a turn without a step: anyio delivers a cancellation only to a task whose wake-up is not
                # pending, and a step run on the loop wakes every consumer just before each delivery attempt,
                # so a timeout or Ctrl-C around them would never arrive while the engine is busy
                await anyio.lowlevel.checkpoint()

    def _reap(self) -> None:
        """Between steps: end the cancelled requests, suspend and resume what their owners asked for, then land
        the transfers that arrived."""
        if self._to_cancel:
            while self._to_cancel:
                self._end(self._to_cancel.pop(), RequestState.CANCELLED)
            self._notify()
        if self._holds:
            holds, self._holds = self._holds, []
            for request, suspend in holds:
                if request.request_id not in self._requests:
                    continue  # ended meanwhile
                if suspend and request.state is not RequestState.SUSPENDED:
                    self.scheduler.suspend(request)
                elif not suspend and request.state is RequestState.SUSPENDED:
                    self.scheduler.resume(request)
            self._notify()
        if self._rebalances:
            calls, self._rebalances = self._rebalances, []
            for call in calls:
                self._rebalance_now(call)
                call.done.set()
            self._notify()
        if self._landed:
            landed, self._landed = self._landed, []
            for request, first_token in landed:
                if request.request_id in self._requests and request.state is RequestState.TRANSFERRING:
                    self.scheduler.landed(request, first_token)
                    if request.finish_reason is not None:
                        self._end(request, RequestState.FINISHED)
            self._notify()

    async def wait_idle(self) -> None:
        """Wait until no request is waiting or running and every cancellation is processed."""
        while self.scheduler.has_work or self._to_cancel or self._landed or self._holds:
            await self._idle.wait()

    async def _step(self) -> None:
        t0 = time.perf_counter()
        overlap = self.config.overlap and self.config.step_in_thread
        plan = self.scheduler.schedule(defer=overlap)
        for request in plan.failed:
            self._end(request, RequestState.FAILED)
        if plan.failed or plan.transfers:
            self._notify()  # and wake the callers whose transfers may start
        if plan.is_empty:
            self.scheduler.flush()  # no step to hide deferred commits under: the manager gets them now
            if self._deliver:
                self._notify()
            self._host_seconds += time.perf_counter() - t0
            if not plan.transfers:
                await anyio.sleep(0.001)  # everyone is blocked on memory held by suspended requests: back off
            return
        t1 = time.perf_counter()
        prepare = getattr(self.runner, "prepare_step", None)
        finish = getattr(self.runner, "finish_step", None)
        window = OverlapWindow()
        try:
            if prepare is not None:
                prepare()
            plain = plain_decodes(plan)
            if plain and self.config.launch_on_loop and launch_ready(self.runner, plan):
                (drafts, logits), argmax = await run_launched(
                    functools.partial(launch_model, self.runner, plan, self.config.launch_spin_seconds),
                    functools.partial(self._overlap_work, plan) if overlap else None,
                    window,
                )
            elif overlap:
                drafts, logits, argmax = await run_overlapped(
                    functools.partial(run_model, self.runner, plan, plain),
                    functools.partial(self._overlap_work, plan),
                    window,
                )
            elif self.config.step_in_thread:
                drafts, logits, argmax = await anyio.to_thread.run_sync(run_model, self.runner, plan, plain)
            else:
                drafts, logits, argmax = run_model(self.runner, plan, plain)
            if finish is not None:
                finish()
        except Exception as exc:
            if window.error is not None:
                raise window.error from None  # a manager bug, as if raised by schedule: the loop crashes
            # a failed model step fails every request in it; the engine keeps serving the rest
            for item in plan.items:
                self._end(item.request, RequestState.FAILED, exc)
            self._notify()
            return
        if window.error is not None:
            raise window.error
        t2 = time.perf_counter()
        self._apply(plan, drafts, logits, argmax)
        if self.config.host_memory is not None:
            self._check_host_memory()  # admissions may have moved suspended caches to the host
        t3 = time.perf_counter()
        if overlap:
            self._deliver = True  # the streams wake while the next step runs (see _overlap_work)
        else:
            self._notify()
        self._counts["steps"] += 1
        self._host_seconds += (t1 - t0) + (t3 - t2)
        self._model_seconds += t2 - t1
        self.step_timings.append(
            StepTiming(
                num_items=len(plan.items),
                num_tokens=plan.num_tokens,
                num_decodes=sum(1 for item in plan.items if item.kind is ItemKind.DECODE),
                schedule_seconds=t1 - t0,
                model_seconds=t2 - t1,
                apply_seconds=t3 - t2,
                overlapped_seconds=window.seconds,
                between_seconds=0.0 if self._last_step_end is None else t0 - self._last_step_end,
            )
        )
        self._last_step_end = time.perf_counter()

    def _overlap_work(self, plan: StepPlan) -> None:
        """While ``plan``'s model runs: the streams wake for the last step's tokens (they take them meanwhile), its
        commits reach the manager, the next step's decodes grow."""
        if self._deliver:
            self._notify()
        self.scheduler.flush()
        self.scheduler.grow_ahead(plan)

    def _apply(
        self, plan: StepPlan, drafts: dict[int, tuple[int, ...]], logits: torch.Tensor, argmax: list[int]
    ) -> None:
        # NOTE: runs for every request every step; kept free of helper calls where it is cheap to do so
        offset = generated = 0
        decode, requests, scheduler = ItemKind.DECODE, self._requests, self.scheduler
        # plain greedy decodes that go on, committed together (in order: before any other commit)
        plain: list[Request] = []
        sampled = sample_seeded(plan.items, logits) if self._num_seeded else {}
        for index, item in enumerate(plan.items):
            request = item.request
            if (
                item.kind is decode
                and not item.num_drafts
                and not request.spec_k
                and request.sampling.seed is None
                and request.finish_reason is None
            ):
                # the common item: Request.append_tokens and Scheduler.commit for one greedy token, inlined
                token = argmax[offset]
                offset += 1
                if request.request_id not in requests:
                    continue
                output = request.output_ids
                output.append(token)
                generated += 1
                if token in request.stop_ids:
                    request.finish_reason = "stop"
                elif len(output) >= request.max_tokens:
                    request.finish_reason = "length"
                else:
                    plain.append(request)
                    continue
                if plain:
                    scheduler.commit_decodes(plain)
                    plain = []
                scheduler.commit(request, item.start + 1)
                self._end(request, RequestState.FINISHED)
                continue
            if plain:
                scheduler.commit_decodes(plain)
                plain = []
            if item.kind is decode:
                rows = 1 + item.num_drafts
            else:
                rows = 1 if item.start + len(item.token_ids) == request.num_prompt else 0
            first, offset = offset, offset + rows
            if request.request_id not in self._requests:
                continue  # already ended (cannot happen between schedule and apply, but stay safe)
            greedy = request.sampling.seed is None
            verify, pending = False, 0
            if item.kind is not decode:
                end = item.start + len(item.token_ids)
                new: list[int] = []
                if rows:
                    new = argmax[first:offset] if greedy else sampled[index]
            else:
                targets = argmax[first:offset] if greedy else sampled[index]
                if request.spec_k:
                    # speculating requests always decode as verify windows (also with 0 drafts): the slot stays
                    # at the window's start, so a snapshot boundary there is never stepped over
                    proposal = drafts.get(request.request_id, ())
                    accepted = accept_drafts(proposal, targets) if proposal else 0
                    boundary = self.cache.next_snapshot_boundary(request.request_id)
                    if boundary is not None and item.start < boundary < item.start + 1 + accepted:
                        # stop the window at the snapshot boundary: the next step starts there, its replay
                        # brings the slot exactly to it and the manager can snapshot it. The tokens stay the
                        # same (the drafts cut off here match the target and are proposed again).
                        accepted = boundary - item.start - 1
                    if proposal:
                        request.record_draft(proposal, accepted)
                        self._counts["drafted"] += len(proposal)
                        self._counts["accepted"] += accepted
                    new = [*proposal[:accepted], targets[accepted]]
                    verify = True
                else:
                    new = targets[:1]
                    end = item.start + 1
            kept = len(request.append_tokens(new))
            self._counts["generated"] += kept
            if verify:
                # a stop token or max_tokens may keep fewer than the window accepted: only the positions whose
                # tokens the request keeps are committed (a kept cache holds exactly the request's tokens).
                # A verify step leaves them in the replay buffers, not in the slot
                self.runner.record_accepted(request.request_id, kept)
                end, pending = item.start + kept, kept
            # commit also on the last step: its blocks and snapshots stay in the prefix cache for a next turn
            self.scheduler.commit(request, end, num_pending_replay=pending)
            if request.finish_reason is not None:
                self._end(request, RequestState.FINISHED)
        if plain:
            scheduler.commit_decodes(plain)
        self._counts["generated"] += generated

    # --- introspection ------------------------------------------------------------------------------------

    def statistics(self) -> EngineStatistics:
        s = self.scheduler.statistics()
        c = self._counts
        return EngineStatistics(
            num_steps=c["steps"],
            num_generated=c["generated"],
            num_drafted=c["drafted"],
            num_accepted=c["accepted"],
            num_waiting=s.num_waiting,
            num_running=s.num_running,
            num_finished=c["finished"],
            num_cancelled=c["cancelled"],
            num_failed=c["failed"],
            host_seconds=self._host_seconds,
            model_seconds=self._model_seconds,
        )

    def __repr__(self) -> str:
        s = self.statistics()
        state = "closed" if self._closed else ("running" if self._task_group is not None else "new")
        return (
            f"<Engine {state} [{s.num_running} running, {s.num_waiting} waiting | steps {s.num_steps}, "
            f"tokens {s.num_generated}, accepted {s.num_accepted}/{s.num_drafted}]>"
        )
