"""A pool rebalance asked of a running engine, done at a step boundary (:meth:`Engine.rebalance
<kvferry.engine.engine.Engine.rebalance>`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio
import attrs
from attrs import define

from kvferry.engine.scheduler import Scheduler
from kvferry.errors import KvferryError, RebalanceRefused

__all__ = ["RebalanceCall", "rebalance_pools"]


@define(eq=False)
class RebalanceCall:
    """A rebalance asked for: the new sizes (None: unchanged), set ``done`` when it was tried, ``error`` when
    it was refused."""

    sizes: dict[str, int | None]
    done: anyio.Event = attrs.field(factory=anyio.Event)
    error: BaseException | None = None


def rebalance_pools(
    cache: Any,
    runner: Any,
    scheduler: Scheduler,
    call: RebalanceCall,
    callbacks: Sequence[Callable[[Sequence[Any]], None]],
) -> bool:
    """At a step boundary: suspend every running request, rebuild every rank's pools, rebind the runner to the
    new arenas and run ``callbacks``; whether it happened (else ``call.error`` says why, and nothing changed but
    the suspends: those requests are admitted again)."""
    if scheduler.num_transferring:
        call.error = RebalanceRefused(
            f"{scheduler.num_transferring} requests wait for their cache from another engine"
        )
        return False
    scheduler.preempt_all()
    try:
        arenas = cache.rebalance(**call.sizes)
    except KvferryError as exc:
        call.error = exc  # refused: nothing changed, the preempted requests are admitted again
        return False
    try:
        runner.rebind(arenas)
        for callback in callbacks:
            callback(arenas)
    except KvferryError as exc:
        call.error = exc
    return True
