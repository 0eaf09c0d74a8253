"""One lifecycle over a rank's whole cache: attention pages, state slots, snapshots, replay state and draft pages.

:class:`CacheManager` is the one object the engine, the scheduler and the disaggregation roles drive. It is
synchronous and owns the bookkeeping of every group at once; each concept lives in a module of its own, and the
manager composes them:

- :mod:`~kvferry.pools.lifecycle`: the states SUSPENDED, ACTIVE and CLOSED, the one transition table, and the
  state each operation needs;
- :mod:`~kvferry.pools.record`: what one request holds (pages, draft pages, slot, batch row, host copy) and
  where its tokens stand;
- :mod:`~kvferry.pools.prefix`: prefix reuse of attention pages and recurrent-state snapshots;
- :mod:`~kvferry.pools.draft_mirror`: reuse of the drafter's KV, clamped to the target's reuse boundary;
- :mod:`~kvferry.pools.capacity` and :mod:`~kvferry.pools.commits`: one engine step's grows and commits, all
  or nothing;
- :mod:`~kvferry.pools.offload`: suspended requests moved to the host and back, at once or in two phases
  (:mod:`~kvferry.pools.moves`, :mod:`~kvferry.pools.host_memory`);
- :mod:`~kvferry.pools.rebalance`: new pool sizes;
- :mod:`~kvferry.pools.batch_rows`, :mod:`~kvferry.pools.replay`, :mod:`~kvferry.pools.quarantine` and
  :mod:`~kvferry.pools.statistics`.

The rules they keep together (docs/design.md, sections "Lifecycle", "Prefix reuse" and "Draft KV"):

- Lifecycle. A request is created SUSPENDED; resume makes it ACTIVE with a batch row, pages for its capacity
  and a live slot; only an ACTIVE request grows and commits; suspend gives the row back and keeps the memory,
  which may move to the host; close releases everything (or quarantines it while a transfer may still touch
  it). A rebalance happens only while every cache is SUSPENDED and no transfer touches the pools.
- All or nothing. Each operation counts what it needs across all groups (attention pages, draft pages, one
  state slot, one batch row) *before* it changes anything: when the need cannot be met it raises
  :class:`~kvferry.errors.PoolExhausted` and nothing changed, not even an offload.
- Prefix reuse. Reuse is per full block, pruned back to the last block with a recurrent snapshot; shared pages
  are never written (the request writes from ``reused_tokens`` on, a new block); the first resume *copies* the
  matched snapshot into the request's own live slot (zeros without a match) and resets its replay buffers. A
  snapshot is taken when the live slot's position lands exactly on a boundary (:meth:`CacheManager.commit`,
  :meth:`CacheManager.next_snapshot_boundary`).
- Draft KV. The draft group mirrors the prefix index at the drafter's block size; a draft block is indexed
  only when its draft KV is final and the token after it is committed (:meth:`CacheManager.commit_draft`). The
  draft match is clamped to the target's reuse boundary; a straddling block is copied, never shared; what the
  match cannot cover is zero-filled (:attr:`Resumed.draft_zeroed`), so the drafter never reads recycled bytes.
  The blocks the drafter computes after such a gap are indexed too (the gap's zeros with them), so a next turn
  matches past it; the proposals of a request that matches them may differ from a fresh run's, its tokens
  never do.
- No stale bytes. Offload saves every page, the slot and its replay buffers, and resume restores them into
  whatever pages and slot it gets; nothing a transfer may still write is handed out.
- Moves. A two-phase offload or restore (:meth:`CacheManager.start_offload`, :meth:`CacheManager.start_restore`,
  :meth:`CacheManager.finish`) copies outside the manager's thread; while it is in flight the request is
  *moving*: never a pressure victim, and nothing may resume, pin, offload, draft into or record replay state
  of it (:class:`~kvferry.errors.CacheMoving`); a close frees its memory only once the copy ended.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from kvferry.errors import CacheMoving, ConfigError, InvalidTransition, PoolExhausted, RebalanceRefused
from kvferry.pools.arena import CacheArena
from kvferry.pools.batch_rows import BatchRows
from kvferry.pools.blocks import root_hash
from kvferry.pools.capacity import plan_grows, resume_capacity
from kvferry.pools.commits import Commit, check_commits, record_commits
from kvferry.pools.config import ATTENTION, DRAFT, CacheManagerConfig
from kvferry.pools.draft_mirror import DraftMirror
from kvferry.pools.lifecycle import CacheState, Offload, Resumed, require_state
from kvferry.pools.moves import MoveKind, MoveState, PendingMove
from kvferry.pools.offload import HostOffload
from kvferry.pools.prefix import PrefixReuse
from kvferry.pools.quarantine import Quarantine, Quarantines
from kvferry.pools.rank_pools import RankPools
from kvferry.pools.rebalance import plan_rebalance
from kvferry.pools.record import RequestId, RequestRecord, find_record, token_list
from kvferry.pools.replay import ReplayState
from kvferry.pools.statistics import CacheManagerStatistics, Counters, collect_statistics, describe_statistics

__all__ = [
    "ATTENTION",
    "DRAFT",
    "CacheManager",
    "CacheManagerConfig",
    "CacheManagerStatistics",
    "CacheState",
    "MoveKind",
    "MoveState",
    "Offload",
    "PendingMove",
    "Quarantine",
    "Resumed",
]


class CacheManager:
    """Ownership of one rank's cache by requests, with the lifecycle above. Synchronous, not thread-safe.

    :param config: sizes and policies; :meth:`for_arena` derives the sizes from an arena.
    :param arena: the memory. With None only bookkeeping is done (no snapshot copies, zero-fill or offload
        bytes); useful for schedulers' dry runs and tests.
    :raises ~kvferry.errors.ConfigError: if ``arena`` does not hold exactly the config's pages and slots.
    """

    def __init__(self, config: CacheManagerConfig, arena: CacheArena | None = None) -> None:
        self._pools = RankPools.build(config, arena)
        self._requests: dict[RequestId, RequestRecord] = {}
        self._counters = Counters()
        device = arena.device if arena is not None else torch.device("cpu")
        self._rows = BatchRows(config.max_batch_size, device)
        self._replay = ReplayState(self._pools)
        self._prefix = PrefixReuse(self._pools, self._counters)
        self._draft_mirror = DraftMirror(self._pools, self._counters)
        self._host = HostOffload(self._pools, self._counters)
        self._quarantines = Quarantines()
        self._suspend_seq = itertools.count(1)

    @classmethod
    def for_arena(
        cls,
        arena: CacheArena,
        *,
        max_batch_size: int = 64,
        snapshot_interval: int = 0,
        enable_reuse: bool = True,
        enable_draft_reuse: bool = True,
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
            enable_draft_reuse=enable_draft_reuse,
            offload_under_pressure=offload_under_pressure,
        )
        return cls(config, arena)

    @property
    def config(self) -> CacheManagerConfig:
        """The sizes and policies now (a :meth:`rebalance` changes the sizes)."""
        return self._pools.config

    @property
    def arena(self) -> CacheArena | None:
        """The memory now (a :meth:`rebalance` may replace it); None: bookkeeping only."""
        return self._pools.arena

    @property
    def state_indices(self) -> torch.Tensor:
        """``[max_batch_size]`` int64 on the arena's device: the state slot of each batch row (free and dummy rows
        hold DUMMY_SLOT).

        One tensor for the manager's life, so kernels (and CUDA graphs) may keep pointing at it; but read this
        property once per step before they run: rows changed since the last read are written then, in one go
        (a step's admissions and endings cost one tensor write, not one per request).
        """
        return self._rows.state_indices

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
        prompt = list(token_list(prompt_token_ids))  # our own copy
        if not prompt:
            raise ConfigError("a request needs at least one prompt token")
        record = RequestRecord(request_id=request_id, prompt=prompt, parent=root_hash(salt))
        if reuse and self.config.enable_reuse:
            self._prefix.match(record)
            self._draft_mirror.match(record)
        self._requests[request_id] = record
        return record.reused_tokens

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
        :raises ~kvferry.errors.InvalidTransition: if the request is not SUSPENDED (:class:`~kvferry.errors.
            CacheMoving` while it is moving).
        """
        record = self._get(request_id)
        require_state(request_id, record.state, "resume")
        _still(record, "resume")
        pools = self._pools
        target = resume_capacity(record, capacity)
        need_pages = pools.blocks(target) - len(record.pages)
        need_draft = pools.draft_blocks(target) - len(record.draft_pages)
        need_slot = 1 if pools.slots is not None and record.slot is None else 0
        if not self._rows.has_free:
            raise PoolExhausted(
                f"resume of {request_id!r}: all {self.config.max_batch_size} batch rows are taken"
            )
        victims = self._host.plan(self._requests.values(), need_pages, need_draft, need_slot, exclude=record)
        self._replay.flush()
        for victim in victims:
            self._host.offload(victim)
        # NOTE: nothing below may fail: the plan guaranteed every allocation.
        pages = pools.pages.allocate(need_pages)
        draft_pages = pools.draft.allocate(need_draft) if pools.draft is not None else []
        slot = pools.slots.allocate(need_slot)[0] if pools.slots is not None and need_slot else record.slot
        first = not record.resumed
        restored = record.host is not None
        draft_zeroed = (0, 0)
        record.pages.extend(pages)
        record.draft_pages.extend(draft_pages)
        record.slot = slot
        record.capacity = target
        if restored:
            self._restore(record)
        elif first:
            self._prefix.initialise_slot(record)
            draft_zeroed = self._draft_mirror.initialise(record)
        record.resumed = True
        record.transition(CacheState.ACTIVE)
        record.row = self._rows.take(slot)
        return Resumed(record.reused_tokens, len(record.tokens), first, restored, draft_zeroed)

    def extend(self, request_id: RequestId, prompt_token_ids: Sequence[int] | np.ndarray) -> None:
        """Give a SUSPENDED request a longer prompt that starts with every token it committed (a conversation's
        next turn: the earlier turns and the new prompt). Its cache is kept as it is (on the device or the
        host); the next :meth:`resume` continues from its committed tokens, and commits are checked against the
        new prompt.

        :raises ~kvferry.errors.ConfigError: the new prompt does not start with the committed tokens or adds
            nothing to them; nothing changed.
        :raises ~kvferry.errors.InvalidTransition: the request is not SUSPENDED.
        """
        record = self._get(request_id)
        require_state(request_id, record.state, "extend")
        prompt = list(token_list(prompt_token_ids))
        committed = len(record.tokens)
        if len(prompt) <= committed or prompt[:committed] != record.tokens:
            raise ConfigError(
                f"extend of {request_id!r}: the new prompt ({len(prompt)} tokens) must start with the "
                f"{committed} committed tokens and add at least one"
            )
        record.prompt = prompt

    def host_nbytes(self, request_id: RequestId) -> int:
        """Bytes of host memory the request's cache takes (0 while on the device)."""
        host = self._get(request_id).host
        if host is None:
            return 0
        parts = (host.pages, host.draft_pages, host.slots)
        return sum(part.nbytes for part in parts if part is not None)

    def grow(self, request_id: RequestId, capacity: int) -> None:
        """Make room for ``capacity`` tokens (committed + this step's input, draft tokens included).

        A no-op when the request already has that capacity. Suspended requests may move to the host.

        :raises ~kvferry.errors.PoolExhausted: if the pages do not suffice; nothing changed.
        :raises ~kvferry.errors.InvalidTransition: if the request is not ACTIVE.
        """
        self.grow_many(((request_id, capacity),))

    def grow_many(self, grows: Iterable[tuple[RequestId, int]], *, offload: bool = True) -> None:
        """:meth:`grow` for several ``(request id, capacity)`` pairs, in order, all or nothing.

        The result is exactly that of calling :meth:`grow` for each pair in turn (the same pages, the same
        suspended requests moved to the host), except that a refusal changes nothing at all: every pair is
        checked and the pages of all of them are counted before anything is taken.

        :param offload: False: refuse (PoolExhausted, nothing changed) rather than move suspended requests to
            the host, so that the grow copies no bytes (an engine grows its next step's decodes this way while
            a model step runs).
        :raises ~kvferry.errors.PoolExhausted: if the pages of all of them do not suffice; nothing changed.
        :raises ~kvferry.errors.InvalidTransition: if one of them is not ACTIVE; nothing changed.
        :raises ~kvferry.errors.UnknownRequest: if one of them does not exist; nothing changed.
        """
        pools = self._pools
        plan = plan_grows(self._requests, grows, pools)
        if plan.pages or plan.draft_pages:
            victims = self._host.plan(self._requests.values(), plan.pages, plan.draft_pages, 0)
            if victims and not offload:
                raise PoolExhausted(
                    f"grow of {len(plan.grows)} requests needs {len(victims)} suspended requests moved to the host"
                )
            if victims:
                self._replay.flush()
            for victim in victims:
                self._host.offload(victim)
        # NOTE: nothing below may fail: the plan guaranteed every allocation. One allocation per pool, handed out
        # in order: the same pages as one allocation per request (both take the free queue's head in turn).
        new_pages = pools.pages.allocate(plan.pages) if plan.pages else []
        new_draft = (
            pools.draft.allocate(plan.draft_pages) if plan.draft_pages and pools.draft is not None else []
        )
        plan.hand_out(new_pages, new_draft)

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

    def commit_many(self, commits: Iterable[Commit]) -> None:
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
        staged = check_commits(self._requests, commits)
        record_commits(staged, self._pools, self._prefix, self._draft_mirror)

    def commit_draft(self, request_id: RequestId, start: int, end: int) -> None:
        """Record that the drafter wrote *final* draft KV for the committed positions ``[start, end)``.

        Final: computed from the target's hidden states of those committed tokens and the token after each
        (for the last one the token the target chose next, committed by the following step). The drafter's
        speculative positions are never final. Draft blocks whose KV is final from position 0 on and whose
        following token is committed enter the draft prefix index. The gap the first resume zero-filled counts
        as final once a range from its end on is recorded: the blocks after it enter the index, keyed by the
        chained hash of their target tokens, and the gap's blocks with them, as the zeros they hold. A range
        that starts past the final prefix and the gap extends nothing. Without a drafter group this does nothing.

        The request may be SUSPENDED (e.g. a hand-off catches its drafter up after the prefill) as long as its
        pages are on the device.

        :raises ~kvferry.errors.InvalidTransition: if the request's draft pages are not on the device (never
            resumed, or on the host) or the range is not within its committed tokens; nothing changed.
        :raises ~kvferry.errors.UnknownRequest: if the request does not exist.
        """
        record = self._get(request_id)
        _still(record, "commit_draft")
        self._draft_mirror.commit(record, start, end)

    def suspend(self, request_id: RequestId, *, offload: Offload = Offload.ON_PRESSURE) -> None:
        """ACTIVE -> SUSPENDED: give up the batch row; keep (or with ``Offload.NOW`` move to host) the memory.

        :param offload: ``NEVER`` while a transfer may read or write the request's pages or slot.
        :raises ~kvferry.errors.InvalidTransition: if the request is not ACTIVE.
        """
        record = self._get(request_id)
        require_state(request_id, record.state, "suspend")
        self._replay.flush()
        self._release_row(record)
        record.transition(CacheState.SUSPENDED)
        record.offload = offload
        record.suspend_seq = next(self._suspend_seq)
        if offload is Offload.NOW:
            self._host.offload(record)

    def offload(self, request_id: RequestId) -> None:
        """Move a SUSPENDED request's pages, slot and replay state to the host now (a no-op if already there).

        A request that was never resumed holds only shared prefix pages and is left alone.

        :raises ~kvferry.errors.InvalidTransition: if the request is ACTIVE (:class:`~kvferry.errors.CacheMoving`
            while it is moving).
        """
        record = self._get(request_id)
        require_state(request_id, record.state, "offload")
        _still(record, "offload")
        self._replay.flush()
        self._host.offload(record)

    def pin(self, request_id: RequestId) -> bool:
        """Keep a SUSPENDED request's memory on the device (``Offload.NEVER``) until its next resume or close,
        bringing it back from the host first if it was moved there (into new pages and a new slot: read the block
        tables again). Takes no batch row: a transfer reads a suspended request's pages. Returns whether it was
        brought back. Suspended requests may be moved to the host to make room.

        :raises ~kvferry.errors.PoolExhausted: the pages or the slot do not suffice even after moving every
            movable suspended request; nothing changed.
        :raises ~kvferry.errors.InvalidTransition: if the request is not SUSPENDED (:class:`~kvferry.errors.
            CacheMoving` while it is moving).
        """
        record = self._get(request_id)
        require_state(request_id, record.state, "pin")
        _still(record, "pin")
        if record.host is None:
            record.offload = Offload.NEVER
            return False
        pools = self._pools
        need_pages, need_draft, need_slot = self._restore_need(record)
        victims = self._host.plan(self._requests.values(), need_pages, need_draft, need_slot, exclude=record)
        self._replay.flush()
        for victim in victims:
            self._host.offload(victim)
        # NOTE: nothing below may fail: the plan guaranteed every allocation.
        record.pages.extend(pools.pages.allocate(need_pages))
        if pools.draft is not None:
            record.draft_pages.extend(pools.draft.allocate(need_draft))
        if pools.slots is not None and need_slot:
            record.slot = pools.slots.allocate(need_slot)[0]
        self._restore(record)
        record.offload = Offload.NEVER
        return True

    # --- two-phase moves to the host and back ------------------------------------------------------------

    def start_offload(self, request_id: RequestId) -> PendingMove:
        """Begin moving a SUSPENDED request's pages, slot and replay state to the host; the bytes move in the
        returned move's :meth:`~kvferry.pools.moves.PendingMove.run` (a worker thread's job), and
        :meth:`finish` commits: only then are the device pages and slot freed.

        Reserves the host buffer (pinned with an arena on CUDA; a block kept from an earlier offload when one
        fits, else it is allocated by ``run``) and marks the request moving. A request on the host already or
        never resumed gets a move with nothing to do (``finish`` returns False; it is not marked moving).

        :raises ~kvferry.errors.InvalidTransition: if the request is not SUSPENDED
            (:class:`~kvferry.errors.CacheMoving` while it is moving already); nothing changed.
        :raises ~kvferry.errors.UnknownRequest: if it does not exist.
        """
        record = self._get(request_id)
        require_state(request_id, record.state, "offload")
        _still(record, "offload")
        self._replay.flush()
        return self._host.begin_offload(record)

    def start_restore(self, request_id: RequestId, *, pin: bool = False) -> PendingMove:
        """Begin bringing an offloaded SUSPENDED request back to the device; the bytes move in the returned
        move's ``run``, and :meth:`finish` commits: only then does the request hold its new pages and slot
        (read the block tables again) and is its host copy dropped. It stays SUSPENDED (resume it next).

        Allocates the pages and the slot for its capacity from what is free now, all or nothing: nothing is
        moved to the host to make room (that would copy here; :meth:`restore_victims` names what to offload
        first). A request on the device gets a move with nothing to do (with ``pin`` it is pinned).

        :param pin: keep it on the device from then on (``Offload.NEVER``, as :meth:`pin`) until its next
            resume or close, so that no pressure moves it out again before it runs or is read.
        :raises ~kvferry.errors.PoolExhausted: if the free pages or slots do not suffice; nothing changed.
        :raises ~kvferry.errors.InvalidTransition: if the request is not SUSPENDED
            (:class:`~kvferry.errors.CacheMoving` while it is moving); nothing changed.
        :raises ~kvferry.errors.UnknownRequest: if it does not exist.
        """
        record = self._get(request_id)
        require_state(request_id, record.state, "restore")
        _still(record, "restore")
        if record.host is None:
            if pin:
                record.offload = Offload.NEVER
            return PendingMove(MoveKind.RESTORE, record, owner=self._host, nbytes=0, copy=None, device=None)
        need_pages, need_draft, need_slot = self._restore_need(record)
        pools = self._pools
        free_slots = pools.slots.num_available if pools.slots is not None else 0
        if (
            need_pages > pools.pages.num_free_pages
            or (pools.draft is not None and need_draft > pools.draft.num_free_pages)
            or need_slot > free_slots
        ):
            raise PoolExhausted(
                f"restore of {request_id!r}: needs {need_pages} pages ({pools.pages.num_free_pages} free), "
                f"{need_draft} draft pages, {need_slot} slot ({free_slots} available); offload the suspended "
                "requests restore_victims() names first"
            )
        self._replay.flush()
        pages = pools.pages.allocate(need_pages)
        draft_pages = pools.draft.allocate(need_draft) if pools.draft is not None else []
        slot = pools.slots.allocate(need_slot)[0] if pools.slots is not None and need_slot else None
        return self._host.begin_restore(record, pages, draft_pages, slot, pin=pin)

    def restore_victims(self, request_id: RequestId) -> list[RequestId]:
        """The suspended requests to offload (least recently suspended first) so that :meth:`start_restore` of
        ``request_id`` fits; empty when it fits already or the request is not on the host. Changes nothing.

        :raises ~kvferry.errors.PoolExhausted: if it cannot fit even with every movable request offloaded.
        :raises ~kvferry.errors.UnknownRequest: if it does not exist.
        """
        record = self._get(request_id)
        if record.host is None or record.moving is not None:
            return []
        victims = self._host.plan(self._requests.values(), *self._restore_need(record), exclude=record)
        return [v.request_id for v in victims]

    def finish(self, pending: PendingMove, *, commit: bool = True) -> bool:
        """End a two-phase move: commit it when its copy copied every byte and ``commit``, else roll it back.
        Returns whether it committed. Call it exactly once per started move, whatever happened (a later call
        returns False and changes nothing).

        It waits for the copy to end first (runs it here, blocking, when nobody ran it: the synchronous
        path), so call it after :attr:`~kvferry.pools.moves.PendingMove.done` when the caller must not block.
        Commit: an offload frees the device pages and slot and keeps the host copy; a restore gives the
        request its new pages and slot, offers its blocks for reuse again and drops the host copy. Roll back
        (``commit=False``, an aborted or failed copy): the request is where it was before the start (an
        offload's host buffer and a restore's new pages and slot go back). A request closed meanwhile has
        everything the move held freed now (its pages left to its quarantine, if the close took one).

        :raises ~kvferry.errors.UnknownRequest: if the move is another manager's; nothing changed.
        :raises Exception: the copy's own error (e.g. host memory exhausted) when it failed and ``commit``;
            the move is rolled back first.
        """
        self._replay.flush()
        committed = self._host.complete(pending, commit=commit)
        if committed and pending.kind is MoveKind.RESTORE:
            self._prefix.reoffer(pending.record)
            self._draft_mirror.reoffer(pending.record)
        return committed

    def trim_host_memory(self) -> int:
        """Free the host buffers kept for reuse by later offloads (offloaded requests keep theirs); returns
        the bytes freed."""
        return self._host.memory.trim()

    def close_host_memory(self) -> None:
        """Free the host buffers kept for reuse, and from now on every buffer given back (at the end of the
        manager's life; offloaded requests keep theirs until restored or closed). Offloads still work."""
        self._host.memory.close()

    def close(self, request_id: RequestId, *, quarantine: bool = False) -> Quarantine | None:
        """Any state -> CLOSED: every page, slot, pin, batch row and host copy of the request is released.

        Idempotent: closing an unknown or closed request does nothing and returns None.

        A request that is moving is forgotten at once, but the memory its move holds (device pages and slot,
        host buffer) goes back only when the move is finished (:meth:`finish`, which the caller of the start
        still calls): no page is handed out while the copy may read or write it.

        :param quarantine: keep the request's pages, draft pages and slot out of the pools until
            :meth:`release` (a transfer may still write or read them); the returned handle says which.
        """
        record = self._requests.pop(request_id, None)
        if record is None:
            return None
        self._replay.flush()
        self._release_row(record)
        self._prefix.unpin(record)
        self._draft_mirror.drop_source(record)
        ticket = None
        ours = self._host.close(record)
        if quarantine:
            ticket = self._quarantines.hold(record)
            if record.moving is not None and record.moving.kind is MoveKind.OFFLOAD:
                record.moving.quarantine = ticket  # the same pages: freed once released and copied
        elif ours:
            self._pools.free(record.pages, record.draft_pages, record.slot)
        record.pages, record.draft_pages, record.slot, record.host = [], [], None, None
        record.transition(CacheState.CLOSED)
        return ticket

    def release(self, quarantine: Quarantine) -> None:
        """Return a quarantine's pages and slot to the pools. Idempotent.

        :raises ~kvferry.errors.UnknownRequest: if the quarantine is not this manager's.
        """
        if self._quarantines.take_back(quarantine):
            quarantine.released = True
            for move in self._host.moves():
                if move.quarantine is quarantine:  # its copy still reads the pages: its finish frees them
                    move.quarantine_released = True
                    return
            self._replay.flush()
            self._pools.free(quarantine.pages, quarantine.draft_pages, quarantine.slot)

    # --- replay state ------------------------------------------------------------------------------------------

    def set_num_accepted(self, request_id: RequestId, num_accepted: int, *, defer: bool = False) -> None:
        """Record a verify step's acceptance: in the live slot, or in the host copy of a suspended request.

        :param defer: queue the write to a live slot instead of writing it now (one tensor write per slot is
            costly per request and step): every queued write lands at once in :meth:`flush_num_accepted`,
            which runs before anything of this manager that moves, copies, frees or resets a slot; call it
            before a model step reads ``num_accepted``.
        """
        record = self._get(request_id)
        _still(record, "set_num_accepted")
        self._replay.set_num_accepted(record, num_accepted, defer=defer)

    def flush_num_accepted(self) -> None:
        """Write every ``set_num_accepted(..., defer=True)`` still queued into the arena (one tensor write)."""
        self._replay.flush()

    def drop_replay(self, request_id: RequestId) -> None:
        """Forget the request's replay state (it continues as a fresh context): ``num_accepted = 0``."""
        record = self._get(request_id)
        _still(record, "drop_replay")
        self._replay.drop(record)

    # --- attention-DP dummies --------------------------------------------------------------------------------

    def add_dummy(self) -> int:
        """Take a batch row for an attention-DP dummy request; its slot is DUMMY_SLOT, its page NULL_PAGE.

        Real requests keep their rows. :raises ~kvferry.errors.PoolExhausted: if every row is taken.
        """
        return self._rows.add_dummy()

    def remove_dummy(self, row: int) -> None:
        """Give a dummy's batch row back. Idempotent."""
        self._rows.remove_dummy(row)

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

        :raises ~kvferry.errors.RebalanceRefused: if any condition fails (a move in flight too); nothing changed.
        """
        if self._host.num_moving:
            raise RebalanceRefused(f"{self._host.num_moving} moves to or from the host are not finished")
        plan = plan_rebalance(
            self._pools,
            self._requests.values(),
            num_quarantines=len(self._quarantines),
            num_dummies=self._rows.num_dummies,
            num_pages=num_pages,
            num_slots=num_slots,
            num_draft_pages=num_draft_pages,
            arena=arena,
        )
        self._replay.flush()
        for record in self._requests.values():
            if not record.resumed:
                self._prefix.forget(record)
                self._draft_mirror.forget(record)
            else:
                self._host.offload(record)
        self._pools.replace(plan.config, plan.arena)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (attention and draft) and unpinned snapshot (e.g. after new weights).
        Owned pages stay owned."""
        self._pools.clear_cache()

    # --- what the model needs ------------------------------------------------------------------------------------

    def block_table(self, request_id: RequestId) -> Sequence[int]:
        """Attention page ids of the request, block by block (the manager's list: do not mutate)."""
        return self._get(request_id).pages

    def block_tables(self, request_ids: Sequence[RequestId]) -> list[Sequence[int]]:
        """:meth:`block_table` of each request, in one call (the manager's lists: do not mutate). A request's
        list is the same object while its pages only grow; moving its cache replaces it.

        :raises ~kvferry.errors.UnknownRequest: a request it does not hold."""
        records = self._requests
        try:
            return [records[r].pages for r in request_ids]
        except KeyError:
            pass
        return [find_record(records, r).pages for r in request_ids]  # raises for the one it does not hold

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
        """True while the request's bytes are on the host (a restore in flight included)."""
        return self._get(request_id).host is not None

    def is_moving(self, request_id: RequestId) -> bool:
        """True between the start of a two-phase offload or restore of the request and its finish."""
        return self._get(request_id).moving is not None

    def next_snapshot_boundary(self, request_id: RequestId) -> int | None:
        """The next token position past the live slot's where a snapshot is wanted (end prefill chunks there)."""
        return self._prefix.next_snapshot_boundary(self._get(request_id))

    def request_ids(self) -> list[RequestId]:
        return list(self._requests)

    # --- state -----------------------------------------------------------------------------------------------------

    def statistics(self) -> CacheManagerStatistics:
        return collect_statistics(
            self._pools,
            self._requests.values(),
            self._quarantines,
            self._rows.num_dummies,
            self._counters,
            moving=self._host.num_moving,
            host_bytes=self._host.host_bytes,
        )

    def __repr__(self) -> str:
        config = self.config
        line = describe_statistics(self.statistics(), has_state=config.has_state, has_draft=config.has_draft)
        return f"<CacheManager [{line}]>"

    def debug_state(self) -> tuple[Any, ...]:
        """Every piece of bookkeeping as comparable tuples: equal before and after an operation that failed."""
        return (
            self.statistics(),
            self._pools.debug_state(),
            tuple(r.debug_state() for r in self._requests.values()),
            self._rows.debug_state(),
            self._quarantines.debug_state(),
            self._host.num_moving,
            self._replay.debug_state(),
        )

    # --- internals -------------------------------------------------------------------------------------------------

    def _get(self, request_id: RequestId) -> RequestRecord:
        return find_record(self._requests, request_id)

    def _restore_need(self, record: RequestRecord) -> tuple[int, int, int]:
        """Pages, draft pages and slots a request on the host needs back for its capacity."""
        pools = self._pools
        need_pages = pools.blocks(record.capacity) - len(record.pages)
        need_draft = pools.draft_blocks(record.capacity) - len(record.draft_pages)
        need_slot = 1 if pools.slots is not None and record.slot is None else 0
        return need_pages, need_draft, need_slot

    def _restore(self, record: RequestRecord) -> None:
        self._host.restore(record)
        self._prefix.reoffer(record)
        self._draft_mirror.reoffer(record)

    def _release_row(self, record: RequestRecord) -> None:
        if record.row is not None:
            self._rows.give_back(record.row)
            record.row = None


def _still(record: RequestRecord, operation: str) -> None:
    """Raise :class:`~kvferry.errors.CacheMoving` while the request is moving."""
    if record.moving is not None:
        raise CacheMoving(
            f"{operation} of {record.request_id!r}: its {record.moving.kind.value} to the host or back is in "
            "flight; finish it first"
        )
