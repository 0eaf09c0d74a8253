"""Offload of suspended requests to the host, and their restore.

Offload saves every page, draft page, the live slot and its replay buffers of a SUSPENDED request to the host
and frees them on the device; restore copies them into whatever pages and slot the next resume hands out.
Under pressure the manager offloads suspended requests, least recently suspended first, but never one marked
:attr:`~kvferry.pools.lifecycle.Offload.NEVER` (a transfer may read or write it) and never one that was not
resumed yet (it holds only shared prefix pages). :meth:`HostOffload.plan` picks them before anything moves, so
an allocation that cannot be met even then changes nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from kvferry.errors import PoolExhausted
from kvferry.pools.config import ATTENTION, DRAFT
from kvferry.pools.lifecycle import CacheState, Offload
from kvferry.pools.rank_pools import RankPools
from kvferry.pools.record import HostCopy, RequestRecord
from kvferry.pools.statistics import Counters

__all__ = ["HostOffload"]


class HostOffload:
    """Moves requests' memory of one rank's pools to the host and back."""

    def __init__(self, pools: RankPools, counters: Counters) -> None:
        self._pools = pools
        self._counters = counters

    def plan(
        self,
        records: Iterable[RequestRecord],
        pages: int,
        draft_pages: int,
        slots: int,
        *,
        exclude: RequestRecord | None = None,
    ) -> list[RequestRecord]:
        """The suspended records to offload so that ``pages``, ``draft_pages`` and ``slots`` fit (none when they
        fit already). Changes nothing.

        :raises ~kvferry.errors.PoolExhausted: if they do not fit even with every movable record offloaded.
        """
        if pages <= 0 and draft_pages <= 0 and slots <= 0:
            return []
        pools = self._pools
        free_pages = pools.pages.num_free_pages
        free_draft = pools.draft.num_free_pages if pools.draft is not None else 0
        free_slots = pools.slots.num_available if pools.slots is not None and slots > 0 else 0

        def fits(freed_pages: int, freed_draft: int, freed_slots: int) -> bool:
            return (
                pages <= free_pages + freed_pages
                and draft_pages <= free_draft + freed_draft
                and slots <= free_slots + freed_slots
            )

        if fits(0, 0, 0):
            return []
        victims: list[RequestRecord] = []
        if pools.config.offload_under_pressure:
            candidates = sorted(
                (
                    r
                    for r in records
                    if r is not exclude
                    and r.state is CacheState.SUSPENDED
                    and r.offload is not Offload.NEVER
                    and r.resumed
                    and r.host is None
                ),
                key=lambda r: r.suspend_seq,
            )
            # a page is freed only when every reference on it belongs to a victim
            held: Counter[int] = Counter()
            held_draft: Counter[int] = Counter()
            freed_slots = 0
            draft = pools.draft
            for victim in candidates:
                victims.append(victim)
                held.update(victim.pages)
                held_draft.update(victim.draft_pages)
                freed_slots += victim.slot is not None
                freed_pages = sum(1 for p, n in held.items() if n == pools.pages.ref_cnt(p))
                freed_draft = (
                    sum(1 for p, n in held_draft.items() if n == draft.ref_cnt(p)) if draft is not None else 0
                )
                if fits(freed_pages, freed_draft, freed_slots):
                    return victims
        raise PoolExhausted(
            f"need {pages} pages ({free_pages} free), {draft_pages} draft pages ({free_draft} free), "
            f"{slots} slots ({free_slots} available); {len(victims)} suspended requests could move to the host"
        )

    def offload(self, record: RequestRecord) -> None:
        """Save the record's pages, draft pages, slot and replay state to the host and free them on the device.
        A no-op for a record on the host already or never resumed. Deferred replay writes must be flushed."""
        if record.host is not None or not record.resumed:
            return
        pools = self._pools
        host = HostCopy(None, None, None, len(record.pages), len(record.draft_pages))
        arena = pools.arena
        if arena is not None:
            if record.pages:
                host.pages = arena.save_pages(ATTENTION, record.pages)
            if record.draft_pages:
                host.draft_pages = arena.save_pages(DRAFT, record.draft_pages)
            if record.slot is not None:
                host.slots = arena.save_slots([record.slot], replay=True)
        pools.free(record.pages, record.draft_pages, record.slot)
        record.pages, record.draft_pages, record.slot = [], [], None
        record.host = host
        self._counters.offloads += 1

    def restore(self, record: RequestRecord) -> None:
        """Copy the host copy into the pages and slot the record holds now, and drop it. The blocks are not
        offered for reuse here (the prefix index and the draft mirror re-offer them)."""
        host = record.host
        assert host is not None
        arena = self._pools.arena
        if arena is not None:
            if host.pages is not None:
                arena.restore_pages(ATTENTION, record.pages[: host.num_pages], host.pages)
            if host.draft_pages is not None:
                arena.restore_pages(DRAFT, record.draft_pages[: host.num_draft_pages], host.draft_pages)
            if host.slots is not None and record.slot is not None:
                arena.restore_slots([record.slot], host.slots)
        record.host = None
        self._counters.restores += 1

    def __repr__(self) -> str:
        c = self._counters
        return f"<HostOffload {c.offloads} offloads, {c.restores} restores>"
