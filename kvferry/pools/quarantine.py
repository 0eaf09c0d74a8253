"""Quarantines: pages and a slot of a closed request held back from reuse while a transfer may still write (or
read) them.

A closed request's memory goes back to the pools at once, unless the close quarantines it: then nothing of it
is handed out again until the quarantine is released. A rebalance is refused while any quarantine is held.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from attrs import define

from kvferry.errors import UnknownRequest
from kvferry.pools.record import RequestId, RequestRecord

__all__ = ["Quarantine", "Quarantines"]


@define(eq=False)
class Quarantine:
    """Pages and a slot held back from reuse because a transfer may still write (or read) them.

    Created by :meth:`CacheManager.close <kvferry.pools.manager.CacheManager.close>` with ``quarantine=True``;
    returned to the pools by :meth:`CacheManager.release <kvferry.pools.manager.CacheManager.release>`
    (idempotent).
    """

    quarantine_id: int
    request_id: RequestId
    pages: tuple[int, ...]
    draft_pages: tuple[int, ...]
    slot: int | None
    released: bool = False


class Quarantines:
    """The unreleased quarantines of one manager."""

    def __init__(self) -> None:
        self._held: dict[int, Quarantine] = {}
        self._ids = itertools.count()

    def hold(self, record: RequestRecord) -> Quarantine:
        """Take over the record's pages, draft pages and slot (the caller clears them from the record)."""
        quarantine = Quarantine(
            next(self._ids), record.request_id, tuple(record.pages), tuple(record.draft_pages), record.slot
        )
        self._held[quarantine.quarantine_id] = quarantine
        return quarantine

    def take_back(self, quarantine: Quarantine) -> bool:
        """Stop holding ``quarantine``: True when its pages and slot are now the caller's to free (and mark
        ``released`` once freed), False when it was released before.

        :raises ~kvferry.errors.UnknownRequest: if the quarantine was not held here; nothing changed.
        """
        if quarantine.released:
            return False
        if self._held.pop(quarantine.quarantine_id, None) is not quarantine:
            raise UnknownRequest(f"quarantine {quarantine.quarantine_id} does not belong to this manager")
        return True

    @property
    def num_pages(self) -> int:
        """Attention pages held (a page held twice counts once)."""
        return len({p for q in self._held.values() for p in q.pages})

    @property
    def num_slots(self) -> int:
        return sum(1 for q in self._held.values() if q.slot is not None)

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[Quarantine]:
        return iter(self._held.values())

    def debug_state(self) -> tuple[int, ...]:
        return tuple(sorted(self._held))

    def __repr__(self) -> str:
        return f"<Quarantines {len(self._held)} held: {self.num_pages} pages, {self.num_slots} slots>"
