"""The lifecycle of one request's cache in the manager: one state enum, one transition table, the state each
operation needs, and what a resume reports.

::

    create ──> SUSPENDED ──resume──> ACTIVE ──grow/commit──> ACTIVE ──suspend──> SUSPENDED ... ──close──> CLOSED
                   │ pages held; under pressure (or on request) moved to the host with slot and replay state
                   └─ rebalance only while every cache is SUSPENDED and no transfer touches the pools

- SUSPENDED: the request holds no batch row. Its pages and slot stay on the device, or move to the host
  (:class:`Offload` says when); a request that was never resumed holds only its prefix match.
- ACTIVE: the request holds a batch row, pages for its capacity and a live slot; only ACTIVE requests grow
  and commit.
- CLOSED: everything the request held is released (or quarantined); the manager forgets the request.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable

from attrs import frozen

from kvferry.errors import InvalidTransition

__all__ = [
    "REQUIRED_STATE",
    "TRANSITIONS",
    "CacheState",
    "Offload",
    "Resumed",
    "check_transition",
    "require_state",
]


class CacheState(enum.Enum):
    """Where a request's cache is in its lifecycle."""

    SUSPENDED = "suspended"
    ACTIVE = "active"
    CLOSED = "closed"


class Offload(enum.Enum):
    """What :meth:`CacheManager.suspend <kvferry.pools.manager.CacheManager.suspend>` may do with the request's
    device memory."""

    #: keep it on the device: a transfer may be reading or writing it
    NEVER = "never"
    #: keep it on the device until another request needs the room (then it moves to the host, LRU first)
    ON_PRESSURE = "on_pressure"
    #: move it to the host now
    NOW = "now"


#: The one table of state changes: ``TRANSITIONS[src]`` is the set of states ``src`` may move to.
TRANSITIONS: dict[CacheState, frozenset[CacheState]] = {
    CacheState.SUSPENDED: frozenset({CacheState.ACTIVE, CacheState.CLOSED}),
    CacheState.ACTIVE: frozenset({CacheState.SUSPENDED, CacheState.CLOSED}),
    CacheState.CLOSED: frozenset(),
}

#: The state each operation needs its request in (the key is the operation's name in its errors).
REQUIRED_STATE: dict[str, CacheState] = {
    "resume": CacheState.SUSPENDED,
    "offload": CacheState.SUSPENDED,
    "pin": CacheState.SUSPENDED,
    "extend": CacheState.SUSPENDED,
    "restore": CacheState.SUSPENDED,
    "grow": CacheState.ACTIVE,
    "commit": CacheState.ACTIVE,
    "suspend": CacheState.ACTIVE,
}


def check_transition(src: CacheState, dst: CacheState) -> None:
    """Raise :class:`~kvferry.errors.InvalidTransition` unless ``src -> dst`` is in :data:`TRANSITIONS`."""
    if dst not in TRANSITIONS[src]:
        raise InvalidTransition(f"cache state {src.name} -> {dst.name} is not allowed")


def require_state(request_id: Hashable, state: CacheState, operation: str) -> None:
    """Raise :class:`~kvferry.errors.InvalidTransition` unless ``state`` is what ``operation`` needs."""
    needed = REQUIRED_STATE[operation]
    if state is not needed:
        raise InvalidTransition(f"{operation} of {request_id!r}: it is {state.value}, not {needed.value}")


@frozen
class Resumed:
    """What :meth:`CacheManager.resume <kvferry.pools.manager.CacheManager.resume>` did."""

    #: prompt tokens whose KV and recurrent state came from the prefix cache (0 without a hit)
    reused_tokens: int
    #: tokens committed so far (``reused_tokens`` on the first resume)
    num_committed_tokens: int
    #: True on the request's first resume (its slot was initialised from a snapshot or zeroed)
    first: bool
    #: True when pages, slot and replay state came back from the host
    restored: bool
    #: token range ``[draft_hit, reused_tokens)`` of draft KV that the draft mirror could not reuse and that was
    #: zero-filled ((0, 0) when there is no gap). Draft proposals of the request differ from a fresh run's
    #: unless the engine recomputes this range (it needs the target's hidden states of it); so may those of a
    #: request whose match covers blocks an earlier request indexed after its own gap. Tokens never differ.
    draft_zeroed: tuple[int, int]
