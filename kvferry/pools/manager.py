"""One lifecycle over a rank's whole cache: attention pages, state slots, snapshots, replay state and draft pages.

::

    create ──> SUSPENDED ──resume──> ACTIVE ──grow/commit──> ACTIVE ──suspend──> SUSPENDED ... ──close──> CLOSED
                     │ pages held; under pressure (or on request) moved to the host with slot and replay state
                     └─ rebalance only while every cache is SUSPENDED and no transfer touches the pools

:class:`CacheManager` is synchronous and owns the bookkeeping of every group at once. Each operation counts what
it needs across all groups (attention pages, draft pages, one state slot, one batch row) *before* it changes
anything: when the need cannot be met it raises :class:`~kvferry.errors.PoolExhausted` and nothing changed.

Token positions of one request::

    | reused prefix | committed tokens ..................| capacity (allocated, not yet committed) |
    0          reused_tokens               state_tokens  num_committed_tokens                 capacity
                                            └ the live slot is valid here; the replay buffers hold the rest

Rules that keep other requests' or stale bytes out of a request (DESIGN.md "Lifecycle", "Prefix reuse"):

- Reuse is per full block: a prefix match takes references on the cached pages and is pruned back to the last
  block that has a recurrent snapshot. Shared pages are never written: the request writes from
  ``reused_tokens`` on, which starts a new block. The first resume *copies* the matched snapshot into the
  request's own live slot (a request without a match gets a zeroed slot), and resets its replay buffers.
- Draft KV is mirrored (DESIGN.md "Draft KV"): the draft group has its own prefix index at the drafter's
  ``tokens_per_block``. Draft KV at position ``p`` depends on the token at ``p + 1`` too, so a draft block's
  chained hash covers its tokens and the next one. A block enters the index only when its draft KV is final:
  the engine reports what the drafter wrote for committed positions (:meth:`CacheManager.commit_draft`), the
  draft KV before it is final as well (no gap), and the token after the block is committed. The draft match
  is clamped to the target's reuse boundary: full draft blocks are shared read-only like attention pages; a
  block that straddles the boundary is found by the prefix of its tokens and *copied* into a private page on
  the first resume; what the match cannot cover, ``[draft_hit, reused_tokens)``, is zero-filled
  (:attr:`Resumed.draft_zeroed`). The drafter never reads recycled bytes, and a request with such a gap never
  offers its later draft blocks for reuse (their KV was computed over the zeros).
- A snapshot is taken at :meth:`CacheManager.commit` when the live slot's position (committed tokens minus
  tokens still pending in the replay buffers) lands exactly on a boundary: a multiple of ``snapshot_interval``,
  or the prompt's last full block. :meth:`CacheManager.next_snapshot_boundary` tells the engine where to end a
  prefill chunk or cap an acceptance so that it lands there.
- Offload to host saves every page, the slot and its replay buffers; resume restores them into whatever pages and
  slot it gets. Nothing that a transfer may still write is handed out: :meth:`CacheManager.close` with
  ``quarantine=True`` keeps the pages and slot until :meth:`CacheManager.release`.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, NamedTuple

import attrs
import numpy as np
import torch
from attrs import define, frozen

from kvferry.errors import ConfigError, InvalidTransition, PoolExhausted, RebalanceRefused, UnknownRequest
from kvferry.pools.arena import CacheArena, HostPages, HostSlots
from kvferry.pools.blocks import NULL_PAGE, PageHash, PagePool, hash_block, hash_blocks, root_hash
from kvferry.pools.layout import CacheLayout
from kvferry.pools.slots import DUMMY_SLOT, SlotPool

__all__ = [
    "ATTENTION",
    "DRAFT",
    "CacheManager",
    "CacheManagerConfig",
    "CacheManagerStatistics",
    "CacheState",
    "Offload",
    "Quarantine",
    "Resumed",
]

#: Name of the target's paged group (as in :class:`~kvferry.pools.layout.CacheLayout`).
ATTENTION = "attention"
#: Name of the drafter's paged group.
DRAFT = "draft"

RequestId = Hashable

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class CacheState(enum.Enum):
    """Where a request's cache is in its lifecycle."""

    SUSPENDED = "suspended"
    ACTIVE = "active"
    CLOSED = "closed"


class Offload(enum.Enum):
    """What :meth:`CacheManager.suspend` may do with the request's device memory."""

    #: keep it on the device: a transfer may be reading or writing it
    NEVER = "never"
    #: keep it on the device until another request needs the room (then it moves to the host, LRU first)
    ON_PRESSURE = "on_pressure"
    #: move it to the host now
    NOW = "now"


@frozen
class CacheManagerConfig:
    """Sizes and policies of one rank's cache manager. Counts include the reserved page / slot 0."""

    tokens_per_block: int
    num_pages: int
    num_slots: int = 0
    draft_tokens_per_block: int = 0
    num_draft_pages: int = 0
    max_batch_size: int = 64
    #: take a snapshot every this many tokens (a multiple of tokens_per_block); 0: only at the prompt's end
    snapshot_interval: int = 0
    enable_reuse: bool = True
    #: move suspended requests (``Offload.ON_PRESSURE``) to the host when an allocation is short
    offload_under_pressure: bool = True

    def __attrs_post_init__(self) -> None:
        if self.tokens_per_block <= 0:
            raise ConfigError(f"tokens_per_block must be positive, got {self.tokens_per_block}")
        if self.num_pages < 2:
            raise ConfigError(f"num_pages must be at least 2 (page 0 is reserved), got {self.num_pages}")
        if self.num_slots == 1 or self.num_slots < 0:
            raise ConfigError(f"num_slots must be 0 or at least 2 (slot 0 is reserved), got {self.num_slots}")
        if (self.draft_tokens_per_block > 0) != (self.num_draft_pages > 0):
            raise ConfigError("draft_tokens_per_block and num_draft_pages go together")
        if self.num_draft_pages == 1 or self.num_draft_pages < 0:
            raise ConfigError(f"num_draft_pages must be 0 or at least 2, got {self.num_draft_pages}")
        if self.max_batch_size <= 0:
            raise ConfigError(f"max_batch_size must be positive, got {self.max_batch_size}")
        if self.snapshot_interval < 0 or self.snapshot_interval % self.tokens_per_block:
            raise ConfigError(
                f"snapshot_interval {self.snapshot_interval} must be a non-negative multiple of "
                f"tokens_per_block {self.tokens_per_block}"
            )

    @property
    def has_state(self) -> bool:
        return self.num_slots > 0

    @property
    def has_draft(self) -> bool:
        return self.num_draft_pages > 0


@frozen
class Resumed:
    """What :meth:`CacheManager.resume` did."""

    #: prompt tokens whose KV and recurrent state came from the prefix cache (0 without a hit)
    reused_tokens: int
    #: tokens committed so far (``reused_tokens`` on the first resume)
    num_committed_tokens: int
    #: True on the request's first resume (its slot was initialised from a snapshot or zeroed)
    first: bool
    #: True when pages, slot and replay state came back from the host
    restored: bool
    #: token range ``[draft_hit, reused_tokens)`` of draft KV that the draft mirror could not reuse and that was
    #: zero-filled ((0, 0) when there is no gap). Draft proposals of the request differ from a fresh run's
    #: unless the engine recomputes this range (it needs the target's hidden states of it).
    draft_zeroed: tuple[int, int]


