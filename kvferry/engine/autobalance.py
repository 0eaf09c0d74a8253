"""Auto-balance: the split of a fixed memory budget between attention pages and state slots, picked from the lengths
of the requests the engine served, and applied with :meth:`Engine.rebalance
<kvferry.engine.engine.Engine.rebalance>`.

A hybrid model's cache has two kinds of memory: pages, which a request needs in proportion to its tokens, and
state slots, one per running request plus one per prefix snapshot kept for reuse. Long requests want pages;
short ones leave pages idle that could hold snapshots. :func:`target_split` sizes the pages for ``max_running``
requests of the observed mean length (prompt plus output, with headroom) and gives the rest of the budget to
slots; :class:`AutoBalancer` applies it when it differs from the current split by more than the hysteresis, and
no more often than ``min_interval`` seconds (a rebalance moves every cache to the host and back).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

import anyio
import attrs
from attrs import define, frozen

from kvferry.errors import ConfigError, RebalanceRefused

if TYPE_CHECKING:
    from kvferry.engine.engine import Engine
    from kvferry.pools.config import CacheManagerConfig
    from kvferry.pools.layout import CacheLayout

__all__ = ["AutoBalancer", "BalancePolicy", "Split", "target_split"]


def _fraction(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0 <= value < 1:
        raise ConfigError(f"{attribute.name} must be in [0, 1), got {value}")


def _positive(
    instance: object, attribute: attrs.Attribute[float] | attrs.Attribute[int], value: float
) -> None:
    if not value > 0:
        raise ConfigError(f"{attribute.name} must be > 0, got {value}")


@frozen
class BalancePolicy:
    """When and how :class:`AutoBalancer` rebalances."""

    #: bytes per rank for pages (attention and draft) and state slots together (None: what they take now)
    memory_bytes: int | None = None
    #: rebalance only when the pages would change by more than this fraction
    hysteresis: float = attrs.field(default=0.25, validator=_fraction)
    #: seconds between two rebalances at least
    min_interval: float = attrs.field(default=5.0, validator=_positive)
    #: seconds between two looks at the observed lengths
    check_interval: float = attrs.field(default=1.0, validator=_positive)
    #: finished requests observed before the first decision
    min_requests: int = attrs.field(default=16, validator=_positive)
    #: the last this many finished requests are what the split is sized for
    window: int = attrs.field(default=64, validator=_positive)
    #: pages for this multiple of the mean request length
    headroom: float = attrs.field(default=1.25, validator=_positive)


class Split(NamedTuple):
    """Pool sizes, reserved ids included (as :meth:`Engine.rebalance` takes them)."""

    num_pages: int
    num_slots: int
    num_draft_pages: int | None


def target_split(
    lengths: Iterable[int], layout: CacheLayout, *, max_running: int, memory_bytes: int, headroom: float
) -> Split:
    """Pages for ``max_running`` requests of the mean of ``lengths`` tokens (times ``headroom``), draft pages
    covering the same tokens, and every byte left of ``memory_bytes`` as state slots (at least one per running
    request, plus the reserved one).

    :raises ~kvferry.errors.ConfigError: no lengths, or a budget too small for one page per running request.
    """
    observed = list(lengths)
    if not observed:
        raise ConfigError("no request lengths observed yet")
    tokens_per_block = layout.layer_group("attention").tokens_per_block
    has_draft = layout.has_group("draft")
    draft_per_page = tokens_per_block / layout.layer_group("draft").tokens_per_block if has_draft else 0.0
    page_cost = layout.page_bytes("attention") + (
        draft_per_page * layout.page_bytes("draft") if has_draft else 0
    )
    slot_cost = layout.bytes_per_slot
    min_slots = max_running + 1 if slot_cost else 0
    affordable = int((memory_bytes - min_slots * slot_cost) // page_cost) - 1
    if affordable < max_running:
        raise ConfigError(f"{memory_bytes} bytes cannot hold a page per running request and their slots")
    wanted = math.ceil(max_running * statistics.fmean(observed) * headroom / tokens_per_block)
    pages = min(max(wanted, max_running), affordable) + 1
    left = memory_bytes - pages * page_cost
    slots = int(left // slot_cost) if slot_cost else 0
    draft = int((pages - 1) * draft_per_page) + 1 if has_draft else None
    return Split(pages, slots, draft)


def _pool_bytes(layout: CacheLayout, config: CacheManagerConfig) -> int:
    """Bytes the pages (attention and draft) and the state slots of ``config`` take."""
    memory = config.num_pages * layout.page_bytes("attention") + config.num_slots * layout.bytes_per_slot
    if layout.has_group("draft"):
        memory += config.num_draft_pages * layout.page_bytes("draft")
    return memory


@define(eq=False)
class AutoBalancer:
    """Rebalances ``engine`` by :func:`target_split` of the lengths it observed (run :meth:`run` in a task
    group; cancel it to stop: a rebalance under way finishes first, at the engine's step boundary)."""

    engine: Engine
    policy: BalancePolicy = attrs.field(factory=BalancePolicy)
    #: the splits applied, in order
    applied: list[Split] = attrs.field(factory=list, init=False)
    refused: int = attrs.field(default=0, init=False)
    _last: float = attrs.field(default=-math.inf, init=False)
    #: the budget split (the policy's, or what the pools took at the first decision)
    _memory: int | None = attrs.field(default=None, init=False)

    def decide(self) -> Split | None:
        """The split to apply now (None: not enough observed, too soon, or within the hysteresis)."""
        lengths = list(self.engine.recent_lengths)[-self.policy.window :]
        if len(lengths) < self.policy.min_requests:
            return None
        if time.perf_counter() - self._last < self.policy.min_interval:
            return None
        manager = self.engine.cache.primary  # type: ignore[attr-defined]
        arena = manager.arena
        config = manager.config
        if self._memory is None:
            self._memory = self.policy.memory_bytes or _pool_bytes(arena.layout, config)
        memory = self._memory
        split = target_split(
            lengths,
            arena.layout,
            max_running=self.engine.config.scheduler.max_running,
            memory_bytes=memory,
            headroom=self.policy.headroom,
        )
        if abs(split.num_pages - config.num_pages) <= self.policy.hysteresis * config.num_pages:
            return None
        return split

    async def step(self) -> Split | None:
        """Decide, and rebalance when the decision says so; the split applied (None: none)."""
        try:
            split = self.decide()
        except ConfigError:
            self.refused += 1  # the budget cannot hold what was observed: keep the split there is
            return None
        if split is None:
            return None
        self._last = time.perf_counter()
        try:
            await self.engine.rebalance(
                num_pages=split.num_pages, num_slots=split.num_slots, num_draft_pages=split.num_draft_pages
            )
        except RebalanceRefused:
            self.refused += 1  # a request too large for the new split, or a transfer: try again later
            return None
        self.applied.append(split)
        return split

    async def run(self) -> None:
        """:meth:`step` every ``check_interval`` seconds, until cancelled."""
        while True:
            await anyio.sleep(self.policy.check_interval)
            await self.step()

    def __repr__(self) -> str:
        return f"<AutoBalancer {len(self.applied)} applied, {self.refused} refused, {self.policy!r}>"
