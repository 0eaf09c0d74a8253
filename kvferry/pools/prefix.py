"""Prefix reuse of attention pages and recurrent-state snapshots.

The rules that keep other requests' or stale bytes out of a request:

- Reuse is per full block. A block's key is a chained hash (:func:`~kvferry.pools.blocks.hash_block`) of its
  tokens and the key of the block before it, rooted in the request's salt, so a block matches only after the
  same tokens from the start of the sequence.
- A prompt matches at most all of its tokens but the last, in whole blocks, pruned back to the last block that
  has a recurrent snapshot (a hybrid model cannot resume mid-sequence without the state there). The match takes
  references on the cached pages and pins the snapshot, so neither is evicted before the first resume.
- Shared pages are never written: the request writes from ``reused_tokens`` on, which starts a new block.
- The first resume *copies* the pinned snapshot into the request's own live slot (a snapshot is never used in
  place) and resets the replay buffers; a request without a match gets a zeroed slot.
- A block enters the index when it is full of committed tokens. A snapshot is taken when the live slot's
  position (committed tokens minus tokens still pending in the replay buffers) lands exactly on a boundary: a
  multiple of ``snapshot_interval``, or the prompt's last full block. :meth:`PrefixReuse.next_snapshot_boundary`
  says where a prefill chunk should end, or an acceptance be capped, so that it lands there.

The draft group mirrors this with rules of its own (:mod:`kvferry.pools.draft_mirror`).
"""

from __future__ import annotations

from kvferry.pools.blocks import hash_block, hash_blocks
from kvferry.pools.rank_pools import RankPools
from kvferry.pools.record import RequestRecord
from kvferry.pools.statistics import Counters

__all__ = ["PrefixReuse"]


class PrefixReuse:
    """The attention prefix index and the snapshots of one rank's pools, as requests match and fill them."""

    def __init__(self, pools: RankPools, counters: Counters) -> None:
        self._pools = pools
        self._counters = counters

    def match(self, record: RequestRecord) -> None:
        """Match a new record's prompt: take references on the cached pages and pin the snapshot at the match's
        end. Sets the record's pages, tokens, block hashes and ``reused_tokens``. Never allocates."""
        pools = self._pools
        tpb = pools.config.tokens_per_block
        usable = (len(record.prompt) - 1) // tpb * tpb
        hashes = hash_blocks(record.prompt[:usable], tpb, parent=record.parent)
        pages = pools.pages.match(hashes)
        count = len(pages)
        slots = pools.slots
        if slots is not None:
            while count and slots.snapshot(hashes[count - 1]) is None:
                count -= 1
        self._counters.reuse_queries += 1
        self._counters.reuse_query_tokens += usable
        if not count:
            return
        pools.pages.touch(pages[:count])
        if slots is not None:
            slots.pin(hashes[count - 1])
            record.pinned = hashes[count - 1]
        reused = count * tpb
        record.pages = pages[:count]
        record.tokens = record.prompt[:reused]
        record.block_hashes = hashes[:count]
        record.capacity = record.reused_tokens = record.last_snapshot = reused
        self._counters.reuse_hits += 1
        self._counters.reuse_hit_tokens += reused

    def forget(self, record: RequestRecord) -> None:
        """Drop a never-resumed record's match: its page references and its pin. The draft mirror forgets its
        own part (:meth:`DraftMirror.forget <kvferry.pools.draft_mirror.DraftMirror.forget>`)."""
        self._pools.pages.free(record.pages)
        self.unpin(record)
        record.pages, record.tokens, record.block_hashes = [], [], []
        record.capacity = record.reused_tokens = record.last_snapshot = 0

    def unpin(self, record: RequestRecord) -> None:
        """Release the snapshot the record's match pinned, if it still holds one."""
        if record.pinned is not None:
            assert self._pools.slots is not None
            self._pools.slots.unpin(record.pinned)
            record.pinned = None

    def initialise_slot(self, record: RequestRecord) -> None:
        """First resume: the live slot from the pinned snapshot (copied, then unpinned) or zeros; fresh replay."""
        slots, arena = self._pools.slots, self._pools.arena
        if slots is None or record.slot is None:
            return
        if record.pinned is not None:
            snapshot = slots.snapshot(record.pinned)
            assert snapshot is not None
            if arena is not None:
                arena.copy_slots([snapshot.slot_id], [record.slot])
            slots.unpin(record.pinned)
            record.pinned = None
        elif arena is not None:
            arena.zero_slots([record.slot])
        if arena is not None:
            arena.reset_replay([record.slot])

    def hash_full_blocks(self, record: RequestRecord, num_blocks: int) -> None:
        """Hash the record's newly full blocks (up to ``num_blocks``) and offer their pages for reuse."""
        pools = self._pools
        tpb, tokens, hashes = pools.config.tokens_per_block, record.tokens, record.block_hashes
        reusable = pools.config.enable_reuse
        parent = hashes[-1] if hashes else record.parent
        for index in range(len(hashes), num_blocks):
            parent = hash_block(parent, tokens[index * tpb : (index + 1) * tpb])
            hashes.append(parent)
            if reusable:
                pools.pages.register(record.pages[index], parent)

    def reoffer(self, record: RequestRecord) -> None:
        """Offer a restored record's hashed blocks for reuse again, in their new pages."""
        if not self._pools.config.enable_reuse:
            return
        for page, block_hash in zip(record.pages, record.block_hashes, strict=False):
            self._pools.pages.register(page, block_hash)

    def is_boundary(self, record: RequestRecord, position: int) -> bool:
        """True when a snapshot is wanted at ``position``: a multiple of ``snapshot_interval``, or the prompt's
        last full block."""
        config = self._pools.config
        tpb, interval = config.tokens_per_block, config.snapshot_interval
        if self._pools.slots is None or position <= 0 or position % tpb:
            return False
        return (interval > 0 and position % interval == 0) or position == len(record.prompt) // tpb * tpb

    def next_snapshot_boundary(self, record: RequestRecord) -> int | None:
        """The next boundary past the live slot's position (None: no snapshots are taken)."""
        config = self._pools.config
        if self._pools.slots is None or not config.enable_reuse:
            return None
        position = record.state_tokens
        tpb, interval = config.tokens_per_block, config.snapshot_interval
        boundary = (position // interval + 1) * interval if interval else None
        prompt_end = len(record.prompt) // tpb * tpb
        if prompt_end > position and (boundary is None or prompt_end < boundary):
            return prompt_end
        return boundary

    def take_snapshot(self, record: RequestRecord, position: int) -> None:
        """Copy the live slot into a snapshot keyed by the block ending at ``position`` (best effort: skipped
        when no slot can be had)."""
        slots = self._pools.slots
        assert slots is not None
        record.last_snapshot = position
        if record.slot is None:
            return
        block_hash = record.block_hashes[position // self._pools.config.tokens_per_block - 1]
        snapshot_slot = slots.add_snapshot(block_hash, position)
        if snapshot_slot is None:
            return
        if self._pools.arena is not None:
            self._pools.arena.copy_slots([record.slot], [snapshot_slot])
        self._counters.snapshots_taken += 1

    def __repr__(self) -> str:
        c = self._counters
        return (
            f"<PrefixReuse {c.reuse_hits}/{c.reuse_queries} hits, {c.reuse_hit_tokens} tokens reused, "
            f"{c.snapshots_taken} snapshots taken>"
        )
