"""Rebalance: new pool sizes for one rank, checked before anything changes.

A rebalance throws the pools away and builds new ones, so it runs only when nothing can hold or touch a page
or slot of the old ones:

- every cache is SUSPENDED (no model step runs on them);
- no suspended request is marked :attr:`~kvferry.pools.lifecycle.Offload.NEVER` (a transfer may touch it);
- no quarantine is held and no dummy row is in the batch;
- the groups stay the same (a rebalance never adds or removes the state or the draft pool);
- every request fits the new pools on its own (else it could never be resumed);
- with an arena, the new one has exactly the new counts, and its replay buffers cover every state slot with at
  least the old replay length.

Then every resumed request moves to the host (it is restored on its next resume), a request never resumed
forgets its prefix match, and the prefix cache and snapshots are dropped with the old pools.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
from attrs import frozen

from kvferry.errors import ConfigError, RebalanceRefused
from kvferry.pools.arena import CacheArena
from kvferry.pools.config import CacheManagerConfig, check_arena_fits
from kvferry.pools.layout import CacheLayout
from kvferry.pools.lifecycle import CacheState, Offload
from kvferry.pools.rank_pools import RankPools
from kvferry.pools.record import RequestRecord

__all__ = ["RebalancePlan", "plan_rebalance"]


@frozen
class RebalancePlan:
    """The config and arena a rebalance moves to (arena None: a manager without one)."""

    config: CacheManagerConfig
    arena: CacheArena | None


def plan_rebalance(
    pools: RankPools,
    records: Iterable[RequestRecord],
    *,
    num_quarantines: int,
    num_dummies: int,
    num_pages: int | None,
    num_slots: int | None,
    num_draft_pages: int | None,
    arena: CacheArena | None,
) -> RebalancePlan:
    """Check that the pools may be rebuilt with the new counts (None: unchanged) and build the new arena when
    the manager has one and ``arena`` is None (same device). Changes nothing of the current pools.

    :raises ~kvferry.errors.RebalanceRefused: if any condition fails.
    """
    current = pools.config
    try:
        config = attrs.evolve(
            current,
            num_pages=current.num_pages if num_pages is None else num_pages,
            num_slots=current.num_slots if num_slots is None else num_slots,
            num_draft_pages=current.num_draft_pages if num_draft_pages is None else num_draft_pages,
        )
    except ConfigError as exc:
        raise RebalanceRefused(str(exc)) from exc
    records = list(records)
    busy = [r.request_id for r in records if r.state is CacheState.ACTIVE]
    if busy:
        raise RebalanceRefused(f"requests are active: {busy[:4]!r}")
    pinned = [r.request_id for r in records if r.offload is Offload.NEVER and r.resumed]
    if pinned:
        raise RebalanceRefused(f"suspended requests may be in transfer (Offload.NEVER): {pinned[:4]!r}")
    if num_quarantines:
        raise RebalanceRefused(f"{num_quarantines} quarantines: transfers may still touch the pools")
    if num_dummies:
        raise RebalanceRefused(f"{num_dummies} dummy rows are in the batch")
    if config.has_state != current.has_state or config.has_draft != current.has_draft:
        raise RebalanceRefused("a rebalance cannot add or remove a pool group")
    # every request must fit the new pools on its own, or it could never be resumed again
    largest = max((pools.blocks(r.capacity) for r in records), default=0)
    if largest > config.num_pages - 1:
        raise RebalanceRefused(
            f"a request holds {largest} pages; {config.num_pages} pages (page 0 reserved) cannot take it back"
        )
    old_arena = pools.arena
    if old_arena is None:
        if arena is not None:
            raise RebalanceRefused("this manager has no arena to replace")
        return RebalancePlan(config, None)
    new_arena = arena if arena is not None else _build_arena(old_arena, config)
    try:
        check_arena_fits(config, new_arena.layout)
    except ConfigError as exc:
        raise RebalanceRefused(str(exc)) from exc
    old, new = old_arena.layout.replay, new_arena.layout.replay
    if config.has_state and (new.num_slots < config.num_slots or new.max_tokens < old.max_tokens):
        raise RebalanceRefused(
            f"replay buffers hold {new.num_slots} slots x {new.max_tokens} tokens; the state pool needs "
            f"{config.num_slots} x {old.max_tokens}: they must grow with it"
        )
    return RebalancePlan(config, new_arena)


def _build_arena(old: CacheArena, config: CacheManagerConfig) -> CacheArena:
    """An arena like ``old`` (model, replay length, device) with the config's counts."""
    layout = old.layout
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
    return CacheArena(new_layout, old.device)
