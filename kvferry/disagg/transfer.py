"""From a receive request to each writer's chunks: which bytes of the context ranks go where on the receiver.

:func:`plan_transfer` is the one entry point the roles use. It maps the request's pages and slot per group
from the context ranks' page tables onto the generation ranks' (the receiver's block ids and slot come from
its :class:`~.protocol.ReceiveRequest`, validated here against the receiver's page tables), and cuts every
writer's fragments into chunks.

The byte mapping is :class:`~.mapping.PeerMap` (any TP pair, elected writers for duplicated heads). Each
(context rank, generation rank) pair that overlaps is one *writer* of the session protocol: it reports every
chunk, an empty write included.

Bounce: the receiver offers staging areas (:func:`offer_staging`, from a bounded
:class:`~.staging.StagingPool`, for writers whose bytes look fragmented by a :class:`~.mapping.BouncePolicy`);
the writer bounces when its own plan is fragmented by the same policy, it was offered an area, and its own
staging pool has room. Anything short of that is a direct write, so a full pool costs speed, never a transfer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import attrs
import numpy as np
import torch

from kvferry.disagg.mapping import BouncePolicy, PeerMap, RequestCache, TokenRange
from kvferry.disagg.protocol import ReceiveRequest, StagingArea
from kvferry.disagg.session import Chunk, split_chunks
from kvferry.disagg.staging import ReceiveStaging, StagedWrite, StagingPool
from kvferry.errors import WireFormatError
from kvferry.pools.layout import GroupKind
from kvferry.pools.manager import CacheManager
from kvferry.pools.pagetable import PageTable
from kvferry.transports.base import Fragments
from kvferry.wire import PackedInts

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_DEVICE_CHUNK_BYTES",
    "ManagerHold",
    "WriterPlan",
    "check_request",
    "default_chunk_bytes",
    "destinations",
    "offer_staging",
    "plan_transfer",
    "prepare_source",
    "token_blocks",
]

#: A bounced writer's chunks are cut at this many bytes by default (the unit of packing, posting, reporting and
#: cancellation: packing the next chunk overlaps writing this one). A direct writer posts one write by default.
DEFAULT_CHUNK_BYTES = 16 << 20
#: ... and at this many when its bytes are in device memory: a device packs or unpacks a whole request in a
#: fraction of what each chunk costs the host (a launch, a thread hop and a device wait per side), so small
#: chunks there cost far more than they overlap (docs/performance.md has the measurements)
DEFAULT_DEVICE_CHUNK_BYTES = 1 << 30


def default_chunk_bytes(device_type: str) -> int:
    """The default chunk size of a bounced writer whose memory is on a device of ``device_type``."""
    return DEFAULT_CHUNK_BYTES if device_type == "cpu" else DEFAULT_DEVICE_CHUNK_BYTES


#: writer (context rank) -> its chunks, in posting order
WriterPlan = dict[int, list[Chunk]]


def token_blocks(token_start: int, token_end: int, tokens_per_block: int) -> range:
    """Indices (into a block table) of the blocks that hold tokens ``[token_start, token_end)``."""
    return range(token_start // tokens_per_block, math.ceil(token_end / tokens_per_block))


def check_request(request: ReceiveRequest, tables: Sequence[PageTable], groups: Sequence[str]) -> None:
    """Check a peer's receive request against its own page tables (``tables``: the receiver's).

    :raises ~kvferry.errors.WireFormatError: a missing or extra group, too few blocks for the token range,
        a block id or slot outside the receiver's pools.
    """
    table = tables[0]
    paged = {g.name for g in table.pool_groups if g.kind is GroupKind.PAGED and g.name in groups}
    state = [g for g in table.pool_groups if g.kind is GroupKind.STATE and g.name in groups]
    if {b.group for b in request.blocks} != paged:
        raise WireFormatError(
            f"receive request names groups {[b.group for b in request.blocks]}, expected {sorted(paged)}"
        )
    for b in request.blocks:
        group = table.pool_group(b.group)
        tpb = table.layer_group(b.group).tokens_per_block
        if len(b.block_ids) < math.ceil(request.token_end / tpb):
            raise WireFormatError(
                f"group {b.group}: {len(b.block_ids)} blocks for {request.token_end} tokens"
            )
        if max(b.block_ids) >= group.num_slots:
            raise WireFormatError(f"group {b.group}: block id {max(b.block_ids)} >= {group.num_slots}")
    for group in state:
        if not 0 < request.slot < group.num_slots:
            raise WireFormatError(f"state slot {request.slot} outside [1, {group.num_slots})")


def writer_id(src_rank: int, dst_rank: int, dst_tp: int) -> int:
    """The ``writer`` of a :class:`~.protocol.ChunkResult`: one per (context rank, generation rank) pair."""
    return src_rank * dst_tp + dst_rank


def expected_writers(peer_map: PeerMap) -> tuple[int, ...]:
    """Every (context rank, generation rank) pair that reports for every request, as writer ids."""
    return tuple(
        sorted(
            writer_id(s, d, peer_map.dst_tp)
            for d in range(peer_map.dst_tp)
            for s in peer_map.expected_writers(d)
        )
    )


def _tokens(request: ReceiveRequest) -> TokenRange:
    # the draft KV moves from where the target's does: the receiver holds (or zeroed) what comes before
    draft = request.block_ids("draft") is not None
    return TokenRange(
        request.token_start,
        request.token_end,
        draft_start=request.token_start if draft else request.token_end,
        state=True,
    )


def _memory_type(staging: StagingPool | None, src_pools: Sequence[Mapping[str, torch.Tensor]] | None) -> str:
    """Where a bounced writer's bytes are: the staging it packs into, else the context's pools."""
    if staging is not None:
        return staging.buffer.device.type
    for pools in src_pools or ():
        for tensor in pools.values():
            return tensor.device.type
    return "cpu"


def prepare_source(
    peer_map: PeerMap,
    src_ranks: Sequence[int],
    src_blocks: Mapping[str, Sequence[int]],
    src_slot: int | None,
    prompt_tokens: int,
) -> RequestCache:
    """The context request's cache, with the sender ranks' side of the transfer a receive request for the whole
    prompt (draft KV included) will ask for worked out already: pass it to :func:`plan_transfer` as
    ``src_blocks`` when that request comes, and the plan only maps the receiver's side. A request for another
    range (the receiver reuses a prefix, or has no drafter) is planned in full, as without it.

    :raises ~kvferry.errors.ConfigError: the ids or the slot do not cover the prompt.
    """
    src = RequestCache(src_blocks, src_slot)
    draft_start = 0 if "draft" in src.blocks else prompt_tokens
    tokens = TokenRange(0, prompt_tokens, draft_start=draft_start, state=True)
    peer_map.prepare_source(src_ranks, src, tokens)
    return src


def _dst_cache(request: ReceiveRequest, table: PageTable | None = None) -> RequestCache:
    """The receiver's cache of ``request``. With ``table`` (the request passed :func:`check_request` against
    it): ids that came off the wire (:class:`~kvferry.wire.PackedInts`) were checked unique and positive when the
    request was decoded, and below the pool size since, so the mapping does not check them again."""
    cache = RequestCache(
        {b.group: b.block_ids for b in request.blocks}, request.slot if request.slot > 0 else None
    )
    if table is not None:
        for b in request.blocks:
            if type(b.block_ids) is PackedInts:
                cache.trust(b.group, table.pool_group(b.group).num_slots)
    return cache


def plan_transfer(
    peer_map: PeerMap,
    src_ranks: Sequence[int],
    src_blocks: Mapping[str, Sequence[int]] | RequestCache,
    src_slot: int | None,
    request: ReceiveRequest,
    dst_tables: Sequence[PageTable],
    *,
    max_chunk_bytes: int | None = None,
    policy: BouncePolicy | None = None,
    src_pools: Sequence[Mapping[str, torch.Tensor]] | None = None,
    staging: StagingPool | None = None,
) -> WriterPlan:
    """The chunks of every writer (context rank ``s`` in ``src_ranks`` x each generation rank it overlaps)
    for ``request``; a writer with nothing to send (elected out) gets an empty list and reports an empty write.

    ``src_blocks``: the context request's block table per paged group (the same on every context rank);
    ``src_slot``: its state slot. Or ``src_blocks`` is the request's cache from :func:`prepare_source` (with its
    slot; ``src_slot`` is not used), which saves the sender's side of the mapping here. Draft groups move only
    when the request names draft blocks.

    Chunks (the unit of posting, reporting and cancellation): at most ``max_chunk_bytes`` each when given; by
    default a direct writer posts one indexed write (:meth:`~.mapping.RankMap.indexed_write`: the pair's
    template and the request's ids; more writes only add per-write costs) and
    a bounced writer chunks of :func:`default_chunk_bytes` for its memory (:data:`DEFAULT_CHUNK_BYTES` of host
    memory, packing the next overlapping writing this one; one chunk of device memory, up to
    :data:`DEFAULT_DEVICE_CHUNK_BYTES`).

    Staging, per writer and side (``policy``, default :class:`~.mapping.BouncePolicy`, judges each side's own
    runs): the sender's side is *packed* when its runs look fragmented and ``src_pools``
    (``CacheArena.pool_tensors()`` per context rank, indexed by rank) and ``staging`` (the writer's registered
    staging, when it has room) are given: a :class:`~.staging.StagedWrite` packs each chunk's bytes right before
    it is posted, and :func:`~.session.send` releases its lease (call
    :meth:`~.session.SendSession.release_staging` if the plan is never sent). The receiver's side goes *through
    its staging area* when the request offers one to the writer and the receiver's runs look fragmented: the
    chunks land in the area and their reports say ``staged`` (the receiver unpacks each as it lands). Both: a
    bounce (packed bytes into the area, few large fragments); one: the packed bytes into the receiver's runs, or
    the sender's runs into the area; neither: a direct write. A full pool costs speed, never a transfer. On an
    exception nothing stays reserved.

    :raises ~kvferry.errors.WireFormatError: the request does not fit the receiver's page tables, or a staging
        area is smaller than what its writer would stage.
    :raises ~kvferry.errors.ConfigError: the context request's ids do not cover the range.
    """
    groups = [g.name for g in dst_tables[0].pool_groups]
    if request.block_ids("draft") is None:
        groups = [g for g in groups if g != "draft"]
    check_request(request, dst_tables, groups)
    tokens = _tokens(request)
    dst = _dst_cache(request, dst_tables[0])
    src = src_blocks if isinstance(src_blocks, RequestCache) else RequestCache(src_blocks, src_slot)
    areas: dict[int, StagingArea] = {a.writer: a for a in request.staging}
    policy = BouncePolicy() if policy is None else policy
    can_pack = staging is not None and src_pools is not None
    default_chunk = default_chunk_bytes(_memory_type(staging, src_pools))
    lease = None
    plan: WriterPlan = {}
    try:
        for s in src_ranks:
            for d in peer_map.targets(s):
                w = writer_id(s, d, peer_map.dst_tp)
                area = areas.get(w)
                pair = peer_map.pair(s, d)
                if area is None and max_chunk_bytes is None:
                    # a direct writer in one chunk unless it packs: one indexed write (the template is checked
                    # once by the transport, the request's ids every time; no addresses worked out here). A
                    # template of fewer rows than the policy wants cannot have enough fragments to pack.
                    indexed = pair.indexed_write(src, dst, tokens)
                    if indexed is None:
                        plan[w] = []
                        continue
                    if not (can_pack and policy.wants(len(indexed.rows), indexed.nbytes)):
                        plan[w] = [Chunk.of_indexed(d, indexed)]
                        continue
                staged = can_pack or area is not None
                rank_plan = pair.plan(src, dst, tokens, policy=policy if staged else BouncePolicy.never())
                if rank_plan.empty:
                    plan[w] = []
                    continue
                nbytes = rank_plan.nbytes
                if area is not None and area.nbytes < nbytes:
                    raise WireFormatError(
                        f"staging area of writer {w}: {area.nbytes} bytes < {nbytes} to write"
                    )
                # the receiver's side is fragmented (it offered an area; we judge its runs the same way)
                into_area = (
                    area is not None
                    and rank_plan.dst_runs is not None
                    and policy.wants(len(rank_plan.dst_runs), nbytes)
                )
                lease = None
                if rank_plan.gather is not None and staging is not None and src_pools is not None:
                    lease = staging.try_reserve(nbytes)  # the sender's side is fragmented: pack it
                chunk_bytes = default_chunk if max_chunk_bytes is None else max_chunk_bytes
                if lease is not None and rank_plan.gather is not None and src_pools is not None:
                    packed = StagedWrite(rank_plan.gather, src_pools[s], lease)
                    if into_area:  # a bounce: packed bytes into the area, the receiver unpacks
                        assert area is not None
                        src_f, dst_f = rank_plan.staged_fragments(
                            lease.address, area.address, chunk_bytes=chunk_bytes
                        )
                        plan[w] = [
                            Chunk(
                                d,
                                src_f[i : i + 1],
                                dst_f[i : i + 1],
                                packed,
                                int(src_f[i, 0]) - lease.address,
                            )
                            for i in range(len(src_f))
                        ]
                    else:  # packed bytes straight into the receiver's (large) runs
                        assert rank_plan.dst_runs is not None
                        src_f = _packed(lease.address, rank_plan.dst_runs)
                        plan[w] = [
                            attrs.evolve(c, staged=packed)
                            for c in split_chunks(d, src_f, rank_plan.dst_runs, max_bytes=chunk_bytes)
                        ]
                    lease = None
                elif into_area:  # the sender's (large) runs into the area, the receiver unpacks
                    assert area is not None and rank_plan.src_runs is not None
                    dst_f = _packed(area.address, rank_plan.src_runs)
                    plan[w] = [
                        attrs.evolve(c, area_offset=int(c.dst[0, 0]) - area.address)
                        for c in split_chunks(d, rank_plan.src_runs, dst_f, max_bytes=chunk_bytes)
                    ]
                elif max_chunk_bytes is None:  # direct, already coalesced
                    plan[w] = [Chunk(d, rank_plan.src, rank_plan.dst)]
                else:
                    plan[w] = split_chunks(d, rank_plan.src, rank_plan.dst, max_bytes=max_chunk_bytes)
    except BaseException:
        for chunks in plan.values():  # nothing was sent: give back the leases already taken
            for chunk in chunks:
                if chunk.staged is not None:
                    chunk.staged.release()
        if lease is not None:
            lease.release()
        raise
    return plan


def _packed(address: int, runs: Fragments) -> Fragments:
    """``runs``' bytes back to back from ``address``: the other side of a write whose one side is packed."""
    out = np.empty_like(runs)
    lengths = runs[:, 1]
    out[:, 1] = lengths
    out[:, 0] = np.uint64(address) + np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.uint64)
    return out


