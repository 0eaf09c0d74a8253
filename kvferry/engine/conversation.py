"""Conversations: multi-turn requests whose whole cache is kept between turns.

A :class:`Conversation` is one chat on an engine. Each :meth:`~Conversation.turn` extends it: the turn's prompt is
every earlier prompt and answer plus the new prompt, and only what the cache does not hold yet is computed. When a
turn ends, its cache (attention pages, state slot, replay state, draft pages) is suspended and kept, not closed; the
next turn resumes it where it stopped. Between turns the cache stays on the device until the engine needs the room
(then it moves to the host), or :meth:`~Conversation.offload` moves it now; the next turn's admission restores it.

Host memory is bounded by ``EngineConfig.host_memory``: past it, the engine drops idle conversations on the host,
least recently used first. A dropped conversation keeps its tokens; its next turn computes them again (prefix
reuse may still cover part of them), as a new cache whose first resume starts from a zeroed or snapshotted slot
with no replay state.

The turns of one conversation run one at a time. The conversation's speculative decoding (``spec_k``) is fixed for
its life: the drafter's KV of every turn is what the next turn's proposals read.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

import attrs
from attrs import define

from kvferry.engine.request import Request, RequestState
from kvferry.errors import ConfigError, EngineClosed, PoolExhausted

if TYPE_CHECKING:
    from kvferry.engine.engine import Engine
    from kvferry.engine.generation import Generation

__all__ = ["Conversation", "ConversationCache", "TurnStatistics", "drop_past_host_memory"]


@runtime_checkable
class ConversationCache(Protocol):
    """What a conversation needs of the engine's cache besides the scheduler's operations
    (:class:`~kvferry.engine.runner.LockstepCache` has it)."""

    def holds(self, request_id: int) -> bool: ...

    def extend(self, request_id: int, prompt_token_ids: Sequence[int]) -> None: ...

    def num_committed_tokens(self, request_id: int) -> int: ...

    def capacity(self, request_id: int) -> int: ...

    def host_nbytes(self, request_id: int) -> int: ...

    def offload(self, request_id: int) -> None: ...

    def close(self, request_id: int) -> None: ...


class TurnStatistics(NamedTuple):
    """One turn of a conversation, once it ended."""

    #: tokens of the turn's new prompt
    num_prompt: int
    num_generated: int
    #: tokens of the conversation the cache held when the turn started, or that prefix reuse covered
    reused_tokens: int
    #: bytes brought back from the host for the turn (the conversation's cache was there)
    restored_bytes: int
    #: tokens whose cache an earlier turn had computed and this one computed again (it had been dropped)
    recomputed_tokens: int
    finish_reason: str | None
    state: RequestState
    num_drafted: int
    num_accepted: int


@define(eq=False)
class Conversation:
    """A multi-turn conversation on one engine (:meth:`Engine.conversation
    <kvferry.engine.engine.Engine.conversation>`); not thread-safe, use it from the engine's event loop.

    :meth:`close` (or leaving ``with conversation:``) frees its cache; the engine's end frees it too.
    """

    _engine: Engine
    _cache: ConversationCache
    #: the engine request id every turn uses (and the cache's id in the managers)
    conversation_id: int
    spec_k: int = 0
    #: every token so far: prompts and answers, in order
    _history: list[int] = attrs.field(factory=list, init=False)
    _turn: Generation | None = attrs.field(default=None, init=False)
    #: the turn's new prompt length and what its start found, for its statistics
    _starting: tuple[int, int, int] = attrs.field(default=(0, 0, 0), init=False)
    #: the most tokens the cache ever held (what a dropped conversation has to compute again)
    _computed: int = attrs.field(default=0, init=False)
    _closed: bool = attrs.field(default=False, init=False)
    #: ``time.perf_counter()`` of the last turn's start or end (least recently used is dropped first)
    last_used: float = attrs.field(factory=time.perf_counter, init=False)
    turns: list[TurnStatistics] = attrs.field(factory=list, init=False)
    num_drops: int = attrs.field(default=0, init=False)

    # --- turns ----------------------------------------------------------------------------------------------

    def turn(
        self,
        prompt_ids: Iterable[int],
        *,
        max_tokens: int,
        stop_ids: Iterable[int] = (),
        seed: int | None = None,
        temperature: float = 1.0,
        awaits_transfer: bool = False,
    ) -> Generation:
        """Submit the next turn now and return its stream (the new tokens only). It sees every earlier prompt
        and answer; a turn that ends early (a cancel) keeps what it generated, one that fails adds nothing.

        ``awaits_transfer``: another engine prefills the turn (disaggregated serving; continue with
        :meth:`Engine.admit_transfer <kvferry.engine.engine.Engine.admit_transfer>`): the transfer then writes
        only what the kept cache does not hold.

        A cancel of the stream (leaving its ``async for`` early) ends the turn at the next step boundary; the
        conversation keeps its cache and what the turn generated until then.

        :raises ~kvferry.errors.ConfigError: bad arguments, or a turn is still running (nothing is submitted).
        :raises ~kvferry.errors.EngineClosed: the conversation is closed or the engine is not running.
        """
        if self._closed:
            raise EngineClosed(f"conversation {self.conversation_id} is closed")
        if self._turn is not None:
            raise ConfigError(f"conversation {self.conversation_id}: a turn is still running")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ConfigError("a turn needs at least one prompt token")
        rid = self.conversation_id
        full = self._history + prompt
        kept = self._cache.holds(rid)
        request = self._engine._new_request(
            rid,
            full,
            max_tokens=max_tokens,
            stop_ids=stop_ids,
            seed=seed,
            temperature=temperature,
            spec_k=self.spec_k,
        )
        restored = 0
        if kept:
            restored = self._cache.host_nbytes(rid)
            request.resumes_cache = True
            request.num_computed = request.reused_tokens = self._cache.num_committed_tokens(rid)
            request.capacity = self._cache.capacity(rid)
        request.keep_cache = True
        request.awaits_transfer = awaits_transfer
        request.on_end = self._ended
        generation = self._engine._generation(request)
        if kept:
            self._cache.extend(rid, full)  # checked: the history starts with what the cache committed
        generation.submit()
        self._turn = generation
        self._starting = (len(prompt), restored, len(self._history))
        self.last_used = time.perf_counter()
        return generation

    def _ended(self, request: Request, kept: bool) -> None:
        """The turn's request ended (called by the engine, synchronously)."""
        num_prompt, restored, before = self._starting
        # a failed turn adds nothing, nor one whose cache never came from the engine that prefilled it
        lost = request.state is RequestState.FAILED or (request.awaits_transfer and not request.output_ids)
        if not lost:
            self._history = list(request.all_ids)
        cached = self._cache.num_committed_tokens(request.request_id) if kept else 0
        self.turns.append(
            TurnStatistics(
                num_prompt=num_prompt,
                num_generated=len(request.output_ids),
                reused_tokens=request.reused_tokens,
                restored_bytes=restored,
                recomputed_tokens=max(0, min(self._computed, before) - request.reused_tokens)
                if request.admitted_at is not None
                else 0,
                finish_reason=request.finish_reason,
                state=request.state,
                num_drafted=request.num_drafted,
                num_accepted=request.num_accepted,
            )
        )
        self._computed = max(self._computed, cached)
        self._turn = None
        self.last_used = time.perf_counter()
        if self._closed:
            self._free()

    def answered_elsewhere(self, prompt_ids: Sequence[int], tokens: Sequence[int]) -> None:
        """Record a turn that another engine answered entirely (disaggregated serving: its first token was its
        last): the history grows, the kept cache stays as it is (the next turn computes what it lacks).

        :raises ~kvferry.errors.ConfigError: a turn is running.
        """
        if self._turn is not None:
            raise ConfigError(f"conversation {self.conversation_id}: a turn is still running")
        self._history += [int(t) for t in prompt_ids] + [int(t) for t in tokens]
        self.turns.append(
            TurnStatistics(len(prompt_ids), len(tokens), 0, 0, 0, None, RequestState.FINISHED, 0, 0)
        )
        self.last_used = time.perf_counter()

    # --- the cache between turns -------------------------------------------------------------------------------

    async def suspend(self) -> None:
        """Suspend the running turn (:meth:`Generation.suspend <kvferry.engine.engine.Generation.suspend>`);
        between turns the cache is suspended already and this does nothing."""
        if self._turn is not None:
            await self._turn.suspend()

    async def offload(self) -> None:
        """Move the conversation's cache to host memory now (between turns, or while its turn is suspended);
        the next turn (or :meth:`resume`) brings it back. Nothing to move: nothing happens.

        :raises ~kvferry.errors.ConfigError: its turn is running (suspend it first).
        """
        if self._turn is not None:
            await self._turn.offload()
        elif self._cache.holds(self.conversation_id):
            await self._engine._move(self.conversation_id, to_host=True)

    def resume(self) -> None:
        """Resume a suspended turn. Between turns nothing waits: the next turn's admission brings the cache back
        from the host (its ``restored_bytes``), or :meth:`restore` does it ahead."""
        if self._turn is not None:
            self._turn.resume()

    async def restore(self) -> bool:
        """Between turns, bring the cache back from the host now, off the event loop (the next turn then starts
        without that copy); whether it came back. Not when the device has no free room for it (the next turn's
        admission makes room), nor while a turn runs. A cancel rolls it back (the cache stays on the host).

        :raises ~kvferry.errors.CacheMoving: its cache is moving already.
        """
        rid = self.conversation_id
        if self._turn is not None or not self._cache.holds(rid) or not self._cache.host_nbytes(rid):
            return False
        try:
            return await self._engine._move(rid, to_host=False)
        except PoolExhausted:
            return False

    def drop(self) -> None:
        """Free the cache between turns, keeping the tokens: the next turn computes them again (what the engine
        does past its host memory). A no-op while a turn runs or when nothing is held."""
        if self._turn is None and self._cache.holds(self.conversation_id):
            self._free()
            self.num_drops += 1

    def close(self) -> None:
        """End the conversation: a running turn is cancelled, and the cache is freed (once the turn ended).
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._engine._forget_conversation(self)
        if self._turn is not None:
            self._turn.cancel()
        else:
            self._free()

    def _free(self) -> None:
        if self._cache.holds(self.conversation_id):
            self._cache.close(self.conversation_id)
        self._engine.runner.release(self.conversation_id)

    def __enter__(self) -> Conversation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- state ----------------------------------------------------------------------------------------------------

    @property
    def history(self) -> tuple[int, ...]:
        """Every token so far (prompts and answers)."""
        return tuple(self._history)

    @property
    def busy(self) -> bool:
        """Whether a turn is running (submitted and not ended)."""
        return self._turn is not None

    @property
    def cached_tokens(self) -> int:
        """Tokens the kept cache holds (0 when none is kept)."""
        rid = self.conversation_id
        return self._cache.num_committed_tokens(rid) if self._cache.holds(rid) else 0

    @property
    def host_nbytes(self) -> int:
        """Host bytes the kept cache takes (0 on the device or when none is kept)."""
        rid = self.conversation_id
        return self._cache.host_nbytes(rid) if self._cache.holds(rid) else 0

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("turn running" if self._turn is not None else "idle")
        where = "host" if self.host_nbytes else "device"
        return (
            f"<Conversation {self.conversation_id} {state}: {len(self._history)} tokens, {len(self.turns)} "
            f"turns, {self.cached_tokens} cached on the {where}, {self.num_drops} drops>"
        )


def drop_past_host_memory(conversations: Iterable[Conversation], limit: int) -> int:
    """Drop idle conversations whose caches are on the host, least recently used first, until their host bytes
    are at most ``limit``; returns how many were dropped."""
    on_host = [(c, c.host_nbytes) for c in conversations if not c.busy]
    on_host = [(c, n) for c, n in on_host if n]
    total = sum(n for _, n in on_host)
    dropped = 0
    for conversation, nbytes in sorted(on_host, key=lambda item: item[0].last_used):
        if total <= limit:
            break
        conversation.drop()
        total -= nbytes
        dropped += 1
    return dropped