@define(eq=False)
class Quarantine:
    """Pages and a slot held back from reuse because a transfer may still write (or read) them.

    Created by :meth:`CacheManager.close` with ``quarantine=True``; returned to the pools by
    :meth:`CacheManager.release` (idempotent).
    """

    quarantine_id: int
    request_id: RequestId
    pages: tuple[int, ...]
    draft_pages: tuple[int, ...]
    slot: int | None
    released: bool = False


@define(eq=False)
class _HostCopy:
    pages: HostPages | None
    draft_pages: HostPages | None
    slots: HostSlots | None
    num_pages: int
    num_draft_pages: int


@define(eq=False)
class _Request:
    request_id: RequestId
    prompt: list[int]
    parent: PageHash
    state: CacheState = CacheState.SUSPENDED
    tokens: list[int] = attrs.field(factory=list)
    block_hashes: list[PageHash] = attrs.field(factory=list)
    pages: list[int] = attrs.field(factory=list)
    draft_pages: list[int] = attrs.field(factory=list)
    slot: int | None = None
    row: int | None = None
    capacity: int = 0
    reused_tokens: int = 0
    pinned: PageHash | None = None
    resumed: bool = False
    pending_replay: int = 0
    last_snapshot: int = 0
    #: chained hashes of draft blocks whose draft KV is final (block b covers tokens b*d .. (b+1)*d inclusive)
    draft_hashes: list[PageHash] = attrs.field(factory=list)
    #: draft KV of positions [0, draft_valid) is final and computed without a gap
    draft_valid: int = 0
    #: prompt tokens the draft match covers (<= reused_tokens)
    draft_hit: int = 0
    #: cached draft page whose front is copied into the straddling block on the first resume (a reference held)
    draft_source: int | None = None
    host: _HostCopy | None = None
    offload: Offload = Offload.ON_PRESSURE
    suspend_seq: int = 0

    @property
    def state_tokens(self) -> int:
        return len(self.tokens) - self.pending_replay

    def debug_state(self) -> tuple[Any, ...]:
        return (
            repr(self.request_id),
            self.state,
            len(self.tokens),
            tuple(self.pages),
            tuple(self.draft_pages),
            self.slot,
            self.row,
            self.capacity,
            self.reused_tokens,
            self.pinned,
            tuple(self.draft_hashes),
            self.draft_valid,
            self.draft_hit,
            self.draft_source,
            self.resumed,
            self.pending_replay,
            self.host is not None,
            self.offload,
        )


class CacheManagerStatistics(NamedTuple):
    """A snapshot of a :class:`CacheManager`'s counts. Reserved page / slot 0 excluded everywhere."""

    #: usable attention pages
    pages_total: int
    #: attention pages with an owner (requests, quarantines)
    pages_used: int
    #: attention pages in the free queue (cached ones included)
    pages_free: int
    #: attention pages in the prefix index
    pages_cached: int
    #: attention pages held by quarantines
    pages_quarantined: int
    #: usable state slots (0 without recurrent layers)
    slots_total: int
    #: live slots of requests (quarantined ones included)
    slots_live: int
    #: slots holding snapshots
    slots_snapshot: int
    #: slots in the free list
    slots_free: int
    #: slots held by quarantines
    slots_quarantined: int
    #: usable draft pages (0 without a drafter)
    draft_pages_total: int
    #: draft pages with an owner
    draft_pages_used: int
    #: draft pages in the free queue
    draft_pages_free: int
    #: requests ACTIVE / SUSPENDED / SUSPENDED on the host
    requests_active: int
    requests_suspended: int
    requests_offloaded: int
    #: attention-DP dummy rows in the batch
    dummies: int
    #: unreleased quarantines
    quarantines: int
    #: requests created with reuse on / of those, requests that reused at least one block
    reuse_queries: int
    reuse_hits: int
    #: prompt tokens asked for / served by prefix reuse
    reuse_query_tokens: int
    reuse_hit_tokens: int
    #: snapshots taken / evicted since construction
    snapshots_taken: int
    snapshots_evicted: int
    #: requests moved to the host / brought back
    offloads: int
    restores: int
    #: device bytes per token (attention + draft pages) and per state slot (with replay); 0 without an arena
    bytes_per_token: float
    bytes_per_slot: int
    #: draft pages in the draft prefix index
    draft_pages_cached: int = 0
    #: reused prompt tokens whose draft KV the draft mirror covered / had to zero-fill (the gap)
    draft_hit_tokens: int = 0
    draft_zeroed_tokens: int = 0


@define(eq=False)
class _Counters:
    reuse_queries: int = 0
    reuse_hits: int = 0
    reuse_query_tokens: int = 0
    reuse_hit_tokens: int = 0
    draft_hit_tokens: int = 0
    draft_zeroed_tokens: int = 0
    snapshots_taken: int = 0
    offloads: int = 0
    restores: int = 0


