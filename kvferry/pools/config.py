"""The sizes and policies of one rank's cache manager, the names of its paged groups, and the check that an arena
holds exactly what a config counts."""

from __future__ import annotations

from attrs import frozen

from kvferry.errors import ConfigError
from kvferry.pools.blocks import NULL_PAGE
from kvferry.pools.layout import CacheLayout
from kvferry.pools.slots import DUMMY_SLOT

__all__ = ["ATTENTION", "DRAFT", "CacheManagerConfig", "check_arena_fits"]

#: Name of the target's paged group (as in :class:`~kvferry.pools.layout.CacheLayout`).
ATTENTION = "attention"
#: Name of the drafter's paged group.
DRAFT = "draft"


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
    #: reuse the drafter's KV through the draft prefix index (False: the reused prefix's draft KV is zero-filled
    #: and no draft block is indexed; the target's reuse is unchanged). Has no effect without ``enable_reuse``
    enable_draft_reuse: bool = True
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


def check_arena_fits(config: CacheManagerConfig, layout: CacheLayout) -> None:
    """Raise :class:`~kvferry.errors.ConfigError` unless the arena has exactly the pages and slots the config
    counts (so no id the pools hand out can fall outside it)."""
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
