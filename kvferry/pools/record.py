"""One request's ownership record: every page, draft page, slot, batch row and host copy it holds, and where its
tokens stand.

Token positions of one request::

    | reused prefix | committed tokens ..................| capacity (allocated, not yet committed) |
    0          reused_tokens               state_tokens  num_committed_tokens                 capacity
                                            └ the live slot is valid here; the replay buffers hold the rest

A page id in ``pages`` or ``draft_pages`` is one reference on that page (shared prefix pages have one per
owner); ``slot`` is the request's own live slot, never shared.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

import attrs
import numpy as np
from attrs import define

from kvferry.errors import ConfigError, UnknownRequest
from kvferry.pools.arena import HostPages, HostSlots
from kvferry.pools.blocks import PageHash
from kvferry.pools.lifecycle import CacheState, Offload, check_transition
from kvferry.wire import INT64_MAX, INT64_MIN

if TYPE_CHECKING:
    from kvferry.pools.host_memory import HostBuffer
    from kvferry.pools.moves import PendingMove

__all__ = ["HostCopy", "RequestId", "RequestRecord", "find_record", "token_list"]

RequestId: TypeAlias = Hashable


@define(eq=False)
class HostCopy:
    """A suspended request's bytes on the host: its pages, draft pages, slot and replay state (None: no bytes,
    a manager without an arena or nothing of that kind held), each a view of one host buffer."""

    pages: HostPages | None
    draft_pages: HostPages | None
    slots: HostSlots | None
    num_pages: int
    num_draft_pages: int
    #: the buffer the views above lie in (None: no bytes); given back when the copy is dropped
    buffer: HostBuffer | None = None


@define(eq=False)
class RequestRecord:
    """What one request holds in the pools; every change of ``state`` goes through :meth:`transition`."""

    request_id: RequestId
    prompt: list[int]
    #: the parent hash of the request's first block (the salt's root)
    parent: PageHash
    state: CacheState = CacheState.SUSPENDED
    tokens: list[int] = attrs.field(factory=list)
    #: chained hashes of the request's full attention blocks
    block_hashes: list[PageHash] = attrs.field(factory=list)
    pages: list[int] = attrs.field(factory=list)
    draft_pages: list[int] = attrs.field(factory=list)
    slot: int | None = None
    row: int | None = None
    capacity: int = 0
    reused_tokens: int = 0
    #: the snapshot the prefix match pinned, until the first resume copies it
    pinned: PageHash | None = None
    resumed: bool = False
    pending_replay: int = 0
    last_snapshot: int = 0
    #: chained hashes of draft blocks whose draft KV is final (block b covers tokens b*d .. (b+1)*d inclusive)
    draft_hashes: list[PageHash] = attrs.field(factory=list)
    #: draft KV of positions [0, draft_valid) is final: matched, zero-filled on the first resume (counted here
    #: once the drafter committed KV after the gap) or written by the drafter for committed tokens
    draft_valid: int = 0
    #: prompt tokens the draft match covers (<= reused_tokens)
    draft_hit: int = 0
    #: the draft token range the first resume zero-filled, ``[draft_hit, reused_tokens)``; (0, 0): none
    draft_zeroed: tuple[int, int] = (0, 0)
    #: cached draft page whose front is copied into the straddling block on the first resume (a reference held)
    draft_source: int | None = None
    host: HostCopy | None = None
    offload: Offload = Offload.ON_PRESSURE
    #: order of the last suspend: offload under pressure takes the least recent first
    suspend_seq: int = 0
    #: the copy to the host or back in flight (a two-phase move between its start and its finish)
    moving: PendingMove | None = None

    @property
    def state_tokens(self) -> int:
        """The position the live slot is valid at: committed tokens minus those still in the replay buffers."""
        return len(self.tokens) - self.pending_replay

    def transition(self, state: CacheState) -> None:
        """Move to ``state``. :raises ~kvferry.errors.InvalidTransition: if the lifecycle does not allow it."""
        check_transition(self.state, state)
        self.state = state

    def debug_state(self) -> tuple[Any, ...]:
        return (
            repr(self.request_id),
            self.state,
            len(self.tokens),
            tuple(self.pages),
            tuple(self.draft_pages),
            self.slot,
            self.row,
            self.capacity,
            self.reused_tokens,
            self.pinned,
            tuple(self.draft_hashes),
            self.draft_valid,
            self.draft_hit,
            self.draft_zeroed,
            self.draft_source,
            self.resumed,
            self.pending_replay,
            self.host is not None,
            self.offload,
            self.moving is not None,
        )

    def __repr__(self) -> str:
        where = "host" if self.host is not None else "device"
        if self.moving is not None:
            where += f" ({self.moving.kind.value} in flight)"
        return (
            f"<RequestRecord {self.request_id!r} {self.state.value} on {where}: {len(self.tokens)} tokens, "
            f"capacity {self.capacity}, {len(self.pages)} pages, {len(self.draft_pages)} draft pages, "
            f"slot {self.slot}, row {self.row}>"
        )


def token_list(token_ids: Iterable[int] | np.ndarray) -> list[int]:
    """Token ids as a list of Python ints (a list input of int64 ints is returned as is, not copied).

    :raises ~kvferry.errors.ConfigError: if the ids are not a 1-D sequence of 64-bit integers.
    """
    if type(token_ids) is list or type(token_ids) is tuple:  # the per-step fast path
        for t in token_ids:
            if type(t) is not int or not INT64_MIN <= t <= INT64_MAX:
                break
        else:
            return token_ids if type(token_ids) is list else list(token_ids)
    try:
        array = np.asarray(token_ids)
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            raise ConfigError(
                f"token ids must be a 1-D sequence of 64-bit integers, got {array.dtype} {array.shape}"
            )
        if array.dtype == np.uint64 and array.size and int(array.max()) > INT64_MAX:
            raise ConfigError("token ids must be 64-bit integers, got values above 2**63 - 1")
        return [int(t) for t in array.tolist()]
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(f"token ids must be a 1-D sequence of 64-bit integers: {exc}") from None


def find_record(records: Mapping[RequestId, RequestRecord], request_id: RequestId) -> RequestRecord:
    """The record of a live request. :raises ~kvferry.errors.UnknownRequest: if there is none (closed ones are
    forgotten)."""
    try:
        return records[request_id]
    except KeyError:
        raise UnknownRequest(f"unknown request {request_id!r}") from None