def offer_staging(
    peer_map: PeerMap,
    request: ReceiveRequest,
    dst_pools: Sequence[Mapping[str, torch.Tensor]],
    staging: StagingPool,
    *,
    policy: BouncePolicy | None = None,
) -> tuple[ReceiveRequest, ReceiveStaging]:
    """The receiver's side of bouncing: reserve a staging area for each writer whose bytes land fragmented
    (by ``policy`` on the receiver's own fragments; :meth:`~.mapping.BouncePolicy.always` offers to every
    writer with bytes) while ``staging`` has room, and return ``request`` naming those areas plus the
    :class:`~.staging.ReceiveStaging` to hand to :meth:`~.session.Receiver.new_session`.

    ``dst_pools``: ``CacheArena.pool_tensors()`` per receiving rank. Writers that find no room get no area
    (they write directly). On an exception nothing stays reserved.
    """
    policy = BouncePolicy() if policy is None else policy
    tokens, dst = _tokens(request), _dst_cache(request)
    out = ReceiveStaging()
    try:
        for d in range(peer_map.dst_tp):
            for s in peer_map.expected_writers(d):
                if not peer_map.writes(s, d):
                    continue
                rx = peer_map.pair(s, d).scatter_plan(dst, tokens)
                if not rx.nbytes or not policy.wants(rx.num_fragments, rx.nbytes):
                    continue
                lease = staging.try_reserve(rx.nbytes)
                if lease is None:
                    continue
                out.add(writer_id(s, d, peer_map.dst_tp), lease, rx, dst_pools[d])
    except BaseException:
        out.release()
        raise
    return attrs.evolve(request, staging=out.areas()), out


