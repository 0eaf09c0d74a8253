"""The transport interface: an abstract async resource that moves bytes between processes.

A :class:`Transport` listens at an :attr:`~Transport.address`, connects to peers (:meth:`~Transport.connect`,
:meth:`~Transport.accept`), registers memory (:meth:`~Transport.register`), carries small control messages
(:meth:`~Transport.send_message` / :meth:`~Transport.receive_message`) and writes fragments of registered memory
into a peer's registered memory (:meth:`~Transport.write`), delivering a notification to the peer only after
the data has landed (:meth:`~Transport.receive_notification`).

Grants, not regions: a peer may write only into memory we *granted* to it (:meth:`~Transport.grant`, ended by
:meth:`Grant.revoke`), never into everything we registered. Deny by default: a peer holding no grant writes
nothing. The receiver announces each grant on the control channel, which is ordered, so a grant made before a
message is known to the writer before the message is. Where the check runs, per path, and what a path cannot
check: :meth:`~Transport.grant`.

Fragments are numpy arrays of shape ``(n, 2)``, one row ``(address, length)`` per contiguous range, never
Python lists of tuples. Row ``i`` of the source goes to row ``i`` of the destination, so both arrays have the
same lengths row by row. :func:`as_fragments`, :func:`coalesce`, :func:`tensor_fragments` and
:func:`page_fragments` build and normalise them.

Backend specifics are typed attributes (anyio's mechanism): ``transport.extra(TransportAttribute.nixl_agent_name)``.
"""

from __future__ import annotations

import enum
from abc import ABCMeta, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import anyio
import numpy as np
import numpy.typing as npt
from anyio import TypedAttributeProvider, TypedAttributeSet, typed_attribute
from attrs import frozen

from kvferry.errors import KvferryError

if TYPE_CHECKING:
    from typing import Self

    import torch

    from kvferry.transports.indexed import IndexedWrite

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MERGE_SHARE",
    "Capabilities",
    "Fragments",
    "Grant",
    "Peer",
    "PeerAttribute",
    "PeerState",
    "Registration",
    "Transport",
    "TransportAttribute",
    "TransportStatistics",
    "as_fragments",
    "coalesce",
    "joined_rows",
    "outcomes_of",
    "page_fragments",
    "tensor_fragments",
    "total_bytes",
    "write_rows",
]

#: ``(n, 2)`` uint64 array of ``(address, length)`` rows.
Fragments = npt.NDArray[np.uint64]

#: Default limit of one control message, in bytes (either side may lower it).
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20


# --- fragments -----------------------------------------------------------------------------------------


def as_fragments(fragments: npt.ArrayLike) -> Fragments:
    """Return ``fragments`` as a C-contiguous ``(n, 2)`` uint64 array of ``(address, length)`` rows.

    Accepts int64 or uint64 arrays (and anything numpy turns into one). No row may have length 0 or a negative
    value, and no range may wrap around the address space.

    :raises ValueError: if the shape or values are not fragments.
    """
    out = _rows(fragments)
    if out.size:
        flat = out.reshape(-1)
        lengths = flat[1::2]
        if not bool(lengths.all()):
            raise ValueError("fragments hold a zero-length range")
        if bool((flat[0::2] > ~lengths).any()):  # address + length > 2**64 - 1
            raise ValueError("a fragment wraps around the address space")
    return out


def total_bytes(fragments: Fragments) -> int:
    """The number of bytes the fragments cover (sum of lengths)."""
    return int(fragments[:, 1].sum(dtype=np.uint64)) if len(fragments) else 0


def coalesce(src: Fragments, dst: Fragments) -> tuple[Fragments, Fragments]:
    """Merge consecutive rows that are contiguous on both sides.

    Row ``i+1`` merges into row ``i`` when ``src[i].end == src[i+1].address`` and the same holds for ``dst``.
    Order is kept; rows are never reordered (a reordering could merge more, but changes nothing the caller can
    observe only when the ranges do not overlap, which we do not assume).

    :raises ValueError: if ``src`` and ``dst`` do not pair row by row.
    """
    check_pairing(src, dst)
    merged = _merge(np.ascontiguousarray(src), np.ascontiguousarray(dst))
    return (src, dst) if merged is None else merged


