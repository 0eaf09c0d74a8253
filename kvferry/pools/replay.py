"""Replay state of speculative decoding: how many of a verify step's tokens were accepted, per state slot.

After a verify step the live slot holds the state before the step and the replay buffers hold what the
accepted tokens would add; ``num_accepted`` says how many of them the next step replays. The count is written
into the live slot of a request on the device, or into its host copy while it is offloaded.

Writes may be deferred (one tensor write per request and step is costly): every deferred write lands in one
:meth:`ReplayState.flush`, which the manager runs before anything that moves, copies, frees or resets a slot.
"""

from __future__ import annotations

import torch

from kvferry.pools.rank_pools import RankPools
from kvferry.pools.record import RequestRecord

__all__ = ["ReplayState"]


class ReplayState:
    """``num_accepted`` of the requests of one rank's pools, with the deferred writes not yet in the arena."""

    def __init__(self, pools: RankPools) -> None:
        self._pools = pools
        #: slot -> num_accepted recorded with ``defer=True``, not yet in the arena
        self._deferred: dict[int, int] = {}

    def set_num_accepted(self, record: RequestRecord, num_accepted: int, *, defer: bool) -> None:
        """Record the count in the live slot (queued with ``defer``) or in the host copy."""
        arena = self._pools.arena
        if arena is None or self._pools.slots is None:
            return
        host = record.host
        if host is not None and host.slots is not None and host.slots.num_accepted is not None:
            host.slots.num_accepted.fill_(num_accepted)
        elif record.slot is not None:
            if defer:
                self._deferred[record.slot] = num_accepted
                return
            self.flush()
            arena.num_accepted[record.slot] = num_accepted

    def flush(self) -> None:
        """Write every deferred count into the arena (one tensor write)."""
        if not self._deferred:
            return
        arena = self._pools.arena
        assert arena is not None
        device = arena.num_accepted.device
        slots = torch.tensor(list(self._deferred), dtype=torch.int64, device=device)
        values = torch.tensor(list(self._deferred.values()), dtype=torch.int64, device=device)
        self._deferred.clear()
        arena.num_accepted.index_put_((slots,), values)

    def drop(self, record: RequestRecord) -> None:
        """Forget the request's replay state: ``num_accepted = 0`` (the host copy drops its replay buffers)."""
        arena = self._pools.arena
        if arena is None or self._pools.slots is None:
            return
        self.flush()
        host = record.host
        if host is not None and host.slots is not None:
            host.slots.replay = None
            host.slots.num_accepted = None
        elif record.slot is not None:
            arena.reset_replay([record.slot])

    def debug_state(self) -> tuple[tuple[int, int], ...]:
        return tuple(sorted(self._deferred.items()))

    def __repr__(self) -> str:
        return f"<ReplayState {len(self._deferred)} deferred writes>"
