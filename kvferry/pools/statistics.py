"""What a cache manager counts: the pools' occupancy, requests by state, and what reuse, snapshots and offload
did since construction."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import NamedTuple

from attrs import define

from kvferry.pools.lifecycle import CacheState
from kvferry.pools.quarantine import Quarantines
from kvferry.pools.rank_pools import RankPools
from kvferry.pools.record import RequestRecord

__all__ = ["CacheManagerStatistics", "Counters", "collect_statistics", "describe_statistics"]


class CacheManagerStatistics(NamedTuple):
    """A snapshot of a :class:`~kvferry.pools.manager.CacheManager`'s counts. Reserved page / slot 0 excluded
    everywhere."""

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
    #: two-phase moves to the host or back started and not finished (of closed requests too)
    requests_moving: int = 0
    #: host memory held for offloaded requests and kept for reuse (pinned with an arena on CUDA)
    host_bytes: int = 0


@define(eq=False)
class Counters:
    """Events counted since construction, shared by the parts of one manager that cause them."""

    reuse_queries: int = 0
    reuse_hits: int = 0
    reuse_query_tokens: int = 0
    reuse_hit_tokens: int = 0
    draft_hit_tokens: int = 0
    draft_zeroed_tokens: int = 0
    #: two-phase moves to the host or back started and not finished (of closed requests too)
    requests_moving: int = 0
    #: host memory held for offloaded requests and kept for reuse (pinned with an arena on CUDA)
    host_bytes: int = 0
    snapshots_taken: int = 0
    offloads: int = 0
    restores: int = 0


def collect_statistics(
    pools: RankPools,
    records: Iterable[RequestRecord],
    quarantines: Quarantines,
    num_dummies: int,
    counters: Counters,
    *,
    moving: int = 0,
    host_bytes: int = 0,
) -> CacheManagerStatistics:
    """The counts of one manager now."""
    pages = pools.pages.statistics()
    slots = pools.slots.statistics() if pools.slots is not None else None
    draft = pools.draft.statistics() if pools.draft is not None else None
    states: Counter[CacheState] = Counter()
    offloaded = 0
    for record in records:
        states[record.state] += 1
        offloaded += record.host is not None
    c = counters
    bytes_per_token = 0.0
    bytes_per_slot = 0
    if pools.arena is not None:
        layout = pools.arena.layout
        bytes_per_token = sum(layout.bytes_per_token(g.name) for g in layout.paged_groups)
        bytes_per_slot = layout.bytes_per_slot
    return CacheManagerStatistics(
        pages_total=pages.num_pages,
        pages_used=pages.used,
        pages_free=pages.free,
        pages_cached=pages.cached,
        pages_quarantined=quarantines.num_pages,
        slots_total=slots.num_slots if slots else 0,
        slots_live=slots.live if slots else 0,
        slots_snapshot=slots.snapshot if slots else 0,
        slots_free=slots.free if slots else 0,
        slots_quarantined=quarantines.num_slots,
        draft_pages_total=draft.num_pages if draft else 0,
        draft_pages_used=draft.used if draft else 0,
        draft_pages_free=draft.free if draft else 0,
        requests_active=states[CacheState.ACTIVE],
        requests_suspended=states[CacheState.SUSPENDED],
        requests_offloaded=offloaded,
        dummies=num_dummies,
        quarantines=len(quarantines),
        reuse_queries=c.reuse_queries,
        reuse_hits=c.reuse_hits,
        reuse_query_tokens=c.reuse_query_tokens,
        reuse_hit_tokens=c.reuse_hit_tokens,
        snapshots_taken=c.snapshots_taken,
        snapshots_evicted=pools.slots.snapshots_evicted if pools.slots is not None else 0,
        offloads=c.offloads,
        restores=c.restores,
        bytes_per_token=bytes_per_token,
        bytes_per_slot=bytes_per_slot,
        draft_pages_cached=draft.cached if draft else 0,
        draft_hit_tokens=c.draft_hit_tokens,
        draft_zeroed_tokens=c.draft_zeroed_tokens,
        requests_moving=moving,
        host_bytes=host_bytes,
    )


def describe_statistics(s: CacheManagerStatistics, *, has_state: bool, has_draft: bool) -> str:
    """One line of the counts that matter most, ``|``-separated (what the manager's repr shows)."""
    parts = [f"pages: {s.pages_used} used, {s.pages_free} free, {s.pages_cached} cached"]
    if has_state:
        parts.append(f"slots: {s.slots_live} live, {s.slots_snapshot} snapshot, {s.slots_free} free")
    if has_draft:
        parts.append(f"draft pages: {s.draft_pages_used} used, {s.draft_pages_free} free")
    parts.append(f"reuse: {s.reuse_hits}/{s.reuse_queries} hits")
    parts.append(
        f"requests: {s.requests_active} active, {s.requests_suspended} suspended ({s.requests_offloaded} on host)"
    )
    if s.requests_moving:
        parts.append(f"{s.requests_moving} moving")
    if s.quarantines:
        parts.append(f"{s.quarantines} quarantined")
    parts.append(f"{s.bytes_per_token:g} B/token")
    return " | ".join(parts)