def _merge(
    src: Fragments, dst: Fragments, delta: npt.NDArray[np.uint64] | None = None, least: int = 1
) -> tuple[Fragments, Fragments] | None:
    """The merged rows of paired, C-contiguous fragments, or None when fewer than ``least`` rows merge into the
    row before. ``delta``: the destination minus the source addresses (mod 2**64), when the caller has it."""
    n = len(src)
    if n <= 1:
        return None
    s_addr, lengths, d_addr = src[:, 0], src[:, 1], dst[:, 0]
    # contiguous at the destination too iff the offset between the two sides stays the same: where it never
    # does (scattered destinations, or rows a planner merged already), nothing merges
    if delta is None:
        delta = d_addr - s_addr
    joins = delta[:-1] == delta[1:]
    if not joins.any():
        return None
    s_end = s_addr + lengths
    joins &= s_end[:-1] == s_addr[1:]
    if int(np.count_nonzero(joins)) < least:
        return None
    breaks = np.flatnonzero(~joins)
    starts = np.empty(len(breaks) + 1, dtype=np.int64)
    starts[0], starts[1:] = 0, breaks + 1
    lasts = np.empty_like(starts)
    lasts[:-1], lasts[-1] = breaks, n - 1
    # a merged run is contiguous: its length is its last end minus its first address
    merged = s_end[lasts] - s_addr[starts]
    new_src = np.empty((len(starts), 2), dtype=np.uint64)
    new_src[:, 0], new_src[:, 1] = s_addr[starts], merged
    new_dst = np.empty((len(starts), 2), dtype=np.uint64)
    new_dst[:, 0], new_dst[:, 1] = d_addr[starts], merged
    return new_src, new_dst


class WriteRows(NamedTuple):
    """The rows of one write, checked as fragments and paired (:func:`write_rows`).

    Where rows merged, the wrap-around check ran on the merged rows only: whoever writes ``src``/``dst`` as
    given instead checks them with :func:`as_fragments` first.
    """

    src: Fragments
    dst: Fragments
    #: the rows merged where contiguous on both sides (None: too few merge, or merging was not asked for)
    merged_src: Fragments | None
    merged_dst: Fragments | None
    #: where the rows lie, worked out on the way: (the lowest source address, a bound on the highest source
    #: end, the same for the destination), each bound the highest address plus the longest length; the same
    #: for the rows as given and merged (the same bytes); None where not worked out (few rows, or lengths so
    #: long that they were checked row by row)
    bounds: tuple[int, int, int, int] | None = None


#: below this many rows a write's rows are checked row by row (:func:`as_fragments`): as fast, and simpler
_FEW_ROWS = 64
#: a write's rows are merged when at least one in this many joins the row before: fewer save less per-row
#: work anywhere (a kernel's program, a NIXL descriptor, an iovec) than the merge itself costs
MERGE_SHARE = 8
_MAX_ADDRESS = (1 << 64) - 1


