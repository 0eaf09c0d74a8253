"""The pools of one rank as one object: attention pages, draft pages, state slots, the arena behind them and the
config that sizes them.

Every part of the cache manager reads the pools through one :class:`RankPools`, never a pool of its own: a
rebalance replaces the pools, the arena and the config together (:meth:`RankPools.replace`), and every part sees
the new ones at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from attrs import define

from kvferry.pools.arena import CacheArena
from kvferry.pools.blocks import PagePool
from kvferry.pools.config import ATTENTION, DRAFT, CacheManagerConfig, check_arena_fits
from kvferry.pools.slots import SlotPool

__all__ = ["RankPools"]


@define(eq=False)
class RankPools:
    """The pools a config sizes, over ``arena`` (None: bookkeeping only, no bytes are copied or zeroed)."""

    config: CacheManagerConfig
    arena: CacheArena | None
    pages: PagePool
    #: None without a drafter group
    draft: PagePool | None
    #: None without recurrent layers
    slots: SlotPool | None

    @classmethod
    def build(cls, config: CacheManagerConfig, arena: CacheArena | None) -> RankPools:
        """Empty pools of the config's sizes.

        :raises ~kvferry.errors.ConfigError: if ``arena`` does not hold exactly the config's pages and slots.
        """
        if arena is not None:
            check_arena_fits(config, arena.layout)
        pages, draft, slots = _new_pools(config)
        return cls(config, arena, pages, draft, slots)

    def replace(self, config: CacheManagerConfig, arena: CacheArena | None) -> None:
        """Empty pools of the new sizes over ``arena`` (checked by the caller); every page, slot, cached block
        and snapshot of the old ones is forgotten. The count of evicted snapshots carries over."""
        evicted = self.slots.snapshots_evicted if self.slots is not None else 0
        self.config, self.arena = config, arena
        self.pages, self.draft, self.slots = _new_pools(config)
        if self.slots is not None:
            self.slots.snapshots_evicted = evicted

    def blocks(self, tokens: int) -> int:
        """Attention pages that ``tokens`` tokens need."""
        return math.ceil(tokens / self.config.tokens_per_block)

    def draft_blocks(self, tokens: int) -> int:
        """Draft pages that ``tokens`` tokens need (0 without a drafter group)."""
        return math.ceil(tokens / self.config.draft_tokens_per_block) if self.draft is not None else 0

    def free(self, pages: Sequence[int], draft_pages: Sequence[int], slot: int | None) -> None:
        """Drop one reference on each page and draft page, and free the slot."""
        self.pages.free(pages)
        if self.draft is not None:
            self.draft.free(draft_pages)
        if slot is not None:
            assert self.slots is not None
            self.slots.free([slot])

    def clear_cache(self) -> None:
        """Forget every cached block (attention and draft) and unpinned snapshot; owned pages stay owned."""
        self.pages.clear_cache()
        if self.draft is not None:
            self.draft.clear_cache()
        if self.slots is not None:
            self.slots.clear_snapshots()

    def debug_state(self) -> tuple[Any, ...]:
        return (
            self.pages.debug_state(),
            None if self.draft is None else self.draft.debug_state(),
            None if self.slots is None else self.slots.debug_state(),
        )

    def __repr__(self) -> str:
        return f"<RankPools pages={self.pages!r} draft={self.draft!r} slots={self.slots!r}>"


def _new_pools(config: CacheManagerConfig) -> tuple[PagePool, PagePool | None, SlotPool | None]:
    pages = PagePool(config.num_pages, name=ATTENTION)
    draft = PagePool(config.num_draft_pages, name=DRAFT) if config.has_draft else None
    slots = SlotPool(config.num_slots, name="state") if config.has_state else None
    return pages, draft, slots
