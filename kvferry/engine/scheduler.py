"""The synchronous scheduler: which requests run in the next engine step, with which tokens.

One call to :meth:`Scheduler.schedule` builds a :class:`StepPlan` and performs the cache-manager operations
it needs (create, resume, grow, suspend), all synchronous and all-or-nothing in the manager. The engine then
runs the model over the plan and reports back through :meth:`Scheduler.commit` /
:meth:`Scheduler.finish`.

The rules, in the order :meth:`~Scheduler.schedule` applies them:

1. **Decodes first.** Every DECODING request gets ``1 + k`` tokens (its pending token and ``k`` draft slots),
   oldest admission first. The configuration guarantees that all of them fit the token budget with at least
   one token to spare, so a long prompt can never block decodes and prefill always progresses.
2. **Prefill chunks with what is left**, oldest admission first: each PREFILLING request gets
   ``min(rest of its prompt, budget left, max_prefill_chunk)`` tokens, cut at the manager's next recurrent
   snapshot boundary (a snapshot is only valid at the exact token where it was taken, so a chunk must end
   there).
3. **Admission**, FIFO from the waiting queue (preempted requests go back to its front): a request is admitted
   only when the manager can create and resume its cache and give it pages for its first chunk; a failure
   stops admission for this step (no request overtakes an older one) and leaves nothing held.
4. **Preemption by suspend.** When the manager runs out of pages for a request, the newest running request
   that is not yet in this step's plan (and newer than the one asking) is suspended and goes back to the
   front of the waiting queue; it resumes, in whatever pages and slot the manager then gives it, when
   admission reaches it again.

A request that cannot make progress even with everything newer preempted, while nothing else runs, can
never fit: it fails with :class:`~kvferry.errors.PoolExhausted` instead of deadlocking the engine.

**Transfers.** A request marked ``awaits_transfer`` (its prompt was prefilled by another engine) is admitted in
the same FIFO: it gets its batch row, a state slot and pages for its whole prompt, then waits in TRANSFERRING
(planned in no step, never preempted, counted in ``max_running``) until :meth:`Scheduler.landed` says its cache
arrived; it then decodes as any request whose prompt is done.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import attrs
from attrs import define, frozen

from kvferry.engine.request import Request, RequestState, check_transition
from kvferry.errors import ConfigError, PoolExhausted

__all__ = [
    "CacheOps",
    "ItemKind",
    "ResumeInfo",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStatistics",
    "StepItem",
    "StepPlan",
]


class ResumeInfo(Protocol):
    """What a resume reports (the manager's ``Resumed``)."""

    @property
    def reused_tokens(self) -> int: ...

    @property
    def num_committed_tokens(self) -> int: ...

    @property
    def first(self) -> bool: ...


class CacheOps(Protocol):
    """The cache manager as the scheduler drives it (:class:`kvferry.pools.manager.CacheManager` is one).

    Every method is all-or-nothing: on :class:`~kvferry.errors.PoolExhausted` nothing changed.
    """

    def create(self, request_id: int, prompt_token_ids: Sequence[int]) -> None:
        """Register a request's cache, SUSPENDED, matching its prompt against the prefix cache."""
        ...

    def resume(self, request_id: int) -> ResumeInfo:
        """Give the request a live slot and pages (the whole prompt on the first resume) and bring back what
        it owns (pages, state, replay state)."""
        ...

    def grow(self, request_id: int, capacity: int) -> None:
        """Make the request's block table cover ``capacity`` tokens."""
        ...

    def commit(self, request_id: int, token_ids: Sequence[int], *, num_pending_replay: int = 0) -> None:
        """``token_ids`` (the ones after those committed before) now have final KV; the last
        ``num_pending_replay`` of the committed tokens are still in the replay buffers, not in the slot."""
        ...

    # Optional, used when present (the manager and LockstepCache have them): the same as calling grow / commit
    # for each tuple in order, all or nothing, in one call per step:
    #   grow_many(grows: Sequence[tuple[request_id, capacity]], *, offload: bool = True) -> None
    #     (offload=False: refuse rather than move suspended requests to the host; Scheduler.grow_ahead uses it)
    #   commit_many(commits: Sequence[tuple[request_id, token_ids, num_pending_replay]]) -> None

    def next_snapshot_boundary(self, request_id: int) -> int | None:
        """The next token count past the live slot's where the manager wants a recurrent snapshot."""
        ...

    def suspend(self, request_id: int) -> None:
        """Give the slot back, keeping the request's cache (maybe moved to the host) for a later resume."""
        ...

    def close(self, request_id: int) -> object:
        """Free everything the request holds. Idempotent."""
        ...


@frozen
class SchedulerConfig:
    """Limits of one engine step.

    ``token_budget`` counts every token fed to the target model in one step (prompt chunks, pending tokens,
    draft tokens). It must exceed ``max_running * (1 + max_spec_k)`` so decodes always fit with room for
    prefill.
    """

    token_budget: int = 256
    max_running: int = 16
    max_prefill_chunk: int = 64
    max_spec_k: int = 0
    #: grow caches to a multiple of this many tokens (the attention block size: the same pages as growing token
    #: by token, but most decode steps then need no grow call at all)
    grow_granularity: int = 1

    def __attrs_post_init__(self) -> None:
        for name in ("token_budget", "max_running", "max_prefill_chunk", "grow_granularity"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_spec_k < 0:
            raise ConfigError(f"max_spec_k must be >= 0, got {self.max_spec_k}")
        if self.token_budget <= self.max_running * (1 + self.max_spec_k):
            raise ConfigError(
                f"token_budget {self.token_budget} must exceed max_running * (1 + max_spec_k) = "
                f"{self.max_running * (1 + self.max_spec_k)} so decodes always fit with room for prefill"
            )


def _token_range(request: Request, lo: int, hi: int) -> Sequence[int]:
    """``request.all_ids[lo:hi]`` without building the whole sequence (this runs for every request, every step)."""
    prompt, n = request.prompt_ids, request.num_prompt
    if hi <= n:
        return prompt[lo:hi]
    outputs = request.output_ids[max(lo - n, 0) : hi - n]
    return [*prompt[lo:n], *outputs] if lo < n else outputs


class ItemKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class StepItem(NamedTuple):
    """One request's share of a step (a NamedTuple: hundreds are built every step, attrs' frozen init is slower).

    PREFILL: feed ``token_ids`` at positions ``start ..``; ``wants_logits`` when the chunk ends the prompt
    (its last position's logits give the first output token). DECODE: feed the pending token at ``start``
    plus ``num_drafts`` tokens the drafter proposes at execution time; logits at all ``1 + num_drafts``
    positions.
    """

    request: Request
    kind: ItemKind
    token_ids: tuple[int, ...]
    start: int
    num_drafts: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_drafts

    @property
    def wants_logits(self) -> bool:
        return self.kind is ItemKind.DECODE or self.start + len(self.token_ids) == self.request.num_prompt

    def __repr__(self) -> str:
        return (
            f"StepItem({self.request.request_id} {self.kind.name} start={self.start} "
            f"tokens={len(self.token_ids)} drafts={self.num_drafts})"
        )


@frozen
class StepPlan:
    """What the next engine step runs, and what scheduling changed on the way."""

    items: tuple[StepItem, ...]
    preempted: tuple[Request, ...] = ()
    failed: tuple[Request, ...] = ()
    #: tokens fed to the target model (prompt chunks, pending and draft tokens); counted once, when planned
    num_tokens: int = attrs.field(
        default=attrs.Factory(lambda plan: sum(item.num_tokens for item in plan.items), takes_self=True)
    )
    #: requests awaiting a transfer that this step admitted (now TRANSFERRING: their pages are ready)
    transfers: tuple[Request, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.items


class SchedulerStatistics(NamedTuple):
    #: requests waiting for admission (new or preempted)
    num_waiting: int
    #: requests holding a live slot (prefilling, decoding, or waiting for their transfer)
    num_running: int
    #: steps planned so far
    num_steps: int
    #: preemptions so far
    num_preemptions: int
    #: tokens planned in the last step
    last_step_tokens: int


@define(eq=False)
class Scheduler:
    """FIFO admission, decode-first batching, chunked prefill and preemption over a :class:`CacheOps`.

    Not thread-safe; the engine calls it from its step loop only. Requests are added with :meth:`add`, leave
    with :meth:`finish` (finished, cancelled or failed: their cache is closed, whatever state they were in).
    """

    cache: CacheOps
    config: SchedulerConfig = attrs.field(factory=SchedulerConfig)
    _waiting: deque[Request] = attrs.field(factory=deque, init=False)
    _running: list[Request] = attrs.field(factory=list, init=False)
    _created: set[int] = attrs.field(factory=set, init=False)
    #: commits recorded since the last flush: (request id, token ids, num_pending_replay), in order
    _commits: list[tuple[int, Sequence[int], int]] = attrs.field(factory=list, init=False)
    _num_steps: int = attrs.field(default=0, init=False)
    _num_preemptions: int = attrs.field(default=0, init=False)
    #: requests in ``_running`` that wait for their transfer (TRANSFERRING)
    _num_transferring: int = attrs.field(default=0, init=False)
    #: while > 0 nothing waiting is admitted (the running requests go on and free their room)
    admissions_paused: int = attrs.field(default=0, init=False)
    _last_step_tokens: int = attrs.field(default=0, init=False)
    #: per request, the manager's next snapshot boundary as last asked (None: it takes no more snapshots); a
    #: commit before it cannot take a snapshot, so it may wait for the next step's model run (see ``defer``)
    _boundaries: dict[int, int | None] = attrs.field(factory=dict, init=False)
    #: the pending commits include one that may take a snapshot: they reach the manager before the next step
    _commits_snapshot: bool = attrs.field(default=False, init=False)

    # --- requests in and out --------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a WAITING request for admission (FIFO)."""
        if request.state is not RequestState.WAITING:
            raise ConfigError(f"only WAITING requests can be added, got {request!r}")
        if request.spec_k > self.config.max_spec_k:
            raise ConfigError(
                f"spec_k {request.spec_k} exceeds the engine's max_spec_k {self.config.max_spec_k}"
            )
        if request.resumes_cache:
            self._created.add(request.request_id)  # admission resumes the cache it has
        self._boundaries.pop(request.request_id, None)  # a new turn has a new prompt (a new boundary)
        self._waiting.append(request)

    def finish(self, request: Request, state: RequestState) -> bool:
        """Take ``request`` out (moving it to terminal ``state`` unless it is there) and close its cache; return
        whether the cache was kept instead (SUSPENDED in the manager, for the request's owner).

        A ``keep_cache`` request that finishes or is cancelled keeps its cache (every commit handed over, suspended
        if it was resumed); one that fails, or ends while its cache is in transit, has it closed. Idempotent.
        Whatever else the request held in the manager is freed before this returns (the commits not yet handed
        over reach the manager first, so its blocks and snapshots stay in the prefix cache; if the manager refuses
        them, the request is still taken out and closed, then the error propagates).
        """
        kept = False
        flushed = False
        try:
            self.flush()
            flushed = True
        finally:
            was = request.state
            if was is RequestState.TRANSFERRING:
                self._num_transferring -= 1
            if not was.is_terminal:
                request.transition(state)
            if request in self._running:
                self._running.remove(request)
            if request in self._waiting:
                self._waiting.remove(request)
            rid = request.request_id
            self._boundaries.pop(rid, None)
            if rid in self._created:
                self._created.discard(rid)
                kept = (
                    flushed
                    and request.keep_cache
                    and request.state is not RequestState.FAILED
                    and was is not RequestState.TRANSFERRING
                )
                if not kept:
                    self.cache.close(rid)
                elif was.holds_slot:
                    self.cache.suspend(rid)
        return kept

    def suspend(self, request: Request) -> None:
        """Hold ``request`` aside for its owner (SUSPENDED): it leaves the batch or the queue, its cache is
        suspended in the manager (kept, possibly moved to the host under pressure) and it is not scheduled until
        :meth:`resume`. The commits recorded so far reach the manager first.

        :raises ~kvferry.errors.InvalidTransition: the request is TRANSFERRING or ended (nothing changed).
        """
        check_transition(request.state, RequestState.SUSPENDED)
        if request.state.holds_slot:
            self.flush()
            self.cache.suspend(request.request_id)
            self._running.remove(request)
        elif request in self._waiting:
            self._waiting.remove(request)
        request.transition(RequestState.SUSPENDED)

    def resume(self, request: Request) -> None:
        """Queue a SUSPENDED request again (last in line): admission resumes its cache (restoring it from the
        host if it was moved there), or creates it if it never had one.

        :raises ~kvferry.errors.InvalidTransition: the request is not SUSPENDED (nothing changed).
        """
        has_cache = request.request_id in self._created
        request.transition(RequestState.PREEMPTED if has_cache else RequestState.WAITING)
        self._waiting.append(request)

    @property
    def has_work(self) -> bool:
        """Whether a step may do something (requests that only wait for their transfer give it nothing)."""
        return bool(self._waiting) or len(self._running) > self._num_transferring

    def landed(self, request: Request, first_token: int) -> None:
        """The cache of TRANSFERRING ``request`` arrived: its whole prompt is committed (handed to the cache with
        the next commits) and ``first_token`` (sampled by the engine that prefilled it) is its first output;
        it decodes from the next step on. The caller ends a request that this token finishes."""
        if request.state is not RequestState.TRANSFERRING:
            raise ConfigError(f"only a TRANSFERRING request can land, got {request!r}")
        # the tokens its cache held already (a reused prefix, a kept turn) are committed: only the rest is new
        self._commits.append((request.request_id, request.prompt_ids[request.num_computed :], 0))
        self._commits_snapshot = True  # the prompt's end may be a snapshot boundary
        request.num_computed = request.num_prompt
        request.append_tokens([first_token])
        request.transition(RequestState.DECODING)
        self._num_transferring -= 1

    @property
    def running(self) -> tuple[Request, ...]:
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[Request, ...]:
        return tuple(self._waiting)

    def preempt_all(self) -> int:
        """Suspend every running request (newest first, so they keep their order at the head of the queue);
        the commits recorded so far reach the manager first. Returns how many. Requests waiting for their
        transfer are left alone: the caller refuses what they forbid.
        """
        self.flush()
        running = [r for r in self._running if r.state.holds_slot]
        for request in reversed(running):
            self._preempt(request)
        return len(running)

    @property
    def num_transferring(self) -> int:
        """Requests that wait for their cache from another engine (their pages may be written any time)."""
        return self._num_transferring

    def holds_cache(self, request: Request) -> bool:
        """Whether the request has a cache in the manager (created and not closed)."""
        return request.request_id in self._created

    # --- planning -------------------------------------------------------------------------------------

    def schedule(self, *, defer: bool = False) -> StepPlan:
        """Plan the next step (see the module docstring for the rules); mutates the manager as it goes.

        The commits recorded since the last step reach the manager first (:meth:`flush`). With ``defer`` they
        may stay pending instead, for the caller to :meth:`flush` while the planned step runs, when that changes
        nothing: the step only decodes requests that run already and none of the commits takes a recurrent
        snapshot (which copies the live slot the step advances). Anything else (a prefill chunk, an admission,
        pages too short for every decode) hands them over first, as without ``defer``.
        """
        if not defer or self._commits_snapshot:
            self.flush()
        budget = self.config.token_budget
        items: list[StepItem] = []
        planned: set[int] = set()
        preempted: list[Request] = []
        failed: list[Request] = []
        transfers: list[Request] = []
        blocked: Request | None = None

        decoding, prefilling = RequestState.DECODING, RequestState.PREFILLING
        decodes = [r for r in self._running if r.state is decoding]
        prefills = [r for r in self._running if r.state is prefilling]
        left = self._decode_all(decodes, budget, items, planned)
        if left is not None:
            budget = left
        else:
            self.flush()  # a preempted request's commits must reach the manager before its suspend
            # pages are short: request by request, preempting newer requests (the batch changed nothing)
            max_k = self.config.max_spec_k
            for request in decodes:
                if request.state is not decoding:  # preempted by an older request's growth this step
                    continue
                k = min(request.spec_k, max_k, request.max_tokens - len(request.output_ids) - 1, budget - 1)
                k = k if k > 0 else 0
                start = request.num_computed
                if not self._grow(request, start + 1 + k, planned, preempted):
                    blocked = blocked or request
                    continue
                items.append(StepItem(request, ItemKind.DECODE, (request.output_ids[-1],), start, k))
                planned.add(request.request_id)
                budget -= 1 + k

        if prefills and budget > 0:
            self.flush()  # chunks end at snapshot boundaries: the manager's position must be current
        for request in prefills:
            if budget <= 0:
                break
            if request.state is RequestState.PREEMPTED:
                continue
            chunk = self._prefill_item(request, budget, planned, preempted)
            if chunk is None:
                blocked = blocked or request
                continue
            items.append(chunk)
            planned.add(request.request_id)
            budget -= chunk.num_tokens

        is_moving = getattr(self.cache, "is_moving", None)
        if self._waiting and budget > 0 and len(self._running) < self.config.max_running:
            self.flush()  # an admission matches the prefix index: it sees every commit, as without defer
        while (
            self._waiting
            and budget > 0
            and len(self._running) < self.config.max_running
            and not self.admissions_paused
        ):
            head = self._waiting[0]
            if is_moving is not None and head.request_id in self._created and is_moving(head.request_id):
                break  # its cache is on its way to or from the host: admitted once there, in its place
            if head.awaits_transfer and head.state is RequestState.WAITING:
                if not self._admit_transfer(head):
                    break
                self._running.append(self._waiting.popleft())
                transfers.append(head)
                continue
            first = self._admit(head, budget)
            if first is None:
                if not items and not self._running:
                    blocked = blocked or head  # alone and still refused: it can never fit
                break
            request = self._waiting.popleft()
            self._running.append(request)
            items.append(first)
            planned.add(request.request_id)
            budget -= first.num_tokens

        # a request that waits for its transfer will decode (and can be preempted) soon: nobody can be judged
        # never to fit while one does
        if not items and blocked is not None and not preempted and not self._num_transferring:
            # nothing runs, nothing newer can be preempted: this request can never fit
            self.finish(blocked, RequestState.FAILED)
            blocked.error = PoolExhausted(f"request {blocked.request_id} cannot fit in the cache pools")
            failed.append(blocked)

        self._num_steps += 1
        self._last_step_tokens = self.config.token_budget - budget
        return StepPlan(
            tuple(items), tuple(preempted), tuple(failed), self._last_step_tokens, tuple(transfers)
        )

    def commit(self, request: Request, num_computed: int, *, num_pending_replay: int = 0) -> None:
        """Record that the cache of ``request`` now holds ``num_computed`` final tokens (the last
        ``num_pending_replay`` of them still in the replay buffers); PREFILLING -> DECODING when the prompt is
        done (the engine has appended the first output token by then).

        The manager gets a step's commits in one batch (``commit_many`` when the cache has it) when the next
        :meth:`schedule` starts or a request finishes, whichever comes first; :meth:`flush` hands them over now.
        Until then only the manager lags: the request's counters move here.
        """
        # NOTE: runs for every request every step: a decode's tokens are a slice of its outputs
        lo, n = request.num_computed, len(request.prompt_ids)
        tokens = (
            request.output_ids[lo - n : num_computed - n]
            if lo >= n
            else _token_range(request, lo, num_computed)
        )
        self._commits.append((request.request_id, tokens, num_pending_replay))
        request.num_computed = num_computed
        if not self._commits_snapshot:
            # NOTE: the manager is asked only when the slot reaches the boundary it gave last time
            rid = request.request_id
            boundary = self._boundaries.get(rid, -1)
            if boundary is not None and num_computed - num_pending_replay >= boundary:
                boundary = self._boundaries[rid] = self.cache.next_snapshot_boundary(rid)
                # asked before this batch of commits reached the manager: an earlier boundary, never a later one
                if boundary is not None and num_computed - num_pending_replay >= boundary:
                    self._commits_snapshot = True
                    del self._boundaries[rid]  # asked again once the manager has the commits
        if request.state is RequestState.PREFILLING and num_computed >= n:
            request.transition(RequestState.DECODING)

    def commit_decodes(self, requests: Sequence[Request]) -> None:
        """:meth:`commit` of one token for each request, a plain decode (no verify window) whose step appended its
        output: the same as ``commit(request, request.num_computed + 1)`` for each, in one call."""
        # NOTE: runs for every decoding request every step: commit's body, for one token past the prompt
        commits, boundaries, cache = self._commits, self._boundaries, self.cache
        for request in requests:
            lo = request.num_computed
            n = len(request.prompt_ids)
            tokens = request.output_ids[lo - n : lo - n + 1] if lo >= n else _token_range(request, lo, lo + 1)
            rid = request.request_id
            commits.append((rid, tokens, 0))
            request.num_computed = lo = lo + 1
            boundary = boundaries.get(rid, -1)
            if boundary is not None and lo >= boundary and not self._commits_snapshot:
                boundary = boundaries[rid] = cache.next_snapshot_boundary(rid)
                if boundary is not None and lo >= boundary:
                    self._commits_snapshot = True
                    del boundaries[rid]

    def flush(self) -> None:
        """Hand the commits recorded since the last flush to the cache, in order, in one ``commit_many``.

        If the cache refuses them (a bug: the scheduler only commits what it planned), nothing of this batch
        is committed and the error propagates; the batch is dropped either way.
        """
        if not self._commits:
            return
        commits, self._commits = self._commits, []
        self._commits_snapshot = False
        commit_many = getattr(self.cache, "commit_many", None)
        if commit_many is not None:
            commit_many(commits)
            return
        for request_id, token_ids, num_pending_replay in commits:
            self.cache.commit(request_id, token_ids, num_pending_replay=num_pending_replay)

    def grow_ahead(self, plan: StepPlan) -> bool:
        """While ``plan`` runs: grow every plain decode of it (no drafts, not speculating) that will decode again
        to the capacity its next step needs, the capacity the next :meth:`schedule` would grow it to, so that
        schedule finds nothing to grow. All or nothing, and only when free pages suffice (no suspended request
        is moved to the host: the grow copies no bytes); returns whether it grew. A request the step ends (a
        stop token) or a cancel frees gives its pages back when it is closed.

        Needs a cache whose ``grow_many`` takes ``offload=False`` (the manager's); without one it does nothing.
        """
        grow_many = getattr(self.cache, "grow_many", None)
        if grow_many is None:
            return False
        granularity, decode = self.config.grow_granularity, ItemKind.DECODE
        grown: list[tuple[Request, int]] = []
        for item in plan.items:
            request = item.request
            if (
                item.kind is decode
                and not item.num_drafts
                and not request.spec_k
                and len(request.output_ids) + 1 < request.max_tokens
                and request.state is RequestState.DECODING
            ):
                end = item.start + 2  # this step commits one token; the next feeds one
                if end > request.capacity:
                    grown.append((request, -(-end // granularity) * granularity))
        if not grown:
            return False
        try:
            grow_many([(request.request_id, capacity) for request, capacity in grown], offload=False)
        except PoolExhausted:
            return False  # the next schedule grows them (and preempts) as without this
        for request, capacity in grown:
            request.capacity = capacity
        return True

    # --- helpers --------------------------------------------------------------------------------------

    def _decode_all(
        self, decodes: list[Request], budget: int, items: list[StepItem], planned: set[int]
    ) -> int | None:
        """Plan every decode, growing those that need pages with one ``grow_many``: the budget left, or None
        when the cache has no ``grow_many`` or the pages do not suffice for all of them (nothing changed)."""
        grow_many = getattr(self.cache, "grow_many", None)
        if grow_many is None:
            return None
        # NOTE: runs for every decoding request every step: kept free of helper calls, and the items are built
        # with tuple.__new__ (the same StepItem; NamedTuple's generated __new__ is a Python-level call)
        max_k, granularity, decode, new = (
            self.config.max_spec_k,
            self.config.grow_granularity,
            ItemKind.DECODE,
            tuple.__new__,
        )
        batch: list[StepItem] = []
        grown: list[tuple[Request, int]] = []
        for request in decodes:
            k = 0
            if max_k:
                k = min(request.spec_k, max_k, request.max_tokens - len(request.output_ids) - 1, budget - 1)
                k = k if k > 0 else 0
            start = request.num_computed
            end = start + 1 + k
            if end > request.capacity:
                grown.append((request, -(-end // granularity) * granularity))
            batch.append(new(StepItem, (request, decode, (request.output_ids[-1],), start, k)))
            budget -= 1 + k
        if grown:
            try:
                grow_many([(request.request_id, capacity) for request, capacity in grown])
            except PoolExhausted:
                return None
            for request, capacity in grown:
                request.capacity = capacity
        items.extend(batch)
        planned.update(request.request_id for request in decodes)
        return budget

    def _prefill_end(self, request: Request, budget: int) -> int:
        start = request.num_computed
        end = min(request.num_prompt, start + budget, start + self.config.max_prefill_chunk)
        boundary = self.cache.next_snapshot_boundary(request.request_id)
        if boundary is not None and start < boundary < end:
            end = boundary
        return end

    def _prefill_item(
        self, request: Request, budget: int, planned: set[int], preempted: list[Request]
    ) -> StepItem | None:
        end = self._prefill_end(request, budget)
        if not self._grow(request, end, planned, preempted):
            return None
        start = request.num_computed
        return StepItem(request, ItemKind.PREFILL, request.prompt_ids[start:end], start)

    def _decode_item(self, request: Request, budget: int) -> StepItem:
        k = max(0, min(request.effective_spec_k(), self.config.max_spec_k, budget - 1))
        return StepItem(
            request, ItemKind.DECODE, (request.output_ids[-1],), request.num_computed, num_drafts=k
        )

    def _admit(self, request: Request, budget: int) -> StepItem | None:
        """Create (first time), resume and grow the request's cache for its first item of this step.

        All or nothing: when anything does not fit, a new request's cache is closed again and a preempted
        one is suspended again, so it holds exactly what it held before and keeps its place in the queue.
        """
        rid = request.request_id
        fresh = rid not in self._created
        resumed = False
        try:
            if fresh:
                self.cache.create(rid, request.prompt_ids)
                self._created.add(rid)
                request.capacity = 0
            info = self.cache.resume(rid)
            resumed = True
            if info.first:
                request.reused_tokens = info.reused_tokens
                request.num_computed = info.num_committed_tokens
            if request.prefill_done:
                item = self._decode_item(request, budget)
                self.cache.grow(rid, request.num_computed + item.num_tokens)
                request.capacity = max(request.capacity, request.num_computed + item.num_tokens)
            else:
                end = self._prefill_end(request, budget)
                self.cache.grow(rid, end)
                request.capacity = max(request.capacity, end)
                start = request.num_computed
                item = StepItem(request, ItemKind.PREFILL, request.prompt_ids[start:end], start)
        except PoolExhausted:
            if fresh and rid in self._created:
                self._created.discard(rid)
                self.cache.close(rid)
                request.reused_tokens = request.num_computed = request.capacity = 0
            elif resumed:
                self.cache.suspend(rid)
            return None
        if request.state is RequestState.WAITING:
            request.admitted_at = time.perf_counter()
            request.transition(RequestState.PREFILLING)
        else:
            request.transition(RequestState.DECODING if request.prefill_done else RequestState.PREFILLING)
        return item

    def _admit_transfer(self, request: Request) -> bool:
        """Create (or, for a cache it has, resume) the cache of a request that awaits its transfer: pages for its
        whole prompt, a slot, a batch row; move it to TRANSFERRING. What the cache holds already (a prefix the
        manager matched, a kept turn: ``num_computed``) is not transferred again. All or nothing (False: it holds
        nothing new and keeps its place)."""
        rid = request.request_id
        fresh = rid not in self._created
        resumed = False
        try:
            if fresh:
                self.cache.create(rid, request.prompt_ids)
                self._created.add(rid)
            info = self.cache.resume(rid)
            resumed = True
            if info.first:
                request.reused_tokens = request.num_computed = info.num_committed_tokens
            self.cache.grow(rid, request.num_prompt)
        except PoolExhausted:
            if fresh:
                self._created.discard(rid)
                self.cache.close(rid)
                request.reused_tokens = request.num_computed = 0
            elif resumed:
                self.cache.suspend(rid)
            return False
        request.capacity = max(request.capacity, request.num_prompt)
        request.admitted_at = time.perf_counter()
        request.transition(RequestState.TRANSFERRING)
        self._num_transferring += 1
        return True

    def _grow(self, request: Request, num_tokens: int, planned: set[int], preempted: list[Request]) -> bool:
        """Grow ``request`` to ``num_tokens``, preempting newer unplanned requests while pages run out."""
        if num_tokens <= request.capacity:
            return True
        granularity = self.config.grow_granularity
        capacity = -(-num_tokens // granularity) * granularity
        while True:
            try:
                self.cache.grow(request.request_id, capacity)
                request.capacity = capacity
                return True
            except PoolExhausted:
                victim = self._victim(request, planned)
                if victim is None:
                    return False
                self._preempt(victim)
                preempted.append(victim)

    def _victim(self, request: Request, planned: set[int]) -> Request | None:
        position = self._running.index(request)
        for candidate in reversed(self._running[position + 1 :]):
            if candidate.request_id not in planned and candidate.state is not RequestState.TRANSFERRING:
                return candidate
        return None

    def _preempt(self, request: Request) -> None:
        self._boundaries.pop(request.request_id, None)
        self.cache.suspend(request.request_id)
        self._running.remove(request)
        request.transition(RequestState.PREEMPTED)
        request.num_preemptions += 1
        self._num_preemptions += 1
        # older than everything still waiting: it goes first when pools free up
        self._waiting.appendleft(request)

    # --- introspection --------------------------------------------------------------------------------

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            num_steps=self._num_steps,
            num_preemptions=self._num_preemptions,
            last_step_tokens=self._last_step_tokens,
        )

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<Scheduler [{s.num_running} running, {s.num_waiting} waiting | steps {s.num_steps}, "
            f"preemptions {s.num_preemptions} | budget {self.config.token_budget}]>"
        )
