"""How a ``ucx`` write is cut into tagged messages, and how each side moves them in and out of registered memory.

Both sides compute the same :class:`MessagePlan` from the destination rows' lengths (:func:`plan_messages`): a row
of at least ``zero_copy_bytes`` is a message of its own, received straight into place (UCX rendezvous, zero
copy); the rows between such rows are packed, in order, into messages of at most ``pack_bytes``, gathered into a
staging buffer by the writer and scattered by the receiver (:class:`Views`). :func:`windowed` keeps a bounded
number of messages in flight.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import suppress
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt

from kvferry.transports._memory import RegionTable, byte_view
from kvferry.transports.base import Fragments

__all__ = ["MAX_PACK_BYTES", "MAX_WRITE_FRAGMENTS", "MessagePlan", "Views", "plan_messages", "windowed"]

#: most fragments (rows) of one write request: the receiver refuses more from the length of the request's
#: ``dst`` alone, before parsing or planning anything, and a longer write is sent as several requests (its
#: notification with the last): the cap bounds what one request's checks and plan cost the receiver's event loop
MAX_WRITE_FRAGMENTS = 1 << 18
#: packed messages are at most this long (the receiver refuses longer ones)
MAX_PACK_BYTES = 1 << 30
#: most messages one write may be cut into
_MAX_MESSAGES = 1 << 20
_U64 = (1 << 64) - 1


class MessagePlan:
    """How a write is cut into messages: message ``k`` is rows ``first[k]:end[k]``, packed or not (a row alone,
    straight into place). Indexing gives ``(first, end, packed)``; kept as arrays, so that a plan of many
    messages costs no Python object per message until each is sent."""

    __slots__ = ("end", "first", "packed")

    def __init__(
        self, first: npt.NDArray[np.int64], end: npt.NDArray[np.int64], packed: npt.NDArray[np.bool_]
    ) -> None:
        self.first, self.end, self.packed = first, end, packed

    def __len__(self) -> int:
        return len(self.first)

    def __getitem__(self, k: int) -> tuple[int, int, bool]:
        return int(self.first[k]), int(self.end[k]), bool(self.packed[k])

    def __iter__(self) -> Iterator[tuple[int, int, bool]]:
        return zip(self.first.tolist(), self.end.tolist(), self.packed.tolist(), strict=True)


def plan_messages(lengths: npt.NDArray[np.uint64], zero_copy_bytes: int, pack_bytes: int) -> MessagePlan:
    """Cut rows into messages; both sides compute the same plan.

    A row of at least ``zero_copy_bytes`` is a message of its own; the rows between two such rows are packed
    greedily, in order, into messages of at most ``pack_bytes`` (a longer row alone). Vectorised: where a pack
    starting at each row would end is one ``searchsorted`` over the running sum of the lengths, and the packs
    that start where the one before ends are found by pointer doubling (``log2`` of the longest chain of packs
    in numpy passes over the rows), so no Python step is taken per row or per message.

    :raises ValueError: more than :data:`MAX_WRITE_FRAGMENTS` rows, or ``pack_bytes`` outside ``[1, 2**30]``.
    """
    n = len(lengths)
    if n > MAX_WRITE_FRAGMENTS:
        raise ValueError(f"a write may have at most {MAX_WRITE_FRAGMENTS} fragments, this one has {n}")
    if not 1 <= pack_bytes <= MAX_PACK_BYTES:
        raise ValueError(f"packed messages of {pack_bytes} bytes")
    lengths = np.asarray(lengths, dtype=np.uint64)
    alone = lengths >= np.uint64(min(max(zero_copy_bytes, 0), _U64))
    # a row longer than a pack closes the pack before it and is packed alone, whatever its length: clamped, the
    # running sum stays far inside int64 (at most 2**18 rows of 2**30 + 1 bytes)
    short = np.minimum(lengths, np.uint64(pack_bytes + 1)).astype(np.int64)
    short[alone] = 0
    ends = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(short, out=ends[1:])
    rows = np.arange(n + 1, dtype=np.int64)
    # jump[i]: where a pack from short row i ends: rows i.. while their sum stays within pack_bytes (row i at
    # least), never past the next row that travels alone. Rows alone (and the end, n) jump to themselves.
    jump = np.searchsorted(ends, ends + pack_bytes, side="right") - 1
    jump = np.maximum(jump, rows + 1)
    next_alone = np.where(np.append(alone, True), rows, n)
    next_alone = np.minimum.accumulate(next_alone[::-1])[::-1]
    jump = np.minimum(jump, next_alone)
    # the packs of a run of short rows start at its first row, then each where the one before ends: every
    # row reached from a run's first row by jumps. After round t, ``reached`` holds the rows up to 2**t jumps
    # away and ``jump`` goes 2**t jumps at once; done when no jump moves any more.
    reached = np.zeros(n + 1, dtype=bool)
    reached[:n] = ~alone
    reached[1:n] &= alone[:-1]
    while True:
        reached[jump[reached]] = True
        further = jump[jump]
        if np.array_equal(further, jump):
            break
        jump = further
    reached[n] = False
    reached[:n] &= ~alone
    packs = np.flatnonzero(reached)
    if n and len(packs):
        stops = np.empty(len(packs), dtype=np.int64)
        stops[:-1] = packs[1:]
        stops[-1] = n
        # a pack ends where the next pack starts, or at the row alone before it
        stops = np.minimum(stops, next_alone[packs])
    else:
        stops = np.empty(0, dtype=np.int64)
    singles = np.flatnonzero(alone)
    count = len(packs) + len(singles)
    if count > _MAX_MESSAGES:
        raise ValueError(f"a write may be cut into at most {_MAX_MESSAGES} messages, this one needs {count}")
    first = np.concatenate((packs, singles))
    order = np.argsort(first, kind="stable")
    last = np.concatenate((stops, singles + 1))[order]
    is_packed = np.concatenate((np.ones(len(packs), dtype=bool), np.zeros(len(singles), dtype=bool)))[order]
    return MessagePlan(first[order], last, is_packed)


class Views:
    """Byte views of registered ranges, made once per write."""

    def __init__(
        self,
        table: RegionTable,
        fragments: Fragments,
        what: str,
        *,
        index: npt.NDArray[np.int64] | None = None,
    ) -> None:
        """``index``: the range of each row, when the caller has located them already."""
        self.table = table
        self.fragments = fragments
        self.index = table.locate(fragments, what) if index is None else index
        self._cache: dict[int, Any] = {}

    def row(self, row: int) -> Any:
        i = int(self.index[row])
        view = self._cache.get(i)
        if view is None:
            view = self._cache[i] = byte_view(self.table.regions[i])
        offset = int(self.fragments[row, 0]) - self.table.regions[i].address
        return view[offset : offset + int(self.fragments[row, 1])]

    def staging(self, start: int, end: int) -> Any:
        nbytes = int(self.fragments[start:end, 1].sum())
        device = self.table.regions[int(self.index[start])].device
        if device == "cpu":
            return np.empty(nbytes, dtype=np.uint8)
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def _pages(self, start: int, end: int) -> tuple[Any, Any] | None:
        """Rows of one length, inside one region, at offsets that are multiples of it: a page table.

        Then the region is an array of pages and gather/scatter are single indexed copies.
        """
        index = self.index[start:end]
        lengths = self.fragments[start:end, 1]
        if not (bool((index == index[0]).all()) and bool((lengths == lengths[0]).all())):
            return None
        length = int(lengths[0])
        region = self.table.regions[int(index[0])]
        offsets = self.fragments[start:end, 0] - np.uint64(region.address)
        if bool((offsets % np.uint64(length)).any()):
            return None
        i = int(index[0])
        view = self._cache.get(i)
        if view is None:
            view = self._cache[i] = byte_view(region)
        pages = view[: (region.length // length) * length].reshape(-1, length)
        ids = (offsets // np.uint64(length)).astype(np.int64)
        if not isinstance(pages, np.ndarray):
            import torch

            return pages, torch.from_numpy(ids).to(pages.device)
        return pages, ids

    def gather(self, start: int, end: int) -> Any:
        """(In a worker thread) rows ``start:end`` packed into a new staging buffer, ready for UCX to read: CUDA
        copies are waited for here, since UCX does not order itself after the stream."""
        buffer = self._gather(start, end)
        finish_stream(buffer)
        return buffer

    def scatter(self, buffer: Any, start: int, end: int) -> None:
        """(In a worker thread) a received staging buffer written into rows ``start:end``; returns once CUDA is
        done with it, so the buffer can be freed and its memory handed to the next receive."""
        self._scatter(buffer, start, end)
        finish_stream(buffer)

    def _gather(self, start: int, end: int) -> Any:
        buffer = self.staging(start, end)
        paged = self._pages(start, end)
        if paged is not None:
            pages, ids = paged
            if isinstance(pages, np.ndarray):
                np.take(pages, ids, axis=0, out=buffer.reshape(len(ids), -1))
            else:
                buffer.view(len(ids), -1).copy_(pages.index_select(0, ids))
            return buffer
        position = 0
        for row in range(start, end):
            piece = self.row(row)
            n = len(piece)
            copy(buffer[position : position + n], piece)
            position += n
        return buffer

    def _scatter(self, buffer: Any, start: int, end: int) -> None:
        paged = self._pages(start, end)
        if paged is not None:
            pages, ids = paged
            if isinstance(pages, np.ndarray):
                pages[ids] = buffer.reshape(len(ids), -1)
            else:
                pages.index_copy_(0, ids, buffer.view(len(ids), -1))
            return
        position = 0
        for row in range(start, end):
            piece = self.row(row)
            n = len(piece)
            copy(piece, buffer[position : position + n])
            position += n


def finish_stream(buffer: Any) -> None:
    """Wait until the current CUDA stream has run what this thread queued on it (nothing for host buffers)."""
    if not isinstance(buffer, np.ndarray) and buffer.is_cuda:
        import torch

        torch.cuda.current_stream(buffer.device).synchronize()


def copy(dst: Any, src: Any) -> None:
    if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
        dst[...] = src
        return
    import torch

    d = dst if isinstance(dst, torch.Tensor) else torch.from_numpy(dst)
    s = src if isinstance(src, torch.Tensor) else torch.from_numpy(src)
    d.copy_(s)


async def windowed(
    count: int,
    window: int,
    start: Callable[[int], Awaitable[tuple[Coroutine[Any, Any, Any], Any]]],
    done: Callable[[int, Any], Awaitable[None]],
    packed: Callable[[int], bool] = lambda k: False,
    packed_window: int = 0,
) -> None:
    """Run ``start(k)`` for k in 0..count, at most ``window`` at once and at most ``packed_window`` of those for
    which ``packed(k)`` (0: no separate bound), calling ``done(k, context)`` in order.

    The futures are asyncio's (ucxx is asyncio only). Whatever is still pending when this ends early is cancelled.
    """
    pending: deque[tuple[int, asyncio.Future[Any], Any]] = deque()
    in_flight_packed = 0

    async def finish_oldest() -> None:
        nonlocal in_flight_packed
        j, future, ctx = pending.popleft()
        in_flight_packed -= packed(j)
        await future
        await done(j, ctx)

    try:
        for k in range(count):
            if packed_window and packed(k):
                while in_flight_packed >= packed_window:
                    await finish_oldest()
                in_flight_packed += 1
            coroutine, context = await start(k)
            pending.append((k, asyncio.ensure_future(coroutine), context))
            while len(pending) >= window:
                await finish_oldest()
        while pending:
            await finish_oldest()
    finally:
        for _, future, _ in pending:
            future.cancel()
        for _, future, _ in pending:
            # the future's own cancellation (or failure) is expected here; ours cannot happen (shielded)
            with anyio.CancelScope(shield=True), anyio.move_on_after(1.0), suppress(BaseException):
                await future