def write_rows(src: npt.ArrayLike, dst: npt.ArrayLike, *, merge: bool = True) -> WriteRows:
    """:func:`as_fragments` on both sides, :func:`check_pairing`, and (if ``merge``) :func:`coalesce` where at
    least one row in :data:`MERGE_SHARE` merges, in few passes over the rows: what every write does first.

    Where rows merge, the wrap-around check runs on the merged rows (a row that wraps makes the run holding it
    wrap; lengths are checked positive and their sum small row by row), which saves passes over many rows.

    :raises ValueError: as those three functions do; nothing is returned then.
    """
    s, d = _rows(src), _rows(dst)
    least = max(1, len(s) // MERGE_SHARE)
    if len(s) < _FEW_ROWS or not merge:
        s, d = as_fragments(s), as_fragments(d)
        check_pairing(s, d)
        merged = _merge(s, d, least=least) if merge else None
        return WriteRows(s, d, *(merged or (None, None)))
    if s.shape != d.shape:
        raise ValueError(f"source and destination fragments differ in shape: {s.shape} != {d.shape}")
    lengths = s[:, 1]
    # one pass gives both the pairing (lengths agree) and the offsets that decide merging at the destination
    difference = d - s
    if bool(difference[:, 1].any()):
        raise ValueError("source and destination fragments differ in length row by row")
    if int(lengths.min()) == 0:
        raise ValueError("fragments hold a zero-length range")
    longest = int(lengths.max())
    if longest >= (1 << 63) // len(s):
        # the merged lengths could overflow: check row by row
        return WriteRows(as_fragments(s), as_fragments(d), *(_merge(s, d, least=least) or (None, None)))
    merged = _merge(s, d, difference[:, 0], least)
    ms, md = (s, d) if merged is None else merged
    if merged is not None:
        longest = int(ms[:, 1].max())
    src_high, dst_high = int(ms[:, 0].max()), int(md[:, 0].max())
    # no row wraps when the highest address plus the longest length does not (else look row by row)
    if max(src_high, dst_high) > _MAX_ADDRESS - longest and (
        bool((ms[:, 0] > ~ms[:, 1]).any()) or bool((md[:, 0] > ~md[:, 1]).any())
    ):
        raise ValueError("a fragment wraps around the address space")
    # what the registered ranges are checked against first (one range holding every row needs no search): the
    # lowest address and the highest address plus the longest length, on the merged rows where rows merged
    # (the same bytes as the rows as given, so the bounds hold for both; a write of random pages merges a
    # pair or two among a thousand rows, which are as many rows to search)
    bounds = (int(ms[:, 0].min()), src_high + longest, int(md[:, 0].min()), dst_high + longest)
    merged_src, merged_dst = merged if merged is not None else (None, None)
    return WriteRows(s, d, merged_src, merged_dst, bounds)


def joined_rows(
    writes: Sequence[tuple[npt.ArrayLike, npt.ArrayLike, Any]], *, merge: bool = True
) -> tuple[WriteRows, list[int]]:
    """:func:`write_rows` of several writes' ``(src, dst, ...)`` rows as one write (in order; rows of two writes
    may merge), and the bytes of each write.

    :raises ValueError: as :func:`write_rows` for any of them (which one is not said: check each on its own).
    """
    src = [_rows(s) for s, _, _ in writes]
    dst = [_rows(d) for _, d, _ in writes]
    sizes = [int(s[:, 1].sum()) for s in src]
    return write_rows(np.concatenate(src), np.concatenate(dst), merge=merge), sizes


def _rows(fragments: npt.ArrayLike) -> Fragments:
    """``fragments`` as a C-contiguous ``(n, 2)`` uint64 array, refusing shapes, dtypes and negative values that
    are not fragments (the values of the rows are checked by the caller)."""
    array = np.asarray(fragments)
    if array.ndim != 2 or array.shape[1] != 2:
        raise ValueError(f"fragments must have shape (n, 2), got {array.shape}")
    if array.dtype == np.uint64 and array.flags.c_contiguous:
        return array
    if array.dtype.kind == "i":
        if array.size and int(array.min()) < 0:
            raise ValueError("fragments hold a negative address or length")
    elif array.dtype.kind != "u":
        raise ValueError(f"fragments must be an integer array, got {array.dtype}")
    return np.ascontiguousarray(array, dtype=np.uint64)


def check_pairing(src: Fragments, dst: Fragments) -> None:
    """:raises ValueError: unless ``src`` and ``dst`` have the same number of rows and equal lengths per row."""
    if src.shape != dst.shape:
        raise ValueError(f"source and destination fragments differ in shape: {src.shape} != {dst.shape}")
    if len(src) and not np.array_equal(src[:, 1], dst[:, 1]):
        raise ValueError("source and destination fragments differ in length row by row")


def tensor_fragments(tensor: torch.Tensor) -> Fragments:
    """One fragment covering a contiguous tensor's bytes."""
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous")
    nbytes = tensor.numel() * tensor.element_size()
    return as_fragments(np.array([[tensor.data_ptr(), nbytes]], dtype=np.uint64))


def page_fragments(base: int, page_bytes: int, page_ids: npt.ArrayLike, *, offset: int = 0) -> Fragments:
    """Fragments of pages ``base + page_ids[i] * page_bytes + offset``, each ``page_bytes`` long."""
    ids = np.asarray(page_ids, dtype=np.uint64).reshape(-1)
    addresses = np.uint64(base + offset) + ids * np.uint64(page_bytes)
    return as_fragments(np.stack([addresses, np.full_like(addresses, page_bytes)], axis=1))


# --- descriptions ------------------------------------------------------------------------------------------


@frozen
class Capabilities:
    """What a transport can do; callers choose paths by these, never by class."""

    #: the writer moves bytes without the receiver's CPU taking part (RDMA WRITE, CMA, cuda_ipc)
    one_sided_write: bool
    #: CUDA tensors can be registered and written
    device_memory: bool
    #: peers may live in other processes
    cross_process: bool
    #: peers may live on other hosts
    cross_host: bool


class TransportAttribute(TypedAttributeSet):
    """Transport-specific facts, read with ``transport.extra(TransportAttribute.X)``."""

    #: the name it was loaded by: ``"nixl"``, ``"ucx"`` or ``"local"``
    name: str = typed_attribute()
    #: the address peers connect to
    address: str = typed_attribute()
    #: this transport's unique id (also its NIXL agent name)
    instance_id: str = typed_attribute()
    #: the NIXL agent name (nixl only)
    nixl_agent_name: str = typed_attribute()
    #: UCX error handling mode of the NIXL UCX backend (nixl only)
    nixl_error_handling: str = typed_attribute()
    #: CUDA regions of peers on this host are written by CUDA IPC and device copies, not NIXL (nixl only)
    nixl_cuda_ipc: bool = typed_attribute()
    #: the UCX worker address bytes peers create endpoints from (ucx only)
    ucx_worker_address: bytes = typed_attribute()


class PeerAttribute(TypedAttributeSet):
    """Facts about a connected peer, read with ``peer.extra(PeerAttribute.X)``."""

    #: the peer's transport address
    address: str = typed_attribute()
    #: the peer's unique id
    instance_id: str = typed_attribute()
    #: the peer runs in this process: writes are plain copies, never routed through a library
    same_process: bool = typed_attribute()
    #: the peer's process id (as it reported it)
    pid: int = typed_attribute()


class PeerState(enum.Enum):
    """Where a peer handle stands."""

    CONNECTED = "connected"
    #: the peer went away (or sent something malformed); every call raises the recorded error
    LOST = "lost"
    #: closed by us (``peer.aclose()`` or the transport's aclose)
    CLOSED = "closed"


class Peer(TypedAttributeProvider, metaclass=ABCMeta):
    """A handle to a connected peer, returned by :meth:`Transport.connect` and :meth:`Transport.accept`.

    Pass it to the transport's methods. ``await peer.aclose()`` disconnects it (idempotent).
    """

    __slots__ = ()

    @property
    @abstractmethod
    def state(self) -> PeerState:
        """CONNECTED, LOST or CLOSED."""

    @abstractmethod
    async def aclose(self) -> None:
        """Disconnect from the peer; idempotent. Waits in the peer's own receive calls end with
        :class:`~kvferry.errors.ClosedResourceError`. A cancel leaves the peer closed all the same."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class Registration(metaclass=ABCMeta):
    """Memory registered with a transport; returned by :meth:`Transport.register`.

    It keeps the tensors alive until :meth:`Transport.deregister` (or the transport's aclose).
    """

    __slots__ = ()

    @property
    @abstractmethod
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The registered tensors, in the order given."""

    @property
    @abstractmethod
    def active(self) -> bool:
        """False once deregistered."""

    def fragments(self) -> Fragments:
        """One ``(address, length)`` row per registered tensor."""
        rows = [(t.data_ptr(), t.numel() * t.element_size()) for t in self.tensors]
        return as_fragments(np.array(rows, dtype=np.uint64).reshape(-1, 2))


class Grant(metaclass=ABCMeta):
    """Memory of ours that one peer may write into; returned by :meth:`Transport.grant`.

    Ends with :meth:`revoke` (or :meth:`revoke_nowait`; both idempotent), with the peer's connection, or when
    memory it covers is deregistered. ``async with grant:`` revokes on exit.
    """

    __slots__ = ()

    @property
    @abstractmethod
    def peer(self) -> Peer:
        """The peer that may write."""

    @property
    @abstractmethod
    def fragments(self) -> Fragments:
        """The granted ``(address, length)`` rows, as given."""

    @property
    @abstractmethod
    def active(self) -> bool:
        """False once revoked (or its peer is gone)."""

    @abstractmethod
    async def revoke(self) -> None:
        """End the grant; idempotent, shielded from cancellation. Writes of the peer that our side checks from
        now on are refused (:class:`~kvferry.errors.NotGranted`); returns once the peer has been told (the
        control channel is ordered: what we send after this arrives after the revoke). What happens to a write
        in flight depends on the path (:meth:`Transport.grant`)."""

    @abstractmethod
    def revoke_nowait(self) -> None:
        """:meth:`revoke` without waiting for the channel: our side refuses at once; the revoke goes out ahead
        of anything we send the peer after this call (still ordered: a message sent next arrives after it), or
        by a background task right after when nothing else is sent (the peer's own check may pass a write until
        it arrives)."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.revoke()


class TransportStatistics(NamedTuple):
    """A snapshot of a transport's state (``transport.statistics()``)."""

    #: peers connected now
    peers: int
    #: registrations held now
    registrations: int
    #: bytes registered now
    registered_bytes: int
    #: writes started and not yet finished (ours)
    writes_in_flight: int
    #: writes into our memory being received now (two-sided transports)
    incoming_writes: int
    #: writes completed since start
    writes_completed: int
    #: writes that failed since start
    writes_failed: int
    #: bytes written by completed writes since start
    bytes_written: int
    #: control messages sent / received since start
    messages_sent: int
    messages_received: int
    #: incoming connections refused since start (failed authentication, wrong wire version or compatibility
    #: hash, a bad handshake, too many handshakes at once)
    refused_connections: int
    #: library handles held now (NIXL xfer/dlist handles, UCX endpoints); 0 after aclose
    backend_handles: int
    #: completed writes that moved as one copy with others of a :meth:`Transport.write_many` since start
    writes_combined: int = 0
    #: completed indexed writes whose addresses the device worked out (:meth:`Transport.write_indexed`)
    writes_indexed: int = 0
    #: peers dropped for what they sent or for a failure while serving them (malformed frames) since start
    dropped_peers: int = 0
    #: accepts that failed (out of descriptors) since start; the listener goes on
    accept_errors: int = 0
    #: handshakes in progress now
    pending_handshakes: int = 0
    #: bytes of peers' messages and notifications held for the application now
    buffered_bytes: int = 0
    #: writes of ours refused since start because a destination lies outside what the peer granted us
    #: (:class:`~kvferry.errors.NotGranted`; refused by our own check, or by a two-sided receiver)
    writes_refused: int = 0
    #: writes of peers into our memory refused since start for the same reason (two-sided transports)
    incoming_refused: int = 0
    #: grants of ours live now, to every peer (:meth:`Transport.grant`)
    grants: int = 0


async def outcomes_of(calls: Sequence[Callable[[], Awaitable[object]]]) -> list[Exception | None]:
    """Run ``calls`` concurrently; per call, in order, None (it returned) or the exception it raised. A cancel
    cancels every call still running."""
    outcomes: list[Exception | None] = [None] * len(calls)

    async def one(i: int) -> None:
        try:
            await calls[i]()
        except Exception as exc:  # reported to the caller, per call
            outcomes[i] = exc

    async with anyio.create_task_group() as tg:
        for i in range(len(calls)):
            tg.start_soon(one, i)
    return outcomes


class Transport(TypedAttributeProvider, metaclass=ABCMeta):
    """An abstract async resource that moves bytes between registered memory of peers.

    Use it as an async context manager (``async with get_transport("nixl")() as t:``), or call :meth:`start`
    and :meth:`aclose` from the same task. Background work (the listener, one reader per peer, NIXL polling)
    runs in a task group owned by the transport and ends with :meth:`aclose`.

    Every wait on the network is bounded: a peer that dies is noticed through its control connection and
    every call involving it raises :class:`~kvferry.errors.PeerDisconnected`; writes also have a stall
    deadline (:class:`~kvferry.errors.TransferTimeout`).
    """

    __slots__ = ()

    #: the name it is loaded by
    name: ClassVar[str]
    #: what it can do
    capabilities: ClassVar[Capabilities]

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    @abstractmethod
    async def start(self) -> None:
        """Open the library, start listening and the background tasks.

        A cancel leaves nothing running: what was opened is closed again.

        :raises ~kvferry.errors.TransportError: if the library or the listener cannot start.
        """

    @abstractmethod
    async def aclose(self) -> None:
        """Disconnect every peer, deregister every region, release every library handle, stop every task.

        Idempotent; runs shielded from cancellation, so a cancel cannot leave handles behind.
        """

    @property
    @abstractmethod
    def address(self) -> str:
        """The address peers pass to :meth:`connect` (``"<name>://host:port"``).

        :raises ~kvferry.errors.ClosedResourceError: before :meth:`start` or after :meth:`aclose`.
        """

    @abstractmethod
    async def connect(self, address: str, *, timeout: float | None = None) -> Peer:  # noqa: ASYNC109
        """Connect to the transport listening at ``address`` and shake hands.

        The handshake compares wire version and compatibility hash before anything else is decoded. A connect
        always has a deadline of its own (``timeout``, else the transport's ``connect_timeout``), even when the
        caller sets none.
        A cancel leaves no connection behind.

        :raises ~kvferry.errors.PeerDisconnected: if nobody answers at ``address`` within the timeout.
        :raises ~kvferry.errors.PeerIncompatible: if the peer speaks another wire version, has another
            compatibility hash or is another kind of transport.
        """

    @abstractmethod
    async def accept(self) -> Peer:
        """Wait for the next peer that connected to us and return its handle.

        A cancel loses nothing: the next call returns the same peer.
        """

    @abstractmethod
    async def register(self, regions: torch.Tensor | Sequence[torch.Tensor]) -> Registration:
        """Register contiguous CPU or CUDA tensors so that they can be written from and into.

        Peers learn about the new regions before any message we send after this call returns (the control
        channel is ordered). A peer writes into them only where we :meth:`grant` it: register, grant, then
        tell the peer where to write.

        :raises ValueError: if a tensor is not contiguous or lives on a device this transport cannot use.
        :raises ~kvferry.errors.TransportError: if the library refuses the registration.
        """

    @abstractmethod
    async def deregister(self, registration: Registration) -> None:
        """Deregister; idempotent. Peers stop accepting writes into it, and our grants that covered any of it
        are revoked. Shielded from cancellation."""

    @abstractmethod
    async def grant(
        self, peer: Peer, fragments: npt.ArrayLike | Registration, *, defer: bool = False
    ) -> Grant:
        """Let ``peer`` write into ``fragments`` of our registered memory (``(n, 2)`` ``(address, length)`` rows,
        as :meth:`write` takes them, or a :class:`Registration` of ours, granted whole) until the returned
        :class:`Grant` is revoked. Without a grant a peer writes nothing into our memory (deny by default).

        The peer learns of the grant before any message we send after this returns (the control channel is
        ordered): grant first, then tell the peer where to write. Grants may overlap and touch; a write is
        allowed when each of its destination rows lies inside the union of the peer's live grants.

        ``defer``: do not wait for the channel; the grant goes out ahead of the next message (or anything else)
        we send the peer, in the same send, or by a background task right after when nothing else is sent:
        for a caller that tells the peer where to write next, one send instead of two. Everything we send after
        this returns still arrives after the grant; only what reaches the peer some other way may come first.
        A deferred grant revoked before it went out is never sent (nor its revoke), and a peer lost meanwhile
        shows at the next send instead of here.

        Where it is checked, per path (a write outside is refused with
        :class:`~kvferry.errors.NotGranted`, nothing of it written, and counted in
        :attr:`TransportStatistics.writes_refused` of the writer or :attr:`~TransportStatistics.incoming_refused`
        of the receiver):

        - every transport, in the writer, before any byte moves: our own ``write``, ``write_many`` and
          ``write_indexed`` check every destination row against the grants the peer sent us. This is all
          there is for the writer-driven paths (``local`` copies, ``nixl``'s NIXL WRITE, its
          ``process_vm_writev`` and CUDA IPC copies): there the receiver's CPU takes no part, so only a writer
          running our code is held to its grants. Whoever holds our NIXL metadata can write into any memory we
          registered through NIXL, a process of this host allowed to ``ptrace`` us can write anywhere, and a
          process holding a CUDA IPC handle we exported can write the whole exported region; so that metadata
          and those handles may go only to authenticated peers (the handshake's job, not the grant's).
        - ``ucx`` (two-sided): also in the receiver, which moves the bytes itself: every destination row of a
          write request must lie inside a live grant of *that* peer, else it answers REGION and writes nothing,
          whatever the writer checked.

        Revoking while a write is in flight: a write whose check comes after the revoke is refused. One already
        checked: ``local``, ``nixl`` finish it (the writer checked it; the bytes may land after
        :meth:`Grant.revoke` returned); ``ucx`` stops it in the receiver, which posts no more receives and
        pulls no more slices for it and answers REGION (the writer gets :class:`~kvferry.errors.NotGranted`), but
        the receives it had posted (up to its ``window`` of messages) and the slice it was pulling may still
        land. So revoke only when no write into the memory is expected any more, as a receiver does once every
        writer reported.

        A cancel leaves nothing granted.

        :raises ~kvferry.errors.RegionError: if a range is not inside our registered memory.
        :raises ~kvferry.errors.PeerDisconnected: if the peer is gone.
        :raises ~kvferry.errors.TransportError: if the peer would hold more than
            :data:`~kvferry.transports.messages.MAX_LIVE_GRANTS` grants from us.
        :raises ValueError: if the fragment array is malformed.
        """

    @abstractmethod
    async def send_message(self, peer: Peer, data: bytes) -> None:
        """Send one control message (bytes) to ``peer``.

        A cancel may leave the message sent or not; the channel stays usable only if it was not cut midway
        (a cut channel is closed and the peer is LOST).

        :raises ~kvferry.errors.MessageTooLarge: if ``data`` exceeds the peer's limit (nothing is sent).
        :raises ~kvferry.errors.PeerDisconnected: if the peer is gone.
        """

    @abstractmethod
    async def receive_message(self, peer: Peer) -> bytes:
        """Receive the next control message from ``peer``. A cancel loses no message.

        :raises ~kvferry.errors.MessageTooLarge: if the next message exceeded our limit; it was discarded
            without being read into memory, and the next call returns the message after it.
        :raises ~kvferry.errors.PeerDisconnected: once the peer is gone and its messages are drained.
        """

    @abstractmethod
    async def write(
        self,
        peer: Peer,
        src: npt.ArrayLike,
        dst: npt.ArrayLike,
        notify: bytes | None = None,
        *,
        stall_timeout: float | None = None,
    ) -> None:
        """Write registered memory (``src`` fragments, ours) into the peer's registered memory (``dst``).

        Returns when the bytes have landed in the peer's memory. ``notify`` (if not None) is delivered to the
        peer's :meth:`receive_notification` only after all of the data has landed.

        A cancel may leave some, all or none of the bytes written and the notification undelivered; nothing
        is written after the cancel returns except what the library had already posted.

        :raises ~kvferry.errors.RegionError: if a source range is not inside our registered memory or a
            destination range is not inside memory the peer registered; nothing was written.
        :raises ~kvferry.errors.NotGranted: (a RegionError) if a destination range is not inside what the peer
            granted us (:meth:`grant`); nothing was written.
        :raises ~kvferry.errors.PeerDisconnected: if the peer is gone or dies during the write.
        :raises ~kvferry.errors.TransferTimeout: if the write makes no progress within ``stall_timeout``.
        :raises ValueError: if the fragment arrays are malformed or do not pair.
        """

    async def write_many(
        self,
        peer: Peer,
        writes: Sequence[tuple[npt.ArrayLike, npt.ArrayLike, bytes | None]],
        *,
        stall_timeout: float | None = None,
    ) -> list[Exception | None]:
        """Several writes ``(src, dst, notify)`` to ``peer``, each as :meth:`write`; the transport may move
        their bytes together (one device launch and one wait where it copies on a GPU itself). Each
        notification is delivered only after every byte of its own write landed (here: after the bytes of all
        the writes it moved together).

        Returns, in order, None for each write that landed (its notification sent) or the error that write
        ended with (those of :meth:`write`). A write refused before anything of it was written
        (:class:`~kvferry.errors.RegionError`, ``ValueError``) costs the others nothing.

        A cancel leaves every write as :meth:`write` says: some, all or none of the bytes written and
        notifications undelivered; nothing is written after the cancel returns except what was posted.
        This default runs the writes concurrently, each on its own.
        """
        return await outcomes_of(
            [
                partial(self.write, peer, src, dst, notify, stall_timeout=stall_timeout)
                for src, dst, notify in writes
            ]
        )

    async def write_indexed(
        self,
        peer: Peer,
        writes: Sequence[IndexedWrite],
        *,
        stall_timeout: float | None = None,
    ) -> list[Exception | None]:
        """Writes whose rows come from a template and ids (:class:`~kvferry.transports.indexed.IndexedWrite`),
        each as :meth:`write` of the rows its ids name, with its notification after its bytes landed; the
        transport may move them together (as :meth:`write_many`).

        A template is checked against the registered memory on both sides (every address any ids within its
        limits can reach) once, and every write's ids against the limits: a write with an id outside its limit,
        or whose template reaches outside registered memory, is refused with
        :class:`~kvferry.errors.RegionError` before anything of it is written, and costs the others nothing.

        Returns, in order, None for each write that landed or the error it ended with. A cancel leaves every
        write as :meth:`write` says. This default writes each template's rows as plain fragments
        (:meth:`~kvferry.transports.indexed.IndexedRows.expand`) through :meth:`write_many`.
        """
        outcomes: list[Exception | None] = [None] * len(writes)
        plain: list[tuple[npt.ArrayLike, npt.ArrayLike, bytes | None]] = []
        where: list[int] = []
        for i, w in enumerate(writes):
            try:
                src, dst = w.expand()
            except (KvferryError, ValueError) as exc:  # refused before anything is written
                outcomes[i] = exc
                continue
            plain.append((src, dst, w.notify))
            where.append(i)
        if plain:
            done = await self.write_many(peer, plain, stall_timeout=stall_timeout)
            for i, outcome in zip(where, done, strict=True):
                outcomes[i] = outcome
        return outcomes

    @abstractmethod
    async def receive_notification(self, peer: Peer) -> bytes:
        """Wait for the next write notification from ``peer``; its data has landed. A cancel loses nothing.

        :raises ~kvferry.errors.PeerDisconnected: once the peer is gone and its notifications are drained.
        """

    @abstractmethod
    def statistics(self) -> TransportStatistics:
        """A snapshot of the transport's state."""

    @property
    def extra_attributes(self) -> Mapping[Any, Any]:
        return {}
