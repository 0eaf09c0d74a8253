"""The router: one ``generate()`` stream over a context engine (prefill) and a generation engine (decode).

The caller sees exactly the stream of aggregated serving: the first token (sampled by the context engine at the
end of the prompt), then the generation engine's tokens. Between the two, the request's cache moves.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import AsyncIterator, Iterable

import anyio
import attrs
from attrs import define

from kvferry.disagg.protocol import ContextRequest, PeerInfo
from kvferry.disagg.roles import GenerationWorker
from kvferry.disagg.roles.generation import ContextLink
from kvferry.disagg.session import TransferStatistics
from kvferry.engine.conversation import Conversation
from kvferry.engine.generation import Generation
from kvferry.errors import ConfigError, RequestTooLarge, TransferError

__all__ = ["RoutedGeneration", "Router"]


@define(eq=False)
class RoutedGeneration:
    """One routed request: iterate it once for its tokens; afterwards read its draft history and transfer."""

    router: Router
    key: str
    prompt: tuple[int, ...]
    max_tokens: int
    seed: int | None
    temperature: float
    spec_k: int
    stop_ids: tuple[int, ...]
    tokens: list[int] = attrs.field(factory=list)
    generation: Generation | None = None
    transfer: TransferStatistics | None = None
    #: ``time.perf_counter()`` when the generation engine admitted it (None: not yet, or never: not held)
    admitted_at: float | None = None
    #: the context engine it was routed to (None: not yet)
    link: ContextLink | None = None
    #: the generation engine's conversation this request is a turn of (``prompt`` is then its whole history
    #: and ``turn_prompt`` the turn's new tokens)
    conversation: Conversation | None = None
    turn_prompt: tuple[int, ...] = ()
    _finished: bool = False

    @property
    def ended(self) -> bool:
        """Whether its stream is over."""
        return self._finished

    def __aiter__(self) -> AsyncIterator[int]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[int]:
        try:
            link = self.link = await self.router.acquire()
            lease = _Lease(self.router, link)
            try:
                async for token in self._routed(link, lease):
                    yield token
            finally:
                lease.release()
        finally:
            self._finished = True

    async def _routed(self, link: ContextLink, lease: _Lease) -> AsyncIterator[int]:
        worker = self.router.worker
        handoff = await worker.prefill_remote(
            ContextRequest(
                self.key,
                self.prompt,
                self.max_tokens,
                self.seed,
                self.temperature,
                self.spec_k,
                self.stop_ids,
            ),
            link,
        )
        self.tokens.append(handoff.first_token)
        if not handoff.held:
            lease.release()  # the context side is done with it
            if self.conversation is not None:
                self.conversation.answered_elsewhere(self.turn_prompt, self.tokens)
            yield handoff.first_token
            return
        yield handoff.first_token
        engine = worker.engine
        if self.conversation is not None:
            generation = self.conversation.turn(
                self.turn_prompt,
                max_tokens=self.max_tokens,
                stop_ids=self.stop_ids,
                seed=self.seed,
                temperature=self.temperature,
                awaits_transfer=True,
            )
        else:
            generation = engine.generate(
                self.prompt,
                max_tokens=self.max_tokens,
                stop_ids=self.stop_ids,
                seed=self.seed,
                temperature=self.temperature,
                spec_k=self.spec_k,
            )
        self.generation = generation
        request = generation.request
        rid = request.request_id
        try:
            # a batch row, pages and a slot, in arrival order: the context side holds the cache until then
            await engine.admit_transfer(generation)
            self.admitted_at = request.admitted_at
            worker.install_drafter_state(rid, self.prompt, handoff, self.spec_k)
            self.transfer = await worker.receive(rid, self.prompt, self.key, link)
            # the slot holds the state the context engine computed: a kept turn's replay state must not apply
            for manager in worker.cache.managers:
                manager.drop_replay(rid)
        except BaseException:
            generation.cancel()  # the engine frees what the receiver left (nothing, once it owned the pages)
            worker.built.runner.release(rid)
            with anyio.CancelScope(shield=True):
                await worker.release_remote(self.key, link)
            raise
        lease.release()  # the context side is done with it: room for the next prefill
        engine.transfer_landed(generation, handoff.first_token)
        # the request's output list is the truth: its first token is the context side's
        output = request.output_ids
        async for _ in generation:
            while len(self.tokens) < len(output):
                self.tokens.append(output[len(self.tokens)])
                yield self.tokens[-1]

    async def collect(self) -> list[int]:
        return [t async for t in self]

    @property
    def draft_history(self) -> list[tuple[int, ...]]:
        return [] if self.generation is None else list(self.generation.request.draft_history)


@define(eq=False)
class _Lease:
    """A request's place in its context engine's window, given back once (when the context side is done with it)."""

    router: Router
    link: ContextLink
    _held: bool = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.router.give_back(self.link)


#: Requests each context engine is asked to work on at once (prefilling, answered and held, or being pushed); the
#: rest wait here in arrival order. Bounds what a context engine queues and holds, so that a prefill's answer comes
#: within ``prefill_timeout`` under any load the engines can serve.
DEFAULT_CONTEXT_WINDOW = 32
#: Seconds between a queued request's checks for a context engine that went away (its wake-up otherwise comes
#: when a place frees).
_RECHECK_SECONDS = 0.5


@define(eq=False)
class Router:
    """Routes ``generate()`` calls: context peer first, then the local generation worker.

    Backpressure towards the context engines: each is asked to work on at most ``context_window`` requests at once
    (from the prefill until its cache landed here, or it was released); further requests wait in one queue, in
    arrival order, for a place on any live context engine.
    """

    worker: GenerationWorker
    context_window: int = DEFAULT_CONTEXT_WINDOW
    _ids: itertools.count[int] = attrs.field(factory=itertools.count, init=False)
    _queue: deque[object] = attrs.field(factory=deque, init=False)
    _room: anyio.Event = attrs.field(factory=anyio.Event, init=False)

    def __attrs_post_init__(self) -> None:
        if self.context_window < 1:
            raise ConfigError(f"context_window must be at least 1, got {self.context_window}")

    @property
    def queued(self) -> int:
        """Requests waiting for a place on a context engine."""
        return len(self._queue)

    async def acquire(self) -> ContextLink:
        """A place for one request on the live context engine with the fewest requests in flight, in arrival
        order (waits while every one is full). A cancel while waiting leaves nothing behind.

        :raises ~kvferry.errors.TransferError: no context engine is connected (or every one went away).
        """
        me = object()
        self._queue.append(me)
        try:
            while True:
                link = self.pick()  # raises when none is live
                if self._queue[0] is me and link.in_flight < self.context_window:
                    link.in_flight += 1
                    return link
                with anyio.move_on_after(_RECHECK_SECONDS):
                    await self._room.wait()
        finally:
            self._queue.remove(me)
            self._wake()  # the next one in line looks again

    def give_back(self, link: ContextLink) -> None:
        link.in_flight -= 1
        self._wake()

    def _wake(self) -> None:
        self._room.set()
        self._room = anyio.Event()

    def pick(self) -> ContextLink:
        """The context peer for the next request: of those still connected, the one with the fewest requests in
        flight (the first of them on a tie).

        :raises ~kvferry.errors.TransferError: no context peer is connected.
        """
        had = bool(self.worker.links)
        self.worker.prune()
        live = [link for link in self.worker.links if not link.gone]
        if not live:
            if had:
                raise TransferError("every context engine went away: nobody can prefill the request")
            raise TransferError("not connected to a context engine")
        return min(live, key=lambda link: link.in_flight)

    def check_fits(self, num_prompt: int) -> None:
        """Raise :class:`~kvferry.errors.RequestTooLarge` when no connected context engine's pages (from its
        handshake) can hold a prompt of ``num_prompt`` tokens (all of them are judged alike: the smallest)."""
        for link in self.worker.links:
            if not link.gone:
                self._check_context(link.remote, num_prompt)

    @staticmethod
    def _check_context(remote: PeerInfo, num_prompt: int) -> None:
        table = remote.page_tables[0]
        pages = table.pool_group("attention").num_slots - 1  # page 0 is reserved
        per_block = table.layer_group("attention").tokens_per_block
        needed = -(-num_prompt // per_block)
        if needed > pages:
            raise RequestTooLarge(
                f"a prompt of {num_prompt} tokens needs {needed} pages of {per_block} tokens; the context "
                f"engine has {pages}: shorten the prompt to {pages * per_block} tokens or less, or start the "
                f"context engine with --num-pages {needed + 1} or more"
            )

    def conversation(self, *, spec_k: int = 0) -> RoutedConversation:
        """A multi-turn conversation whose turns are prefilled by the context engines and decoded here; the
        generation engine keeps its cache between turns, so each transfer sends only what it lacks.

        :raises ~kvferry.errors.ConfigError: as :meth:`Engine.conversation
            <kvferry.engine.engine.Engine.conversation>`.
        """
        return RoutedConversation(self, self.worker.engine.conversation(spec_k=spec_k))

    def generate(
        self,
        prompt_ids: Iterable[int],
        *,
        max_tokens: int,
        stop_ids: Iterable[int] = (),
        seed: int | None = None,
        temperature: float = 1.0,
        spec_k: int = 0,
    ) -> RoutedGeneration:
        """A stream of tokens, as :meth:`kvferry.engine.engine.Engine.generate` gives in aggregated serving.

        Leaving the ``async for`` early cancels the request: a held context cache is released, a transfer in
        progress is cancelled (its pages stay quarantined until every writer has reported).

        Iterating raises :class:`~kvferry.errors.PrefillTimeout` when the context side does not answer the
        prefill within the worker's ``prefill_timeout`` (it is told to drop the request), and
        :class:`~kvferry.errors.TransferError` (or a subclass) when the prefill or the transfer fails.
        """
        return RoutedGeneration(
            self,
            f"r{next(self._ids)}",
            tuple(int(t) for t in prompt_ids),
            max_tokens,
            seed,
            temperature,
            spec_k,
            tuple(int(t) for t in stop_ids),
        )


@define(eq=False)
class RoutedConversation:
    """A conversation in disaggregated serving (:meth:`Router.conversation`): :meth:`turn` gives each turn's
    tokens as a :class:`RoutedGeneration`; one turn at a time. :meth:`close` frees the generation engine's
    cache of it."""

    router: Router
    conversation: Conversation
    _turn: RoutedGeneration | None = None

    def turn(
        self,
        prompt_ids: Iterable[int],
        *,
        max_tokens: int,
        stop_ids: Iterable[int] = (),
        seed: int | None = None,
        temperature: float = 1.0,
    ) -> RoutedGeneration:
        """The next turn (iterate it once, to its end or leaving early: the next turn waits for that): the context
        engine prefills the whole history and this prompt, the transfer writes what the generation engine's kept
        cache lacks, and it decodes here.

        :raises ~kvferry.errors.ConfigError: the previous turn has not ended, or an empty prompt.
        """
        if self._turn is not None and not self._turn.ended:
            raise ConfigError("the previous turn of this conversation has not ended")
        prompt = tuple(int(t) for t in prompt_ids)
        if not prompt:
            raise ConfigError("a turn needs at least one prompt token")
        routed = self.router.generate(
            self.conversation.history + prompt,
            max_tokens=max_tokens,
            stop_ids=stop_ids,
            seed=seed,
            temperature=temperature,
            spec_k=self.conversation.spec_k,
        )
        routed.conversation, routed.turn_prompt = self.conversation, prompt
        self._turn = routed
        return routed

    def close(self) -> None:
        """Free the generation engine's cache of this conversation (a turn running is cancelled first)."""
        self.conversation.close()

    def __enter__(self) -> RoutedConversation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