def destinations(peer_map: PeerMap, request: ReceiveRequest) -> Fragments:
    """Every byte range of the receiver's memory that the writers of ``request`` may write: on every receiving
    rank, each writing pair's destination runs (:meth:`~.mapping.RankMap.destinations`, the bytes its direct
    write lands on, packed or not) and the staging areas the request offers (a bouncing writer lands there).
    What the receiver grants the context peer for the session, and nothing more
    (:meth:`~.session.Receiver.receive`): the request's pages only where its transfer writes them (its token
    range, every layer and head the writers hold, draft pages when the draft travels), its state slot's
    transferred sections.

    :raises ~kvferry.errors.ConfigError: the request's ids do not fit the receiver's tables.
    """
    tokens, dst = _tokens(request), _dst_cache(request)
    parts = [
        peer_map.pair(s, d).destinations(dst, tokens)
        for d in range(peer_map.dst_tp)
        for s in peer_map.expected_writers(d)
        if peer_map.writes(s, d)
    ]
    parts.append(np.array([[a.address, a.nbytes] for a in request.staging], dtype=np.uint64).reshape(-1, 2))
    return np.concatenate(parts)


class ManagerHold:
    """A :class:`~.session.PageHold` over one request in one cache manager per receiving rank.

    :meth:`free` closes the request everywhere; :meth:`quarantine` closes it with ``quarantine=True`` (pages,
    draft pages and slot stay out of the pools) and returns the callable that releases them.
    """

    def __init__(self, managers: Sequence[CacheManager], request_id: object) -> None:
        self.managers = tuple(managers)
        self.request_id = request_id

    def free(self) -> None:
        for manager in self.managers:
            manager.close(self.request_id)

    def quarantine(self) -> Callable[[], None]:
        tickets = [(m, m.close(self.request_id, quarantine=True)) for m in self.managers]

        def release() -> None:
            for manager, ticket in tickets:
                if ticket is not None:
                    manager.release(ticket)

        return release

    def __repr__(self) -> str:
        return f"<ManagerHold {self.request_id!r} on {len(self.managers)} ranks>"