class CacheManager:
    """Ownership of one rank's cache by requests, with the lifecycle of DESIGN.md. Synchronous, not thread-safe.

    :param config: sizes and policies; :meth:`for_arena` derives the sizes from an arena.
    :param arena: the memory. With None only bookkeeping is done (no snapshot copies, zero-fill or offload
        bytes); useful for schedulers' dry runs and tests.
    """

    def __init__(self, config: CacheManagerConfig, arena: CacheArena | None = None) -> None:
        self.config = config
        self.arena = arena
        if arena is not None:
            _check_arena_fits(config, arena.layout)
        self._pages = PagePool(config.num_pages, name=ATTENTION)
        self._draft = PagePool(config.num_draft_pages, name=DRAFT) if config.has_draft else None
        self._slots = SlotPool(config.num_slots, name="state") if config.has_state else None
        self._requests: dict[RequestId, _Request] = {}
        self._quarantines: dict[int, Quarantine] = {}
        self._quarantine_ids = itertools.count()
        self._suspend_seq = itertools.count(1)
        self._free_rows = list(range(config.max_batch_size))
        self._dummy_rows: set[int] = set()
        device = arena.device if arena is not None else torch.device("cpu")
        self._state_indices = torch.full(
            (config.max_batch_size,), DUMMY_SLOT, dtype=torch.int64, device=device
        )
        #: row -> slot changed since state_indices was last read (written there in one go)
        self._rows: dict[int, int] = {}
        self._counters = _Counters()
        #: slot -> num_accepted recorded with ``defer=True``, not yet in the arena (see flush_num_accepted)
        self._accepted: dict[int, int] = {}

    @classmethod
    def for_arena(
        cls,
        arena: CacheArena,
        *,
        max_batch_size: int = 64,
        snapshot_interval: int = 0,
        enable_reuse: bool = True,
        offload_under_pressure: bool = True,
    ) -> CacheManager:
        """A manager over every page and slot of ``arena``."""
        layout = arena.layout
        has_draft = layout.has_group(DRAFT)
        config = CacheManagerConfig(
            tokens_per_block=layout.layer_group(ATTENTION).tokens_per_block,
            num_pages=layout.pool_group(ATTENTION).num_slots,
            num_slots=layout.num_slots,
            draft_tokens_per_block=layout.layer_group(DRAFT).tokens_per_block if has_draft else 0,
            num_draft_pages=layout.pool_group(DRAFT).num_slots if has_draft else 0,
            max_batch_size=max_batch_size,
            snapshot_interval=snapshot_interval,
            enable_reuse=enable_reuse,
            offload_under_pressure=offload_under_pressure,
        )
        return cls(config, arena)

    @property
    def state_indices(self) -> torch.Tensor:
        """``[max_batch_size]`` int64 on the arena's device: the state slot of each batch row (free and dummy rows
        hold DUMMY_SLOT).

        One tensor for the manager's life, so kernels (and CUDA graphs) may keep pointing at it; but read this
        property once per step before they run: rows changed since the last read are written then, in one go
        (a step's admissions and endings cost one tensor write, not one per request).
        """
        if self._rows:
            device = self._state_indices.device
            rows = torch.tensor(list(self._rows), dtype=torch.int64, device=device)
            slots = torch.tensor(list(self._rows.values()), dtype=torch.int64, device=device)
            self._rows.clear()
            self._state_indices.index_put_((rows,), slots)
        return self._state_indices

    # --- lifecycle -------------------------------------------------------------------------------------------

    def create(
        self,
        request_id: RequestId,
        prompt_token_ids: Sequence[int] | np.ndarray,
        *,
        reuse: bool = True,
        salt: bytes = b"",
    ) -> int:
        """Register a request, SUSPENDED, and match its prompt against the prefix cache.

        The match (at most the prompt minus its last token, whole blocks, pruned back to the last block with a
        snapshot) takes references on the cached pages and pins the snapshot, so neither is evicted before the
        first :meth:`resume` copies it. Never allocates, so never raises PoolExhausted.

        :return: the tokens the match covers (what :meth:`resume` will report as ``reused_tokens``, unless a
            :meth:`rebalance` drops the match first).

        :param reuse: match the prefix cache (the request's committed blocks are offered for reuse either way).
        :param salt: separates reuse scopes (e.g. adapters): prefixes only match within one salt.
        :raises ~kvferry.errors.InvalidTransition: if ``request_id`` is live.
        :raises ~kvferry.errors.ConfigError: on an empty prompt or token ids that are not integers.
        """
        if request_id in self._requests:
            raise InvalidTransition(f"request {request_id!r} already exists")
        prompt = list(_token_list(prompt_token_ids))  # our own copy
        if not prompt:
            raise ConfigError("a request needs at least one prompt token")
        req = _Request(request_id=request_id, prompt=prompt, parent=root_hash(salt))
        if reuse and self.config.enable_reuse:
            self._match(req)
        self._requests[request_id] = req
        return req.reused_tokens

    def resume(self, request_id: RequestId, *, capacity: int | None = None) -> Resumed:
        """SUSPENDED -> ACTIVE: give the request pages for ``capacity`` tokens, a live slot and a batch row.

        ``capacity`` defaults to the prompt length on the first resume and to the current capacity later. A
        request on the host gets new pages and a new slot and everything is restored there (replay state
        included). The first resume initialises the slot: the matched snapshot is copied in (never used in
        place), else it is zeroed; replay buffers are reset; a straddling draft block matched by its prefix is
        copied into its private page and the draft gap ``[draft_hit, reused_tokens)`` is zero-filled.
        Suspended requests may be moved to the host to make room (``Offload.ON_PRESSURE``, LRU first).

        :raises ~kvferry.errors.PoolExhausted: if pages, slots or batch rows do not suffice even after moving
            every movable suspended request; nothing changed (nothing was moved either).
        :raises ~kvferry.errors.InvalidTransition: if the request is not SUSPENDED.
        """
        req = self._get(request_id)
        if req.state is not CacheState.SUSPENDED:
            raise InvalidTransition(f"resume of {request_id!r}: it is {req.state.value}, not suspended")
        target = max(req.capacity, len(req.prompt) if not req.resumed else 0, capacity or 0)
        need_pages = self._blocks(target) - len(req.pages)
        need_draft = self._draft_blocks(target) - len(req.draft_pages)
        need_slot = 1 if self._slots is not None and req.slot is None else 0
        if not self._free_rows:
            raise PoolExhausted(
                f"resume of {request_id!r}: all {self.config.max_batch_size} batch rows are taken"
            )
        victims = self._plan(need_pages, need_draft, need_slot, exclude=req)
        self.flush_num_accepted()
        for victim in victims:
            self._offload(victim)
        # NOTE: nothing below may fail: the plan guaranteed every allocation.
        pages = self._pages.allocate(need_pages)
        draft_pages = self._draft.allocate(need_draft) if self._draft is not None else []
        slot = self._slots.allocate(need_slot)[0] if self._slots is not None and need_slot else req.slot
        first = not req.resumed
        restored = req.host is not None
        draft_zeroed = (0, 0)
        req.pages.extend(pages)
        req.draft_pages.extend(draft_pages)
        req.slot = slot
        req.capacity = target
        if req.host is not None:
            self._restore(req)
        elif first:
            draft_zeroed = self._initialise(req)
        req.resumed = True
        req.state = CacheState.ACTIVE
        req.row = heapq.heappop(self._free_rows)
        self._rows[req.row] = DUMMY_SLOT if slot is None else slot
        return Resumed(req.reused_tokens, len(req.tokens), first, restored, draft_zeroed)

    def grow(self, request_id: RequestId, capacity: int) -> None:
        """Make room for ``capacity`` tokens (committed + this step's input, draft tokens included).

        A no-op when the request already has that capacity. Suspended requests may move to the host.

        :raises ~kvferry.errors.PoolExhausted: if the pages do not suffice; nothing changed.
        :raises ~kvferry.errors.InvalidTransition: if the request is not ACTIVE.
        """
        self.grow_many(((request_id, capacity),))

    def grow_many(self, grows: Iterable[tuple[RequestId, int]]) -> None:
        """:meth:`grow` for several ``(request id, capacity)`` pairs, in order, all or nothing.

        The result is exactly that of calling :meth:`grow` for each pair in turn (the same pages, the same
        suspended requests moved to the host), except that a refusal changes nothing at all: every pair is
        checked and the pages of all of them are counted before anything is taken.

        :raises ~kvferry.errors.PoolExhausted: if the pages of all of them do not suffice; nothing changed.
        :raises ~kvferry.errors.InvalidTransition: if one of them is not ACTIVE; nothing changed.
        :raises ~kvferry.errors.UnknownRequest: if one of them does not exist; nothing changed.
        """
        requests, active = self._requests, CacheState.ACTIVE
        tpb = self.config.tokens_per_block
        draft_tpb = self.config.draft_tokens_per_block if self._draft is not None else 0
        staged: list[tuple[_Request, int, int, int]] = []
        # (capacity, pages, draft pages) of requests grown earlier in this batch
        ahead: dict[RequestId, tuple[int, int, int]] = {}
        need_pages = need_draft = 0
        for request_id, capacity in grows:
            req = requests.get(request_id)
            if req is None or req.state is not active:
                self._active(request_id, "grow")  # raises the precise error
            assert req is not None
            state = ahead.get(request_id)
            current, num_pages, num_draft = (
                (req.capacity, len(req.pages), len(req.draft_pages)) if state is None else state
            )
            if capacity <= current:
                continue
            # most decode steps stay inside the last page: no pages
            pages = -(-capacity // tpb) - num_pages
            pages = pages if pages > 0 else 0
            draft = -(-capacity // draft_tpb) - num_draft if draft_tpb else 0
            draft = draft if draft > 0 else 0
            staged.append((req, capacity, pages, draft))
            ahead[request_id] = (capacity, num_pages + pages, num_draft + draft)
            need_pages += pages
            need_draft += draft
        if need_pages or need_draft:
            victims = self._plan(need_pages, need_draft, 0)
            if victims:
                self.flush_num_accepted()
            for victim in victims:
                self._offload(victim)
        # NOTE: nothing below may fail: the plan guaranteed every allocation. One allocation per pool, handed out
        # in order: the same pages as one allocation per request (both take the free queue's head in turn).
        new_pages = self._pages.allocate(need_pages) if need_pages else []
        new_draft = self._draft.allocate(need_draft) if need_draft and self._draft is not None else []
        taken = taken_draft = 0
        for req, capacity, pages, draft in staged:
            if pages:
                req.pages.extend(new_pages[taken : taken + pages])
                taken += pages
            if draft:
                req.draft_pages.extend(new_draft[taken_draft : taken_draft + draft])
                taken_draft += draft
            req.capacity = capacity

    def commit(
        self, request_id: RequestId, token_ids: Sequence[int] | np.ndarray, *, num_pending_replay: int = 0
    ) -> None:
        """Record tokens whose KV (and state) the last model step wrote.

        Newly full blocks enter the prefix index. ``num_pending_replay`` is how many of the committed tokens the
        live slot does not contain yet (they sit in the replay buffers after a verify step); the slot is valid
        at ``num_committed_tokens - num_pending_replay``. When that position is a snapshot boundary the live
        slot is copied into a snapshot (best effort: skipped when no slot can be had).

        :raises ~kvferry.errors.InvalidTransition: if the request is not ACTIVE, the tokens exceed the capacity,
            disagree with the prompt, or the slot position would move backwards; nothing changed.
        :raises ~kvferry.errors.ConfigError: if the token ids are not 64-bit integers; nothing changed.
        """
        self.commit_many(((request_id, token_ids, num_pending_replay),))

    def commit_many(self, commits: Iterable[tuple[RequestId, Sequence[int] | np.ndarray, int]]) -> None:
        """:meth:`commit` for several ``(request id, token ids, num_pending_replay)`` triples (one engine step's
        commits), in order, all or nothing.

        The result is exactly that of calling :meth:`commit` for each triple in turn (the same prefix index
        entries, the same snapshots in the same slots), except that a refusal changes nothing at all: every
        triple is checked first, against the state the earlier triples of the batch leave (a request may
        appear more than once).

        :raises ~kvferry.errors.InvalidTransition: as :meth:`commit`, for any of them; nothing changed.
        :raises ~kvferry.errors.UnknownRequest: if one of them does not exist; nothing changed.
        :raises ~kvferry.errors.ConfigError: if token ids are not 64-bit integers; nothing changed.
        """
        # NOTE: runs for every request every engine step: checks inlined, no per-token Python work beyond
        # the integer check, blocks hashed only when they fill up
        requests, active = self._requests, CacheState.ACTIVE
        staged: list[tuple[_Request, list[int], int]] = []
        # (committed tokens, slot position) of requests committed earlier in this batch
        ahead: dict[RequestId, tuple[int, int]] = {}
        for request_id, token_ids, num_pending_replay in commits:
            req = requests.get(request_id)
            if req is None or req.state is not active:
                self._active(request_id, "commit")  # raises the precise error
            assert req is not None
            if type(token_ids) is list:  # what the engine passes: checked here, without a call
                tokens = token_ids
                for t in tokens:
                    if type(t) is not int or not INT64_MIN <= t <= INT64_MAX:
                        tokens = _token_list(token_ids)  # converts, or raises ConfigError
                        break
            else:
                tokens = _token_list(token_ids)
            state = ahead.get(request_id)
            if state is None:
                start = len(req.tokens)
                position = start - req.pending_replay
            else:
                start, position = state
            total = start + len(tokens)
            if total > req.capacity:
                raise InvalidTransition(
                    f"commit of {request_id!r}: {total} tokens exceed capacity {req.capacity}"
                )
            prompt = req.prompt
            if start < len(prompt):
                overlap = min(total, len(prompt)) - start
                if tokens[:overlap] != prompt[start : start + overlap]:
                    raise InvalidTransition(f"commit of {request_id!r}: tokens disagree with the prompt")
            if not 0 <= num_pending_replay <= total or total - num_pending_replay < position:
                raise InvalidTransition(
                    f"commit of {request_id!r}: num_pending_replay {num_pending_replay} would move the slot "
                    f"from {position} to {total - num_pending_replay}"
                )
            staged.append((req, tokens, num_pending_replay))
            ahead[request_id] = (total, total - num_pending_replay)
        # NOTE: nothing below may fail (registering owned pages and best-effort snapshots cannot)
        tpb = self.config.tokens_per_block
        draft_tpb = self.config.draft_tokens_per_block if self._draft is not None else 0
        reusable = self.config.enable_reuse
        snapshots = reusable and self._slots is not None
        for req, tokens, num_pending_replay in staged:
            req.tokens.extend(tokens)
            req.pending_replay = num_pending_replay
            total = len(req.tokens)
            if len(req.block_hashes) < total // tpb:
                self._hash_full_blocks(req, total // tpb)
            if draft_tpb and req.draft_valid - len(req.draft_hashes) * draft_tpb >= draft_tpb:
                self._hash_draft_blocks(req)
            position = total - num_pending_replay
            if (
                snapshots
                and position > req.last_snapshot
                and position % tpb == 0
                and self._is_boundary(req, position)
            ):
                self._take_snapshot(req, position)

    def commit_draft(self, request_id: RequestId, start: int, end: int) -> None:
        """Record that the drafter wrote *final* draft KV for the committed positions ``[start, end)``.

        Final: computed from the target's hidden states of those committed tokens and the token after each
        (for the last one the token the target chose next, committed by the following step). The drafter's
        speculative positions are never final. Draft blocks whose KV is final from position 0 on (a range that
        starts past the final prefix, e.g. after a zero-filled gap, extends nothing) and whose following token
        is committed enter the draft prefix index. Without a drafter group this does nothing.

        The request may be SUSPENDED (e.g. a hand-off catches its drafter up after the prefill) as long as its
        pages are on the device.

        :raises ~kvferry.errors.InvalidTransition: if the request's draft pages are not on the device (never
            resumed, or on the host) or the range is not within its committed tokens; nothing changed.
        :raises ~kvferry.errors.UnknownRequest: if the request does not exist.
        """
        req = self._get(request_id)
        if not req.resumed or req.host is not None:
            where = "on the host" if req.host is not None else "never resumed"
            raise InvalidTransition(
                f"commit_draft of {request_id!r}: its pages are not on the device ({where})"
            )
        if not 0 <= start <= end <= len(req.tokens):
            raise InvalidTransition(
                f"commit_draft of {request_id!r}: [{start}, {end}) is not within its {len(req.tokens)} "
                "committed tokens"
            )
        if self._draft is None:
            return
        if start <= req.draft_valid < end:
            req.draft_valid = end
        self._hash_draft_blocks(req)

    def suspend(self, request_id: RequestId, *, offload: Offload = Offload.ON_PRESSURE) -> None:
        """ACTIVE -> SUSPENDED: give up the batch row; keep (or with ``Offload.NOW`` move to host) the memory.

        :param offload: ``NEVER`` while a transfer may read or write the request's pages or slot.
        :raises ~kvferry.errors.InvalidTransition: if the request is not ACTIVE.
        """
        req = self._active(request_id, "suspend")
        self.flush_num_accepted()
        self._release_row(req)
        req.state = CacheState.SUSPENDED
        req.offload = offload
        req.suspend_seq = next(self._suspend_seq)
        if offload is Offload.NOW:
            self._offload(req)

    def offload(self, request_id: RequestId) -> None:
        """Move a SUSPENDED request's pages, slot and replay state to the host now (a no-op if already there).

        A request that was never resumed holds only shared prefix pages and is left alone.

        :raises ~kvferry.errors.InvalidTransition: if the request is ACTIVE.
        """
        req = self._get(request_id)
        if req.state is not CacheState.SUSPENDED:
            raise InvalidTransition(f"offload of {request_id!r}: it is {req.state.value}")
        self.flush_num_accepted()
        self._offload(req)

    def close(self, request_id: RequestId, *, quarantine: bool = False) -> Quarantine | None:
        """Any state -> CLOSED: every page, slot, pin, batch row and host copy of the request is released.

        Idempotent: closing an unknown or closed request does nothing and returns None.

        :param quarantine: keep the request's pages, draft pages and slot out of the pools until
            :meth:`release` (a transfer may still write or read them); the returned handle says which.
        """
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        self.flush_num_accepted()
        self._release_row(req)
        if req.pinned is not None:
            assert self._slots is not None
            self._slots.unpin(req.pinned)
            req.pinned = None
        self._drop_draft_source(req)
        ticket = None
        if quarantine:
            ticket = Quarantine(
                next(self._quarantine_ids), request_id, tuple(req.pages), tuple(req.draft_pages), req.slot
            )
            self._quarantines[ticket.quarantine_id] = ticket
        else:
            self._free_memory(req.pages, req.draft_pages, req.slot)
        req.pages, req.draft_pages, req.slot, req.host = [], [], None, None
        req.state = CacheState.CLOSED
        return ticket

    def release(self, quarantine: Quarantine) -> None:
        """Return a quarantine's pages and slot to the pools. Idempotent."""
        if quarantine.released:
            return
        if self._quarantines.pop(quarantine.quarantine_id, None) is not quarantine:
            raise UnknownRequest(f"quarantine {quarantine.quarantine_id} does not belong to this manager")
        self.flush_num_accepted()
        self._free_memory(quarantine.pages, quarantine.draft_pages, quarantine.slot)
        quarantine.released = True

    # --- replay state ------------------------------------------------------------------------------------------

    def set_num_accepted(self, request_id: RequestId, num_accepted: int, *, defer: bool = False) -> None:
        """Record a verify step's acceptance: in the live slot, or in the host copy of a suspended request.

        :param defer: queue the write to a live slot instead of writing it now (one tensor write per slot is
            costly per request and step): every queued write lands at once in :meth:`flush_num_accepted`,
            which runs before anything of this manager that moves, copies, frees or resets a slot; call it
            before a model step reads ``num_accepted``.
        """
        req = self._get(request_id)
        if self.arena is None or self._slots is None:
            return
        if req.host is not None and req.host.slots is not None and req.host.slots.num_accepted is not None:
            req.host.slots.num_accepted.fill_(num_accepted)
        elif req.slot is not None:
            if defer:
                self._accepted[req.slot] = num_accepted
                return
            self.flush_num_accepted()
            self.arena.num_accepted[req.slot] = num_accepted

    def flush_num_accepted(self) -> None:
        """Write every ``set_num_accepted(..., defer=True)`` still queued into the arena (one tensor write)."""
        if not self._accepted:
            return
        assert self.arena is not None
        device = self.arena.num_accepted.device
        slots = torch.tensor(list(self._accepted), dtype=torch.int64, device=device)
        values = torch.tensor(list(self._accepted.values()), dtype=torch.int64, device=device)
        self._accepted.clear()
        self.arena.num_accepted.index_put_((slots,), values)

    def drop_replay(self, request_id: RequestId) -> None:
        """Forget the request's replay state (it continues as a fresh context): ``num_accepted = 0``."""
        req = self._get(request_id)
        if self.arena is None or self._slots is None:
            return
        self.flush_num_accepted()
        if req.host is not None and req.host.slots is not None:
            req.host.slots.replay = None
            req.host.slots.num_accepted = None
        elif req.slot is not None:
            self.arena.reset_replay([req.slot])

    # --- attention-DP dummies --------------------------------------------------------------------------------

    def add_dummy(self) -> int:
        """Take a batch row for an attention-DP dummy request; its slot is DUMMY_SLOT, its page NULL_PAGE.

        Real requests keep their rows. :raises ~kvferry.errors.PoolExhausted: if every row is taken.
        """
        if not self._free_rows:
            raise PoolExhausted(f"all {self.config.max_batch_size} batch rows are taken")
        row = heapq.heappop(self._free_rows)
        self._dummy_rows.add(row)
        self._rows[row] = DUMMY_SLOT
        return row

    def remove_dummy(self, row: int) -> None:
        """Give a dummy's batch row back. Idempotent."""
        if row in self._dummy_rows:
            self._dummy_rows.remove(row)
            heapq.heappush(self._free_rows, row)

    # --- pools ---------------------------------------------------------------------------------------------------

    def rebalance(
        self,
        *,
        num_pages: int | None = None,
        num_slots: int | None = None,
        num_draft_pages: int | None = None,
        arena: CacheArena | None = None,
    ) -> None:
        """Change pool sizes. Only while every cache is SUSPENDED, no dummy row and no quarantine exists, and
        no suspended request is marked ``Offload.NEVER`` (a transfer may touch it).

        Every suspended request moves to the host (it is restored on resume); a request never resumed forgets
        its prefix match (it will report ``reused_tokens == 0``); the prefix cache and snapshots are dropped.
        With an arena, the new one (``arena``, or one built here on the same device) must have exactly the new
        counts, and its replay buffers must cover every state slot.

        :raises ~kvferry.errors.RebalanceRefused: if any condition fails; nothing changed.
        """
        config = attrs.evolve(
            self.config,
            num_pages=self.config.num_pages if num_pages is None else num_pages,
            num_slots=self.config.num_slots if num_slots is None else num_slots,
            num_draft_pages=self.config.num_draft_pages if num_draft_pages is None else num_draft_pages,
        )
        busy = [r.request_id for r in self._requests.values() if r.state is CacheState.ACTIVE]
        if busy:
            raise RebalanceRefused(f"requests are active: {busy[:4]!r}")
        pinned = [r.request_id for r in self._requests.values() if r.offload is Offload.NEVER and r.resumed]
        if pinned:
            raise RebalanceRefused(f"suspended requests may be in transfer (Offload.NEVER): {pinned[:4]!r}")
        if self._quarantines:
            raise RebalanceRefused(
                f"{len(self._quarantines)} quarantines: transfers may still touch the pools"
            )
        if self._dummy_rows:
            raise RebalanceRefused(f"{len(self._dummy_rows)} dummy rows are in the batch")
        if config.has_state != self.config.has_state or config.has_draft != self.config.has_draft:
            raise RebalanceRefused("a rebalance cannot add or remove a pool group")
        new_arena = arena
        if self.arena is None and arena is not None:
            raise RebalanceRefused("this manager has no arena to replace")
        if self.arena is not None and new_arena is None:
            layout = self.arena.layout
            try:
                new_layout = CacheLayout.build(
                    layout.spec,
                    num_pages=config.num_pages,
                    num_slots=config.num_slots,
                    num_draft_pages=config.num_draft_pages,
                    max_replay_tokens=layout.replay.max_tokens,
                )
            except ConfigError as exc:
                raise RebalanceRefused(str(exc)) from exc
            new_arena = CacheArena(new_layout, self.arena.device)
        if new_arena is not None:
            assert self.arena is not None
            try:
                _check_arena_fits(config, new_arena.layout)
            except ConfigError as exc:
                raise RebalanceRefused(str(exc)) from exc
            old, new = self.arena.layout.replay, new_arena.layout.replay
            if config.has_state and (new.num_slots < config.num_slots or new.max_tokens < old.max_tokens):
                raise RebalanceRefused(
                    f"replay buffers hold {new.num_slots} slots x {new.max_tokens} tokens; the state pool needs "
                    f"{config.num_slots} x {old.max_tokens}: they must grow with it"
                )
        self.flush_num_accepted()
        for req in self._requests.values():
            if not req.resumed:
                self._forget_match(req)
            else:
                self._offload(req)
        self.config = config
        self.arena = new_arena
        self._pages = PagePool(config.num_pages, name=ATTENTION)
        self._draft = PagePool(config.num_draft_pages, name=DRAFT) if config.has_draft else None
        evicted = self._slots.snapshots_evicted if self._slots is not None else 0
        self._slots = SlotPool(config.num_slots, name="state") if config.has_state else None
        if self._slots is not None:
            self._slots.snapshots_evicted = evicted

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (attention and draft) and unpinned snapshot (e.g. after new weights).
        Owned pages stay owned."""
        self._pages.clear_cache()
        if self._draft is not None:
            self._draft.clear_cache()
        if self._slots is not None:
            self._slots.clear_snapshots()

    # --- what the model needs ------------------------------------------------------------------------------------

    def block_table(self, request_id: RequestId) -> Sequence[int]:
        """Attention page ids of the request, block by block (the manager's list: do not mutate)."""
        return self._get(request_id).pages

    def draft_block_table(self, request_id: RequestId) -> Sequence[int]:
        """Draft page ids of the request, block by block (``draft_tokens_per_block`` tokens each)."""
        return self._get(request_id).draft_pages

    def slot_id(self, request_id: RequestId) -> int | None:
        """The request's live state slot (None while on the host, never resumed, or without state)."""
        return self._get(request_id).slot

    def batch_row(self, request_id: RequestId) -> int | None:
        """The request's row in :attr:`state_indices` while ACTIVE, else None."""
        return self._get(request_id).row

    def state(self, request_id: RequestId) -> CacheState:
        """The request's lifecycle state (CLOSED requests are forgotten: UnknownRequest)."""
        return self._get(request_id).state

    def num_committed_tokens(self, request_id: RequestId) -> int:
        return len(self._get(request_id).tokens)

    def capacity(self, request_id: RequestId) -> int:
        return self._get(request_id).capacity

    def reused_tokens(self, request_id: RequestId) -> int:
        return self._get(request_id).reused_tokens

    def is_offloaded(self, request_id: RequestId) -> bool:
        return self._get(request_id).host is not None

    def next_snapshot_boundary(self, request_id: RequestId) -> int | None:
        """The next token position past the live slot's where a snapshot is wanted (end prefill chunks there)."""
        req = self._get(request_id)
        if self._slots is None or not self.config.enable_reuse:
            return None
        position = len(req.tokens) - req.pending_replay
        tpb, interval = self.config.tokens_per_block, self.config.snapshot_interval
        boundary = (position // interval + 1) * interval if interval else None
        prompt_end = len(req.prompt) // tpb * tpb
        if prompt_end > position and (boundary is None or prompt_end < boundary):
            return prompt_end
        return boundary

    def request_ids(self) -> list[RequestId]:
        return list(self._requests)

    # --- state -----------------------------------------------------------------------------------------------------

    def statistics(self) -> CacheManagerStatistics:
        pages = self._pages.statistics()
        slots = self._slots.statistics() if self._slots is not None else None
        draft = self._draft.statistics() if self._draft is not None else None
        states = Counter(r.state for r in self._requests.values())
        offloaded = sum(1 for r in self._requests.values() if r.host is not None)
        q_pages = {p for q in self._quarantines.values() for p in q.pages}
        q_slots = sum(1 for q in self._quarantines.values() if q.slot is not None)
        c = self._counters
        bytes_per_token = 0.0
        bytes_per_slot = 0
        if self.arena is not None:
            layout = self.arena.layout
            bytes_per_token = sum(layout.bytes_per_token(g.name) for g in layout.paged_groups)
            bytes_per_slot = layout.bytes_per_slot
        return CacheManagerStatistics(
            pages_total=pages.num_pages,
            pages_used=pages.used,
            pages_free=pages.free,
            pages_cached=pages.cached,
            pages_quarantined=len(q_pages),
            slots_total=slots.num_slots if slots else 0,
            slots_live=slots.live if slots else 0,
            slots_snapshot=slots.snapshot if slots else 0,
            slots_free=slots.free if slots else 0,
            slots_quarantined=q_slots,
            draft_pages_total=draft.num_pages if draft else 0,
            draft_pages_used=draft.used if draft else 0,
            draft_pages_free=draft.free if draft else 0,
            requests_active=states[CacheState.ACTIVE],
            requests_suspended=states[CacheState.SUSPENDED],
            requests_offloaded=offloaded,
            dummies=len(self._dummy_rows),
            quarantines=len(self._quarantines),
            reuse_queries=c.reuse_queries,
            reuse_hits=c.reuse_hits,
            reuse_query_tokens=c.reuse_query_tokens,
            reuse_hit_tokens=c.reuse_hit_tokens,
            snapshots_taken=c.snapshots_taken,
            snapshots_evicted=self._slots.snapshots_evicted if self._slots is not None else 0,
            offloads=c.offloads,
            restores=c.restores,
            bytes_per_token=bytes_per_token,
            bytes_per_slot=bytes_per_slot,
            draft_pages_cached=draft.cached if draft else 0,
            draft_hit_tokens=c.draft_hit_tokens,
            draft_zeroed_tokens=c.draft_zeroed_tokens,
        )

    def __repr__(self) -> str:
        s = self.statistics()
        parts = [f"pages: {s.pages_used} used, {s.pages_free} free, {s.pages_cached} cached"]
        if self._slots is not None:
            parts.append(f"slots: {s.slots_live} live, {s.slots_snapshot} snapshot, {s.slots_free} free")
        if self._draft is not None:
            parts.append(f"draft pages: {s.draft_pages_used} used, {s.draft_pages_free} free")
        parts.append(f"reuse: {s.reuse_hits}/{s.reuse_queries} hits")
        parts.append(
            f"requests: {s.requests_active} active, {s.requests_suspended} suspended "
            f"({s.requests_offloaded} on host)"
        )
        if s.quarantines:
            parts.append(f"{s.quarantines} quarantined")
        parts.append(f"{s.bytes_per_token:g} B/token")
        return f"<CacheManager [{' | '.join(parts)}]>"

    def debug_state(self) -> tuple[Any, ...]:
        """Every piece of bookkeeping as comparable tuples: equal before and after an operation that failed."""
        return (
            self.statistics(),
            self._pages.debug_state(),
            None if self._draft is None else self._draft.debug_state(),
            None if self._slots is None else self._slots.debug_state(),
            tuple(r.debug_state() for r in self._requests.values()),
            tuple(sorted(self._free_rows)),
            tuple(sorted(self._dummy_rows)),
            tuple(self.state_indices.tolist()),
            tuple(sorted(self._quarantines)),
            tuple(sorted(self._accepted.items())),
        )

    # --- internals -------------------------------------------------------------------------------------------------

    def _get(self, request_id: RequestId) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise UnknownRequest(f"unknown request {request_id!r}") from None

    def _active(self, request_id: RequestId, what: str) -> _Request:
        req = self._get(request_id)
        if req.state is not CacheState.ACTIVE:
            raise InvalidTransition(f"{what} of {request_id!r}: it is {req.state.value}, not active")
        return req

    def _blocks(self, tokens: int) -> int:
        return math.ceil(tokens / self.config.tokens_per_block)

    def _draft_blocks(self, tokens: int) -> int:
        return math.ceil(tokens / self.config.draft_tokens_per_block) if self._draft is not None else 0

    def _is_boundary(self, req: _Request, position: int) -> bool:
        tpb, interval = self.config.tokens_per_block, self.config.snapshot_interval
        if self._slots is None or position <= 0 or position % tpb:
            return False
        return (interval > 0 and position % interval == 0) or position == len(req.prompt) // tpb * tpb

    def _match(self, req: _Request) -> None:
        tpb = self.config.tokens_per_block
        usable = (len(req.prompt) - 1) // tpb * tpb
        hashes = hash_blocks(req.prompt[:usable], tpb, parent=req.parent)
        pages = self._pages.match(hashes)
        count = len(pages)
        if self._slots is not None:
            while count and self._slots.snapshot(hashes[count - 1]) is None:
                count -= 1
        self._counters.reuse_queries += 1
        self._counters.reuse_query_tokens += usable
        if not count:
            return
        self._pages.touch(pages[:count])
        if self._slots is not None:
            self._slots.pin(hashes[count - 1])
            req.pinned = hashes[count - 1]
        reused = count * tpb
        req.pages = pages[:count]
        req.tokens = req.prompt[:reused]
        req.block_hashes = hashes[:count]
        req.capacity = req.reused_tokens = req.last_snapshot = reused
        self._counters.reuse_hits += 1
        self._counters.reuse_hit_tokens += reused
        self._match_draft(req)

    def _match_draft(self, req: _Request) -> None:
        """The draft mirror's match, clamped to the target's reuse boundary: full draft blocks (shared), then the
        block that straddles the boundary by the prefix of its tokens (a reference on the cached page, copied on
        the first resume). Each block's hash covers the token after it, which the prompt always has here."""
        draft, reused = self._draft, req.reused_tokens
        if draft is None or not reused:
            return
        d, prompt = self.config.draft_tokens_per_block, req.prompt
        full = reused // d
        parent = req.parent
        for b in range(full):
            key = hash_block(parent, prompt[b * d : (b + 1) * d + 1])
            page = draft.lookup(key)
            if page is None:
                break
            req.draft_pages.append(page)
            req.draft_hashes.append(key)
            parent = key
        req.draft_hit = len(req.draft_pages) * d
        if len(req.draft_pages) == full and reused % d:
            req.draft_source = draft.match_partial(parent, prompt[full * d : reused + 1])
            if req.draft_source is not None:
                req.draft_hit = reused
        draft.touch(req.draft_pages if req.draft_source is None else [*req.draft_pages, req.draft_source])
        self._counters.draft_hit_tokens += req.draft_hit

    def _drop_draft_source(self, req: _Request) -> None:
        if req.draft_source is not None:
            assert self._draft is not None
            self._draft.free([req.draft_source])
            req.draft_source = None

    def _forget_match(self, req: _Request) -> None:
        self._pages.free(req.pages)
        if self._draft is not None:
            self._draft.free(req.draft_pages)
        self._drop_draft_source(req)
        if req.pinned is not None:
            assert self._slots is not None
            self._slots.unpin(req.pinned)
        req.pages, req.tokens, req.block_hashes, req.pinned = [], [], [], None
        req.draft_pages, req.draft_hashes = [], []
        req.capacity = req.reused_tokens = req.last_snapshot = req.draft_hit = req.draft_valid = 0

    def _initialise(self, req: _Request) -> tuple[int, int]:
        """First resume: the live slot from the pinned snapshot (or zeros), fresh replay, the straddling draft
        block copied into its private page, the draft gap zeroed. Returns the gap."""
        if self._slots is not None and req.slot is not None:
            if req.pinned is not None:
                snapshot = self._slots.snapshot(req.pinned)
                assert snapshot is not None
                if self.arena is not None:
                    self.arena.copy_slots([snapshot.slot_id], [req.slot])
                self._slots.unpin(req.pinned)
                req.pinned = None
            elif self.arena is not None:
                self.arena.zero_slots([req.slot])
            if self.arena is not None:
                self.arena.reset_replay([req.slot])
        if self._draft is None or not req.reused_tokens:
            return (0, 0)
        d, reused, hit = self.config.draft_tokens_per_block, req.reused_tokens, req.draft_hit
        if req.draft_source is not None:
            # the straddling block: its front is reused, its back will be written: never in place
            if self.arena is not None:
                self.arena.copy_pages(DRAFT, [req.draft_source], [req.draft_pages[reused // d]])
            self._drop_draft_source(req)
        req.draft_valid = hit
        if hit >= reused:
            return (0, 0)
        # no straddling block was matched, so the gap starts at a block edge and its pages are private
        gap = req.draft_pages[hit // d : self._draft_blocks(reused)]
        if self.arena is not None and gap:
            self.arena.zero_pages(DRAFT, gap)
        self._counters.draft_zeroed_tokens += reused - hit
        return (hit, reused)

    def _hash_full_blocks(self, req: _Request, num_blocks: int) -> None:
        """Hash the request's newly full blocks (up to ``num_blocks``) and offer their pages for reuse."""
        tpb, tokens, hashes = self.config.tokens_per_block, req.tokens, req.block_hashes
        reusable = self.config.enable_reuse
        parent = hashes[-1] if hashes else req.parent
        for index in range(len(hashes), num_blocks):
            parent = hash_block(parent, tokens[index * tpb : (index + 1) * tpb])
            hashes.append(parent)
            if reusable:
                self._pages.register(req.pages[index], parent)

    def _hash_draft_blocks(self, req: _Request) -> None:
        """Hash (and offer for reuse) draft blocks whose KV is final and whose following token is committed."""
        assert self._draft is not None
        d, tokens, hashes = self.config.draft_tokens_per_block, req.tokens, req.draft_hashes
        reusable = self.config.enable_reuse
        for b in range(len(hashes), min(req.draft_valid, len(tokens) - 1) // d):
            parent = hashes[-1] if hashes else req.parent
            block = tokens[b * d : (b + 1) * d + 1]
            key = hash_block(parent, block)
            hashes.append(key)
            if reusable:
                self._draft.register(req.draft_pages[b], key, parent=parent, tokens=block)

    def _take_snapshot(self, req: _Request, position: int) -> None:
        assert self._slots is not None
        req.last_snapshot = position
        if req.slot is None:
            return
        snapshot_slot = self._slots.add_snapshot(
            req.block_hashes[position // self.config.tokens_per_block - 1], position
        )
        if snapshot_slot is None:
            return
        if self.arena is not None:
            self.arena.copy_slots([req.slot], [snapshot_slot])
        self._counters.snapshots_taken += 1

    def _plan(
        self, pages: int, draft_pages: int, slots: int, *, exclude: _Request | None = None
    ) -> list[_Request]:
        """Suspended requests to move to the host so the need fits; raises PoolExhausted if it cannot."""
        if pages <= 0 and draft_pages <= 0 and slots <= 0:
            return []
        free_pages = self._pages.num_free_pages
        free_draft = self._draft.num_free_pages if self._draft is not None else 0
        free_slots = self._slots.num_available if self._slots is not None and slots > 0 else 0

        def fits(freed_pages: int, freed_draft: int, freed_slots: int) -> bool:
            return (
                pages <= free_pages + freed_pages
                and draft_pages <= free_draft + freed_draft
                and slots <= free_slots + freed_slots
            )

        if fits(0, 0, 0):
            return []
        victims: list[_Request] = []
        if self.config.offload_under_pressure:
            candidates = sorted(
                (
                    r
                    for r in self._requests.values()
                    if r is not exclude
                    and r.state is CacheState.SUSPENDED
                    and r.offload is not Offload.NEVER
                    and r.resumed
                    and r.host is None
                ),
                key=lambda r: r.suspend_seq,
            )
            held: Counter[int] = Counter()
            held_draft: Counter[int] = Counter()
            freed_slots = 0
            draft = self._draft
            for victim in candidates:
                victims.append(victim)
                held.update(victim.pages)
                held_draft.update(victim.draft_pages)
                freed_slots += victim.slot is not None
                freed_pages = sum(1 for p, n in held.items() if n == self._pages.ref_cnt(p))
                freed_draft = (
                    sum(1 for p, n in held_draft.items() if n == draft.ref_cnt(p)) if draft is not None else 0
                )
                if fits(freed_pages, freed_draft, freed_slots):
                    return victims
        raise PoolExhausted(
            f"need {pages} pages ({free_pages} free), {draft_pages} draft pages ({free_draft} free), "
            f"{slots} slots ({free_slots} available); {len(victims)} suspended requests could move to the host"
        )

    def _offload(self, req: _Request) -> None:
        if req.host is not None or not req.resumed:
            return
        host = _HostCopy(None, None, None, len(req.pages), len(req.draft_pages))
        if self.arena is not None:
            if req.pages:
                host.pages = self.arena.save_pages(ATTENTION, req.pages)
            if req.draft_pages:
                host.draft_pages = self.arena.save_pages(DRAFT, req.draft_pages)
            if req.slot is not None:
                host.slots = self.arena.save_slots([req.slot], replay=True)
        self._free_memory(req.pages, req.draft_pages, req.slot)
        req.pages, req.draft_pages, req.slot = [], [], None
        req.host = host
        self._counters.offloads += 1

    def _restore(self, req: _Request) -> None:
        host = req.host
        assert host is not None
        if self.arena is not None:
            if host.pages is not None:
                self.arena.restore_pages(ATTENTION, req.pages[: host.num_pages], host.pages)
            if host.draft_pages is not None:
                self.arena.restore_pages(DRAFT, req.draft_pages[: host.num_draft_pages], host.draft_pages)
            if host.slots is not None and req.slot is not None:
                self.arena.restore_slots([req.slot], host.slots)
        if self.config.enable_reuse:
            for page, block_hash in zip(req.pages, req.block_hashes, strict=False):
                self._pages.register(page, block_hash)
            if self._draft is not None:
                d = self.config.draft_tokens_per_block
                for b, (page, key) in enumerate(zip(req.draft_pages, req.draft_hashes, strict=False)):
                    parent = req.draft_hashes[b - 1] if b else req.parent
                    block = req.tokens[b * d : (b + 1) * d + 1]
                    self._draft.register(page, key, parent=parent, tokens=block)
        req.host = None
        self._counters.restores += 1

    def _free_memory(self, pages: Sequence[int], draft_pages: Sequence[int], slot: int | None) -> None:
        self._pages.free(pages)
        if self._draft is not None:
            self._draft.free(draft_pages)
        if slot is not None:
            assert self._slots is not None
            self._slots.free([slot])

    def _release_row(self, req: _Request) -> None:
        if req.row is not None:
            self._rows[req.row] = DUMMY_SLOT
            heapq.heappush(self._free_rows, req.row)
            req.row = None


def _token_list(token_ids: Iterable[int] | np.ndarray) -> list[int]:
    """Token ids as a list of Python ints (a list input of int64 ints is returned as is, not copied)."""
    if type(token_ids) is list or type(token_ids) is tuple:  # the per-step fast path
        for t in token_ids:
            if type(t) is not int or not INT64_MIN <= t <= INT64_MAX:
                break
        else:
            return token_ids if type(token_ids) is list else list(token_ids)
    try:
        array = np.asarray(token_ids)
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            raise ConfigError(
                f"token ids must be a 1-D sequence of 64-bit integers, got {array.dtype} {array.shape}"
            )
        if array.dtype == np.uint64 and array.size and int(array.max()) > INT64_MAX:
            raise ConfigError("token ids must be 64-bit integers, got values above 2**63 - 1")
        return [int(t) for t in array.tolist()]
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(f"token ids must be a 1-D sequence of 64-bit integers: {exc}") from None


def _check_arena_fits(config: CacheManagerConfig, layout: CacheLayout) -> None:
    """The arena has exactly the pages and slots the config counts (so no id can fall outside it)."""
    checks = [(ATTENTION, config.num_pages, config.tokens_per_block)]
    if config.has_draft:
        checks.append((DRAFT, config.num_draft_pages, config.draft_tokens_per_block))
    elif layout.has_group(DRAFT):
        raise ConfigError("the arena has a draft group but the config has no draft pages")
    for name, count, tpb in checks:
        if layout.pool_group(name).num_slots != count or layout.layer_group(name).tokens_per_block != tpb:
            raise ConfigError(
                f"arena group {name} has {layout.pool_group(name).num_slots} pages of "
                f"{layout.layer_group(name).tokens_per_block} tokens; config says {count} of {tpb}"
            )
    if layout.num_slots != config.num_slots:
        raise ConfigError(f"arena has {layout.num_slots} state slots; config says {config.num_slots}")
    if NULL_PAGE != 0 or DUMMY_SLOT != 0:  # pragma: no cover - the reserved ids are part of the contract
        raise ConfigError("reserved page and slot ids must be 0")
