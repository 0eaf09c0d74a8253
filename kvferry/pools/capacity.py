"""Capacity: the pages a request needs for the tokens it may hold, and :meth:`CacheManager.grow_many
<kvferry.pools.manager.CacheManager.grow_many>`'s all-or-nothing plan.

A request's capacity is the tokens its pages can hold (committed tokens plus this step's input, draft tokens
included); it only grows while the request lives. A grow of several requests is counted whole before any page
is taken, so a refusal changes nothing; the pages are then taken in one allocation per pool and handed out in
order, the same pages one allocation per request would give.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs
from attrs import define

from kvferry.pools.lifecycle import CacheState, require_state
from kvferry.pools.rank_pools import RankPools
from kvferry.pools.record import RequestId, RequestRecord, find_record

__all__ = ["GrowPlan", "plan_grows", "resume_capacity"]


def resume_capacity(record: RequestRecord, capacity: int | None) -> int:
    """The capacity a resume gives: at least the current one, the whole prompt on the first resume, and
    ``capacity`` when asked."""
    return max(record.capacity, len(record.prompt) if not record.resumed else 0, capacity or 0)


@define(eq=False)
class GrowPlan:
    """What a batch of grows takes: per record (in order) the new capacity and its new pages of each group."""

    #: (record, capacity, attention pages, draft pages)
    grows: list[tuple[RequestRecord, int, int, int]] = attrs.field(factory=list)
    pages: int = 0
    draft_pages: int = 0

    def hand_out(self, pages: list[int], draft_pages: list[int]) -> None:
        """Give each record its share of the pages of one allocation per pool, in order, and its capacity."""
        taken = taken_draft = 0
        for record, capacity, num_pages, num_draft in self.grows:
            if num_pages:
                record.pages.extend(pages[taken : taken + num_pages])
                taken += num_pages
            if num_draft:
                record.draft_pages.extend(draft_pages[taken_draft : taken_draft + num_draft])
                taken_draft += num_draft
            record.capacity = capacity


def plan_grows(
    records: Mapping[RequestId, RequestRecord], grows: Iterable[tuple[RequestId, int]], pools: RankPools
) -> GrowPlan:
    """Count the pages of every ``(request id, capacity)`` pair, each against the capacity the earlier pairs
    leave (a request may appear more than once). Changes nothing.

    :raises ~kvferry.errors.InvalidTransition: if one of them is not ACTIVE.
    :raises ~kvferry.errors.UnknownRequest: if one of them does not exist.
    """
    active = CacheState.ACTIVE
    tpb = pools.config.tokens_per_block
    draft_tpb = pools.config.draft_tokens_per_block if pools.draft is not None else 0
    plan = GrowPlan()
    # (capacity, pages, draft pages) of requests grown earlier in this batch
    ahead: dict[RequestId, tuple[int, int, int]] = {}
    for request_id, capacity in grows:
        record = records.get(request_id)
        if record is None or record.state is not active:
            require_state(request_id, find_record(records, request_id).state, "grow")
        assert record is not None
        state = ahead.get(request_id)
        current, num_pages, num_draft = (
            (record.capacity, len(record.pages), len(record.draft_pages)) if state is None else state
        )
        if capacity <= current:
            continue
        # most decode steps stay inside the last page: no pages
        pages = -(-capacity // tpb) - num_pages
        pages = pages if pages > 0 else 0
        draft = -(-capacity // draft_tpb) - num_draft if draft_tpb else 0
        draft = draft if draft > 0 else 0
        plan.grows.append((record, capacity, pages, draft))
        ahead[request_id] = (capacity, num_pages + pages, num_draft + draft)
        plan.pages += pages
        plan.draft_pages += draft
    return plan
