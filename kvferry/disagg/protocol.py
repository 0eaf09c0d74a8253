"""What a context engine and a generation engine say to each other, on the transport's control channel.

Everything is a frozen attrs class serialised by the one converter of :mod:`kvferry.wire`. Two layers:

1. **Handshake.** Each side sends a :class:`Hello`: an envelope whose ``wire_version`` and ``compat_hash`` are
   decoded and compared *before* its body (a :class:`PeerInfo`: role, TP size, every rank's
   :class:`~kvferry.pools.pagetable.PageTable`, transport address) is decoded at all. A mismatch raises
   :class:`~kvferry.errors.PeerIncompatible` for that peer only (a peer of our wire version that serves another
   model has its body decoded after all, to name what differs). Then :func:`check_pairing` compares what may
   legitimately differ between peers and decides at run time whether they can pair: TP sizes (and the head
   shards each gives), block sizes, layouts, the drafter's presence.
2. **Control messages** (:class:`Control` = kind + body): the router's context request and the context
   side's answer, the generation side's :class:`ReceiveRequest`, every writer's per-chunk
   :class:`ChunkResult` (also carried as the transport's write notification, delivered only after the chunk's
   data landed), :class:`CancelTransfer`, the context side's :class:`CancelAck` to a cancel of a transfer
   it is not pushing, and either side's :class:`TablesUpdate` after a pool rebalance replaced its memory.

Every decode raises :class:`~kvferry.errors.WireFormatError` on anything malformed; a peer's bad bytes cost
that peer its session, nothing else.
"""

from __future__ import annotations

import enum
import logging
import math
from typing import Any

from attrs import frozen

from kvferry import wire
from kvferry.disagg.mapping.compat import check_shards, explain
from kvferry.errors import PeerIncompatible, WireFormatError
from kvferry.pools.layout import GroupKind
from kvferry.pools.pagetable import PageTable

__all__ = [
    "MAX_TOKENS",
    "BlockIds",
    "CancelAck",
    "CancelTransfer",
    "ChunkResult",
    "ChunkResults",
    "ChunkStatus",
    "ContextDone",
    "ContextRequest",
    "Control",
    "ControlKind",
    "Hello",
    "Pairing",
    "PeerInfo",
    "PeerRole",
    "ReceiveRequest",
    "ReleaseContext",
    "StagingArea",
    "TablesUpdate",
    "check_pairing",
    "check_update",
    "decode_control",
    "decode_hello",
    "encode_control",
    "encode_hello",
    "reports_of",
]

log = logging.getLogger("kvferry.disagg")

#: Upper bound of any token count or id list on the wire (a peer cannot make us allocate more).
MAX_TOKENS = 1 << 24
_MAX_TEXT = 4096
_MAX_BLOB = 64 << 20


def _fail(cls: type, message: str) -> WireFormatError:
    return WireFormatError(f"{cls.__name__}: {message}")


