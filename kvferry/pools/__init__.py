"""The cache of one rank: what the model's layers need (spec, layout), the memory (arena), who owns which page
and slot (the cache manager and the bookkeeping under it), and the page table a peer reads.

Import direction inside the package: spec -> layout -> arena / blocks / slots -> the manager's parts
(config, rank_pools, lifecycle, record, prefix, draft_mirror, host_memory, moves, offload, ...) -> manager;
pagetable reads spec and layout.

The public names below are imported on first use, so importing one module of the package (``pools.spec``
for a wire message, say) never imports the others, and no import cycle can pass through this file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvferry._lazy import lazy_exports

if TYPE_CHECKING:
    from kvferry.pools.arena import CacheArena as CacheArena
    from kvferry.pools.blocks import PagePool as PagePool
    from kvferry.pools.layout import CacheLayout as CacheLayout
    from kvferry.pools.manager import ATTENTION as ATTENTION
    from kvferry.pools.manager import DRAFT as DRAFT
    from kvferry.pools.manager import CacheManager as CacheManager
    from kvferry.pools.manager import CacheManagerConfig as CacheManagerConfig
    from kvferry.pools.manager import CacheManagerStatistics as CacheManagerStatistics
    from kvferry.pools.manager import CacheState as CacheState
    from kvferry.pools.manager import Offload as Offload
    from kvferry.pools.manager import Quarantine as Quarantine
    from kvferry.pools.manager import Resumed as Resumed
    from kvferry.pools.moves import MoveKind as MoveKind
    from kvferry.pools.moves import MoveState as MoveState
    from kvferry.pools.moves import PendingMove as PendingMove
    from kvferry.pools.pagetable import PageTable as PageTable
    from kvferry.pools.slots import SlotPool as SlotPool
    from kvferry.pools.spec import ModelSpec as ModelSpec
    from kvferry.pools.spec import RankSpec as RankSpec
    from kvferry.pools.spec import preset as preset

#: public name -> module that defines it
_LAZY: dict[str, str] = {
    "ModelSpec": "kvferry.pools.spec",
    "RankSpec": "kvferry.pools.spec",
    "preset": "kvferry.pools.spec",
    "CacheLayout": "kvferry.pools.layout",
    "CacheArena": "kvferry.pools.arena",
    "PagePool": "kvferry.pools.blocks",
    "SlotPool": "kvferry.pools.slots",
    "PageTable": "kvferry.pools.pagetable",
    "ATTENTION": "kvferry.pools.config",
    "DRAFT": "kvferry.pools.config",
    "CacheManagerConfig": "kvferry.pools.config",
    "CacheState": "kvferry.pools.lifecycle",
    "Offload": "kvferry.pools.lifecycle",
    "Resumed": "kvferry.pools.lifecycle",
    "Quarantine": "kvferry.pools.quarantine",
    "CacheManagerStatistics": "kvferry.pools.statistics",
    "MoveKind": "kvferry.pools.moves",
    "MoveState": "kvferry.pools.moves",
    "PendingMove": "kvferry.pools.moves",
    "CacheManager": "kvferry.pools.manager",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
