"""Recurrent state slot bookkeeping: live slots, snapshots and their eviction. No memory is touched here.

Every slot of a state group holds one whole recurrent state (conv window + SSM matrix of every layer) plus, beside
it, that slot's replay buffers. A slot is either

- **free**: in the free list (FIFO: freed slots go to the tail, allocation takes the head);
- **live**: the one slot of a request, written by every model step;
- a **snapshot**: a copy of some request's live slot taken exactly at a reusable boundary, indexed by the chained
  block hash of the block that ends there (the same hash as the attention page of that block). Snapshots are
  evicted LRU when slots run short, except the ones *pinned* by a request that matched them and has not yet
  copied them into its live slot;
- **reserved**: slot :data:`DUMMY_SLOT` backs padding rows and attention-DP dummy requests.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import NamedTuple

from attrs import define

from kvferry.errors import ConfigError, InvalidTransition, PoolExhausted
from kvferry.pools.blocks import PageHash

__all__ = ["DUMMY_SLOT", "SlotPool", "SlotPoolStatistics", "Snapshot"]

#: Slot 0 of every state group is reserved: padding rows of the batch and dummy requests point at it.
DUMMY_SLOT = 0


@define(eq=False)
class Snapshot:
    """A recurrent state valid exactly after ``num_tokens`` tokens of the sequence ending in ``block_hash``."""

    block_hash: PageHash
    slot_id: int
    num_tokens: int
    #: requests that matched this snapshot and still have to copy it (never evicted while > 0)
    pins: int = 0


class SlotPoolStatistics(NamedTuple):
    """Counts of one state group (the reserved dummy slot excluded)."""

    #: usable slots
    num_slots: int
    #: slots owned by requests or quarantines
    live: int
    #: slots holding snapshots
    snapshot: int
    #: snapshots that may not be evicted now
    snapshot_pinned: int
    #: slots in the free list
    free: int


class SlotPool:
    """Slot ids of one state group: a FIFO free list plus an LRU index of snapshots by block hash."""

    __slots__ = ("_free", "_live", "_num_unpinned", "_snapshots", "name", "num_slots", "snapshots_evicted")

    def __init__(self, num_slots: int, *, name: str = "state") -> None:
        if num_slots < 1:
            raise ConfigError(
                f"{name}: a state group needs at least the dummy slot, got num_slots={num_slots}"
            )
        self.name = name
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(1, num_slots))
        self._live: set[int] = set()
        # LRU order: first = least recently used
        self._snapshots: OrderedDict[PageHash, Snapshot] = OrderedDict()
        self._num_unpinned = 0  # kept so num_available is O(1): the scheduler asks on every step
        self.snapshots_evicted = 0

    def __repr__(self) -> str:
        s = self.statistics()
        return f"<SlotPool {self.name} [{s.live} live, {s.snapshot} snapshot, {s.free} free]>"

    # --- queries ---------------------------------------------------------------------------------------

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_available(self) -> int:
        """Slots :meth:`allocate` can hand out now: free ones plus unpinned snapshots it may evict."""
        return len(self._free) + self._num_unpinned

    def free_slot_ids(self) -> list[int]:
        return list(self._free)

    def snapshot(self, block_hash: PageHash) -> Snapshot | None:
        return self._snapshots.get(block_hash)

    def snapshots(self) -> list[Snapshot]:
        """All snapshots, least recently used first (eviction order among the unpinned ones)."""
        return list(self._snapshots.values())

    def is_live(self, slot_id: int) -> bool:
        return slot_id in self._live

    def statistics(self) -> SlotPoolStatistics:
        pinned = len(self._snapshots) - self._num_unpinned
        return SlotPoolStatistics(
            self.num_slots - 1, len(self._live), len(self._snapshots), pinned, len(self._free)
        )

    def debug_state(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[bytes, int, int, int], ...]]:
        """(free list, live slots, snapshots in LRU order): compare before/after to prove nothing changed."""
        return (
            tuple(self._free),
            tuple(sorted(self._live)),
            tuple((s.block_hash, s.slot_id, s.num_tokens, s.pins) for s in self._snapshots.values()),
        )

    # --- live slots ------------------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` live slots from the head of the free list, evicting LRU unpinned snapshots if needed.

        :raises ~kvferry.errors.PoolExhausted: if free slots plus evictable snapshots are fewer than ``n``;
            nothing changed (no snapshot was evicted).
        """
        if n < 0:
            raise ConfigError(f"cannot allocate {n} slots")
        if n > self.num_available:
            raise PoolExhausted(f"{self.name}: need {n} slots, {self.num_available} available")
        while len(self._free) < n:
            self._evict_one()
        slots = [self._free.popleft() for _ in range(n)]
        self._live.update(slots)
        return slots

    def free(self, slot_ids: Sequence[int]) -> None:
        """Return live slots to the tail of the free list.

        :raises ~kvferry.errors.InvalidTransition: if a slot is not live; nothing changed.
        """
        if len(set(slot_ids)) != len(slot_ids) or any(s not in self._live for s in slot_ids):
            raise InvalidTransition(f"{self.name}: slots {list(slot_ids)} are not all live")
        for slot_id in slot_ids:
            self._live.remove(slot_id)
            self._free.append(slot_id)

    # --- snapshots -------------------------------------------------------------------------------------

    def add_snapshot(self, block_hash: PageHash, num_tokens: int) -> int | None:
        """Reserve a slot for a new snapshot; the caller copies the live state into it.

        Best effort: takes a free slot or evicts the LRU unpinned snapshot; returns None (and changes nothing)
        when neither exists or a snapshot of ``block_hash`` already exists (that one is marked recently used).
        """
        existing = self._snapshots.get(block_hash)
        if existing is not None:
            self._snapshots.move_to_end(block_hash)
            return None
        if not self._free and not self._evict_one():
            return None
        slot_id = self._free.popleft()
        self._snapshots[block_hash] = Snapshot(block_hash, slot_id, num_tokens)
        self._num_unpinned += 1
        return slot_id

    def pin(self, block_hash: PageHash) -> Snapshot:
        """Keep a snapshot from eviction until :meth:`unpin`; marks it recently used."""
        snap = self._snapshots.get(block_hash)
        if snap is None:
            raise InvalidTransition(f"{self.name}: no snapshot {block_hash.hex()[:8]}")
        if snap.pins == 0:
            self._num_unpinned -= 1
        snap.pins += 1
        self._snapshots.move_to_end(block_hash)
        return snap

    def unpin(self, block_hash: PageHash) -> None:
        snap = self._snapshots.get(block_hash)
        if snap is None or snap.pins == 0:
            raise InvalidTransition(f"{self.name}: snapshot {block_hash.hex()[:8]} is not pinned")
        snap.pins -= 1
        if snap.pins == 0:
            self._num_unpinned += 1

    def clear_snapshots(self) -> int:
        """Drop every unpinned snapshot (their slots go back to the free list); returns how many."""
        victims = [h for h, snap in self._snapshots.items() if snap.pins == 0]
        for block_hash in victims:
            self._free.append(self._snapshots.pop(block_hash).slot_id)
        self._num_unpinned -= len(victims)
        return len(victims)

    def _evict_one(self) -> bool:
        for block_hash, snap in self._snapshots.items():
            if snap.pins == 0:
                del self._snapshots[block_hash]
                self._free.append(snap.slot_id)
                self._num_unpinned -= 1
                self.snapshots_evicted += 1
                return True
        return False