def _check_range(cls: type, name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise _fail(cls, f"{name} = {value} outside [{low}, {high}]")


# --- handshake ----------------------------------------------------------------------------------------------


class PeerRole(enum.StrEnum):
    CONTEXT = "context"
    GENERATION = "generation"


@frozen
class Hello:
    """The handshake envelope: ``wire_version`` and ``compat_hash`` are compared before ``body`` is decoded."""

    wire_version: int
    compat_hash: str
    body: bytes


@frozen
class PeerInfo:
    """Who an engine is: its role, its TP ranks' page tables (rank order) and where its transport listens."""

    role: PeerRole
    instance_id: str
    transport: str
    transport_address: str
    tp_size: int
    page_tables: tuple[PageTable, ...]

    def validate(self) -> None:
        cls = type(self)
        _check_range(cls, "tp_size", self.tp_size, 1, 1 << 16)
        if len(self.page_tables) != self.tp_size:
            raise _fail(cls, f"{len(self.page_tables)} page tables for tp_size {self.tp_size}")
        for rank, table in enumerate(self.page_tables):
            table.validate()  # nested tables are not validated by wire.decode
            if table.tp_size != self.tp_size or table.rank != rank:
                raise _fail(cls, f"page table {rank} says rank {table.rank} of {table.tp_size}")
        first = self.page_tables[0]
        for table in self.page_tables[1:]:
            if (table.compat_hash, table.wire_version) != (first.compat_hash, first.wire_version):
                raise _fail(cls, "ranks disagree on the model or wire version")
        if len(self.instance_id) > _MAX_TEXT or len(self.transport_address) > _MAX_TEXT:
            raise _fail(cls, "instance id or address too long")

    @property
    def compat_hash(self) -> str:
        return self.page_tables[0].compat_hash


def encode_hello(info: PeerInfo) -> bytes:
    """The handshake message of ``info`` (envelope first, body inside)."""
    table = info.page_tables[0]
    return wire.encode(Hello(table.wire_version, table.compat_hash, wire.encode(info)))


def decode_hello(
    data: bytes, *, wire_version: int, compat_hash: str, local: PeerInfo | None = None
) -> PeerInfo:
    """Decode a peer's handshake: the envelope, then the comparison, and only then the body.

    A peer of our wire version that serves another model has its body decoded all the same when ``local`` (our
    own info) is given, to name in the error what differs (:func:`~kvferry.disagg.mapping.compat.explain`: GQA
    or MLA attention, head counts a TP size cannot split, latent widths, layer kinds); a body that does not
    decode leaves the hash in the message.

    :raises ~kvferry.errors.PeerIncompatible: the peer speaks another wire version or serves another model.
    :raises ~kvferry.errors.WireFormatError: the bytes are malformed, or the body contradicts the envelope.
    """
    hello = wire.decode(data, Hello)
    if hello.wire_version != wire_version:
        raise PeerIncompatible(f"peer speaks wire version {hello.wire_version}, we speak {wire_version}")
    if hello.compat_hash != compat_hash:
        reason = None if local is None else _why_incompatible(local, hello.body)
        raise PeerIncompatible(
            f"peer serves another model (hash {hello.compat_hash}, ours {compat_hash})"
            + ("" if reason is None else f": {reason}")
        )
    info = wire.decode(hello.body, PeerInfo)
    if info.compat_hash != hello.compat_hash or info.page_tables[0].wire_version != hello.wire_version:
        raise WireFormatError("Hello: the page tables contradict the envelope")
    return info


def _why_incompatible(local: PeerInfo, body: bytes) -> str | None:
    """What differs between our model and the one a peer's hello body describes (None if it does not decode:
    the peer is refused for its hash all the same)."""
    try:
        remote = wire.decode(body, PeerInfo)
    except WireFormatError:
        return None
    return explain(local.page_tables[0], remote.page_tables[0])


@frozen
class Pairing:
    """What :func:`check_pairing` decided about two peers that may pair."""

    #: paged / state groups both sides hold and that are transferred
    groups: tuple[str, ...]
    #: the draft group is transferred (both sides have a drafter)
    draft: bool
    #: groups one side lacks, skipped (with one warning)
    skipped: tuple[str, ...]


def check_pairing(context: PeerInfo, generation: PeerInfo) -> Pairing:
    """Compare at run time what may differ between compatible peers, and decide what is transferred.

    Both must already have passed :func:`decode_hello` (same model hash). Block sizes must match per paged
    group; every head split must be one the model allows on both TP sizes (the page tables were built from
    the same spec, so they are; a table whose shards are not its TP size's split is refused,
    :func:`~kvferry.disagg.mapping.compat.check_shards`); a drafter on only one side skips the draft group with
    one warning.

    :raises ~kvferry.errors.PeerIncompatible: roles that do not pair, models that differ (the message says
        how), head shards no TP size gives, or block sizes that differ.
    """
    if context.role is not PeerRole.CONTEXT or generation.role is not PeerRole.GENERATION:
        raise PeerIncompatible(f"a {context.role} peer cannot send to a {generation.role} peer")
    reason = explain(
        context.page_tables[0],
        generation.page_tables[0],
        here="on the context side",
        there="on the generation side",
    )
    if reason is not None:
        raise PeerIncompatible(f"the peers serve different models: {reason}")
    if context.compat_hash != generation.compat_hash:
        raise PeerIncompatible("the peers serve different models")
    for side, info in (("on the context side", context), ("on the generation side", generation)):
        for table in info.page_tables:
            check_shards(table, side)
    src = {g.name: g for g in context.page_tables[0].layer_groups}
    dst = {g.name: g for g in generation.page_tables[0].layer_groups}
    groups: list[str] = []
    skipped: list[str] = []
    for name in sorted(set(src) | set(dst)):
        if name not in src or name not in dst:
            skipped.append(name)
            continue
        a, b = src[name], dst[name]
        if a.kind != b.kind or a.layer_ids != b.layer_ids or a.layer_kind != b.layer_kind:
            raise PeerIncompatible(f"group {name}: the peers hold different layers")
        if a.kind is GroupKind.PAGED and a.tokens_per_block != b.tokens_per_block:
            raise PeerIncompatible(
                f"group {name}: block size {a.tokens_per_block} on the context side, "
                f"{b.tokens_per_block} on the generation side"
            )
        if a.dtypes != b.dtypes:
            raise PeerIncompatible(f"group {name}: dtypes {a.dtypes} != {b.dtypes}")
        groups.append(name)
    if any(not name.startswith("draft") for name in skipped):
        raise PeerIncompatible(f"groups {skipped} exist on one side only")
    if skipped:
        log.warning("a peer has no drafter: draft KV (%s) is not transferred", ", ".join(skipped))
    return Pairing(tuple(groups), "draft" in groups, tuple(skipped))


# --- control messages ---------------------------------------------------------------------------------------


class ControlKind(enum.StrEnum):
    CONTEXT_REQUEST = "context_request"
    CONTEXT_DONE = "context_done"
    RELEASE_CONTEXT = "release_context"
    RECEIVE_REQUEST = "receive_request"
    CHUNK_RESULT = "chunk_result"
    CHUNK_RESULTS = "chunk_results"
    CANCEL_TRANSFER = "cancel_transfer"
    CANCEL_ACK = "cancel_ack"
    TABLES_UPDATE = "tables_update"


@frozen
class Control:
    """One control message: its kind, then its body (decoded as the kind's class)."""

    kind: ControlKind
    body: bytes


@frozen
class ContextRequest:
    """Router -> context engine: prefill ``prompt`` for request ``key`` and hold its cache for a hand-off."""

    key: str
    prompt: tuple[int, ...]
    max_tokens: int
    seed: int | None
    temperature: float
    spec_k: int
    stop_ids: tuple[int, ...] = ()

    def validate(self) -> None:
        cls = type(self)
        if not 0 < len(self.key) <= _MAX_TEXT:
            raise _fail(cls, "bad key")
        _check_range(cls, "prompt length", len(self.prompt), 1, MAX_TOKENS)
        _check_range(cls, "max_tokens", self.max_tokens, 1, MAX_TOKENS)
        _check_range(cls, "spec_k", self.spec_k, 0, 1 << 10)
        if any(t < 0 for t in self.prompt) or any(t < 0 for t in self.stop_ids):
            raise _fail(cls, "negative token id")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise _fail(cls, f"temperature {self.temperature}")


@frozen
class ContextDone:
    """Context engine -> router: the prompt is prefilled (``first_token`` sampled) and its cache is held.

    ``held`` is False when nothing is left to hand off (the first token ended the request, or it failed:
    ``error`` says why). ``host_state`` is the runner's opaque per-request state for the drafter.
    """

    key: str
    first_token: int
    held: bool
    num_tokens: int
    host_state: bytes = b""
    error: str = ""

    def validate(self) -> None:
        cls = type(self)
        _check_range(cls, "num_tokens", self.num_tokens, 0, MAX_TOKENS)
        if len(self.error) > _MAX_TEXT or len(self.host_state) > _MAX_BLOB:
            raise _fail(cls, "error or host state too long")


@frozen
class ReleaseContext:
    """Router -> context engine: drop the held cache of ``key`` (the hand-off will not happen)."""

    key: str


@frozen
class BlockIds:
    """The receiver's page ids of one paged group, in token order."""

    group: str
    block_ids: tuple[int, ...]


@frozen
class StagingArea:
    """Where writer ``writer`` may put a bounced transfer: ``nbytes`` at ``address`` of registered staging
    memory of the receiver (reserved for this session only; the receiver scatters it after the writer reported)."""

    writer: int
    address: int
    nbytes: int


@frozen
class ReceiveRequest:
    """Generation -> context: write request ``key``'s cache for tokens ``[token_start, token_end)`` here.

    ``blocks``: page ids per paged group (the same on every receiving rank), covering ``token_end`` tokens of
    that group's block size; ``slot``: the state slot of every state group (0 when the model has none).
    ``session_id`` is chosen by the receiver and names the transfer in every later message. ``staging``: the
    writers that may bounce (write their bytes packed into that area instead of into the pages); a writer
    without an area writes directly.
    """

    session_id: int
    key: str
    token_start: int
    token_end: int
    blocks: tuple[BlockIds, ...]
    slot: int
    staging: tuple[StagingArea, ...] = ()

    def validate(self) -> None:
        cls = type(self)
        _check_range(cls, "session_id", self.session_id, 0, wire.INT64_MAX)
        _check_range(cls, "token_end", self.token_end, 1, MAX_TOKENS)
        _check_range(cls, "token_start", self.token_start, 0, self.token_end - 1)
        _check_range(cls, "slot", self.slot, 0, MAX_TOKENS)
        names = [b.group for b in self.blocks]
        if len(set(names)) != len(names):
            raise _fail(cls, f"groups named twice: {names}")
        for b in self.blocks:
            _check_range(cls, f"{b.group} block count", len(b.block_ids), 1, MAX_TOKENS)
            if len(set(b.block_ids)) != len(b.block_ids) or min(b.block_ids) < 1:
                raise _fail(cls, f"group {b.group}: block ids repeat or use the reserved page 0")
        writers = [a.writer for a in self.staging]
        if len(set(writers)) != len(writers):
            raise _fail(cls, f"staging areas name a writer twice: {writers}")
        for a in self.staging:
            _check_range(cls, "staging writer", a.writer, 0, 1 << 16)
            _check_range(cls, "staging address", a.address, 1, wire.INT64_MAX)
            _check_range(cls, "staging nbytes", a.nbytes, 1, wire.INT64_MAX - a.address)

    def block_ids(self, group: str) -> tuple[int, ...] | None:
        for b in self.blocks:
            if b.group == group:
                return b.block_ids
        return None


class ChunkStatus(enum.StrEnum):
    #: the chunk's data landed (a notification: sent only after it did)
    OK = "ok"
    #: the write failed; what it may have written is unknown
    FAILED = "failed"
    #: never posted: the transfer was cancelled first, nothing of it was written
    CANCELLED = "cancelled"


@frozen
class ChunkResult:
    """One writer's report of one chunk of session ``session_id`` (every chunk gets exactly one).

    ``num_chunks`` is how many chunks this writer has for the session (the same in each of its reports), so
    the receiver knows when the writer is done. A writer with nothing to send reports one empty chunk.
    ``staged``: the chunk went into the writer's staging area (the receiver scatters it), not into the pages;
    its ``nbytes`` bytes fill the area from ``offset`` on (the receiver scatters each chunk as it lands).
    """

    session_id: int
    writer: int
    chunk: int
    num_chunks: int
    status: ChunkStatus
    nbytes: int = 0
    fragments: int = 0
    detail: str = ""
    staged: bool = False
    offset: int = 0

    def validate(self) -> None:
        cls = type(self)
        _check_range(cls, "session_id", self.session_id, 0, wire.INT64_MAX)
        _check_range(cls, "writer", self.writer, 0, 1 << 16)
        _check_range(cls, "num_chunks", self.num_chunks, 1, MAX_TOKENS)
        _check_range(cls, "chunk", self.chunk, 0, self.num_chunks - 1)
        _check_range(cls, "nbytes", self.nbytes, 0, wire.INT64_MAX)
        _check_range(cls, "fragments", self.fragments, 0, wire.INT64_MAX)
        _check_range(cls, "offset", self.offset, 0, wire.INT64_MAX)
        if len(self.detail) > _MAX_TEXT:
            raise _fail(cls, "detail too long")


#: most reports one :class:`ChunkResults` carries
MAX_BATCHED_REPORTS = 1 << 12


@frozen
class ChunkResults:
    """Several writers' reports of one session in one message: what a sender posts for the writers whose bytes
    moved together (one copy), once that copy has landed. Each report means what it means alone."""

    results: tuple[ChunkResult, ...]

    def validate(self) -> None:
        cls = type(self)
        _check_range(cls, "report count", len(self.results), 1, MAX_BATCHED_REPORTS)
        if len({r.session_id for r in self.results}) != 1:
            raise _fail(cls, "reports of several sessions")
        for result in self.results:
            result.validate()


@frozen
class CancelTransfer:
    """Generation -> context: post nothing more for ``session_id``; report every chunk not posted.

    The context side answers with :class:`CancelAck` when it is not pushing the session (its writers' reports
    are the answer when it is)."""

    session_id: int
    reason: str = ""


@frozen
class CancelAck:
    """Context -> generation, answering a :class:`CancelTransfer` of a session the context side is not pushing:
    no write of ``session_id`` can land any more. Either its push never started and never will (the receive
    request never arrived, or it arrived and the push is now called off), or the push finished (every write
    had returned, hence landed, before its reports were sent). The receiver may release the session's
    quarantined pages at once."""

    session_id: int
    reason: str = ""

    def validate(self) -> None:
        if len(self.reason) > _MAX_TEXT:
            raise _fail(type(self), "reason too long")


@frozen
class TablesUpdate:
    """Either side -> its peer: a pool rebalance replaced this engine's memory; ``info`` holds its new page
    tables (everything else in it is what the handshake said). ``epoch`` counts the sender's updates (1 for the
    first): an update of an epoch not above the last one applied is stale and ignored.

    The control channel is ordered: the update arrives before any message its sender sends after it (a receive
    request into the new pages, a push from them)."""

    epoch: int
    info: PeerInfo

    def validate(self) -> None:
        _check_range(type(self), "epoch", self.epoch, 1, 1 << 62)
        self.info.validate()  # nested objects are not validated by wire.decode


def check_update(current: PeerInfo, update: PeerInfo) -> None:
    """Refuse new page tables that change more than a rebalance can: the role, the instance, the transport and
    its address, the TP size, the model, a table's wire version or layer counts, or the layers each table holds
    (only the pools' sizes and addresses may change).

    :raises ~kvferry.errors.PeerIncompatible: the update changes any of those (the peer keeps its old tables).
    """
    fixed = ("role", "instance_id", "transport", "transport_address", "tp_size", "compat_hash")
    changed = [name for name in fixed if getattr(current, name) != getattr(update, name)]
    if not changed:  # the same TP size: as many tables
        per_table = ("wire_version", "model", "num_layers", "num_draft_layers", "layer_groups")
        for old, new in zip(current.page_tables, update.page_tables, strict=True):
            changed += [
                f"rank {old.rank}'s {name}" for name in per_table if getattr(old, name) != getattr(new, name)
            ]
    if changed:
        raise PeerIncompatible(f"a page-table update may not change {', '.join(changed)}")


_BODIES: dict[ControlKind, type[Any]] = {
    ControlKind.CONTEXT_REQUEST: ContextRequest,
    ControlKind.CONTEXT_DONE: ContextDone,
    ControlKind.RELEASE_CONTEXT: ReleaseContext,
    ControlKind.RECEIVE_REQUEST: ReceiveRequest,
    ControlKind.CHUNK_RESULT: ChunkResult,
    ControlKind.CHUNK_RESULTS: ChunkResults,
    ControlKind.CANCEL_TRANSFER: CancelTransfer,
    ControlKind.CANCEL_ACK: CancelAck,
    ControlKind.TABLES_UPDATE: TablesUpdate,
}
_KINDS = {cls: kind for kind, cls in _BODIES.items()}

ControlBody = (
    ContextRequest
    | ContextDone
    | ReleaseContext
    | ReceiveRequest
    | ChunkResult
    | ChunkResults
    | CancelTransfer
    | CancelAck
    | TablesUpdate
)


def reports_of(message: ControlBody) -> tuple[ChunkResult, ...]:
    """The writers' reports a control message carries (one, several, or none for other messages)."""
    if isinstance(message, ChunkResult):
        return (message,)
    if isinstance(message, ChunkResults):
        return message.results
    return ()


def encode_control(message: ControlBody) -> bytes:
    """One control message (kind + body) as bytes."""
    return wire.encode(Control(_KINDS[type(message)], wire.encode(message)))


def decode_control(data: bytes) -> ControlBody:
    """Decode a control message from a peer.

    :raises ~kvferry.errors.WireFormatError: on anything malformed, of an unknown kind, or inconsistent.
    """
    control = wire.decode(data, Control)
    body: ControlBody = wire.decode(control.body, _BODIES[control.kind])
    return body
