"""Rows of the model's batch: which row each ACTIVE request and each attention-DP dummy holds, and the
``state_indices`` tensor that maps a row to its state slot.

A row is taken on resume (or by a dummy) and given back on suspend and close; free rows are handed out lowest
first. Free and dummy rows point at :data:`~kvferry.pools.slots.DUMMY_SLOT`.
"""

from __future__ import annotations

import heapq

import torch

from kvferry.errors import PoolExhausted
from kvferry.pools.slots import DUMMY_SLOT

__all__ = ["BatchRows"]


class BatchRows:
    """The ``max_batch_size`` rows of one rank's batch and their ``[max_batch_size]`` slot tensor on ``device``."""

    def __init__(self, max_batch_size: int, device: torch.device) -> None:
        self.max_batch_size = max_batch_size
        self._free = list(range(max_batch_size))
        self._dummies: set[int] = set()
        self._state_indices = torch.full((max_batch_size,), DUMMY_SLOT, dtype=torch.int64, device=device)
        #: row -> slot changed since state_indices was last read (written there in one go)
        self._changed: dict[int, int] = {}

    @property
    def state_indices(self) -> torch.Tensor:
        """The state slot of each row; rows changed since the last read are written first, in one go."""
        if self._changed:
            device = self._state_indices.device
            rows = torch.tensor(list(self._changed), dtype=torch.int64, device=device)
            slots = torch.tensor(list(self._changed.values()), dtype=torch.int64, device=device)
            self._changed.clear()
            self._state_indices.index_put_((rows,), slots)
        return self._state_indices

    @property
    def has_free(self) -> bool:
        return bool(self._free)

    @property
    def num_dummies(self) -> int:
        return len(self._dummies)

    def take(self, slot: int | None) -> int:
        """The lowest free row, now pointing at ``slot`` (None: DUMMY_SLOT). The caller checks :attr:`has_free`."""
        row = heapq.heappop(self._free)
        self._changed[row] = DUMMY_SLOT if slot is None else slot
        return row

    def give_back(self, row: int) -> None:
        """Free a request's row; it points at DUMMY_SLOT again."""
        self._changed[row] = DUMMY_SLOT
        heapq.heappush(self._free, row)

    def add_dummy(self) -> int:
        """Take a row for an attention-DP dummy request (slot DUMMY_SLOT).

        :raises ~kvferry.errors.PoolExhausted: if every row is taken.
        """
        if not self._free:
            raise PoolExhausted(f"all {self.max_batch_size} batch rows are taken")
        row = self.take(None)
        self._dummies.add(row)
        return row

    def remove_dummy(self, row: int) -> None:
        """Give a dummy's row back. Idempotent (a row that is not a dummy's is left alone)."""
        if row in self._dummies:
            self._dummies.remove(row)
            heapq.heappush(self._free, row)

    def debug_state(self) -> tuple[object, ...]:
        return (
            tuple(sorted(self._free)),
            tuple(sorted(self._dummies)),
            tuple(self.state_indices.tolist()),
        )

    def __repr__(self) -> str:
        taken = self.max_batch_size - len(self._free)
        return f"<BatchRows {taken}/{self.max_batch_size} taken ({len(self._dummies)} dummies)>"
