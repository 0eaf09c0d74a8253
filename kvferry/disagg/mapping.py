"""Which bytes of a context (sender) rank go where on a generation (receiver) rank, for one request.

Peers exchange page tables (:class:`~kvferry.pools.pagetable.PageTable`) at the handshake. From a sender's and a
receiver's table, :class:`RankMap` precomputes *pieces*: one per (layer, role, kv head) of a PAGED group and one
per (role, layer, conv section or SSM head run) of a STATE group, each with its address in slot (page) 0 and
the slot stride on both sides. A request then gives, per side, the page ids of every PAGED group (from token
0) and the state slot (:class:`RequestCache`), and a :class:`TokenRange`; :meth:`RankMap.plan` turns pieces into
*units* with numpy broadcasting and merges the units that are contiguous on both sides into fragments
(``(n, 2)`` uint64 ``(address, length)`` arrays, see :mod:`kvferry.transports.base`).

Speed: what does not depend on page ids is computed once per pair (pieces of one page or slot that stay
contiguous on both sides whatever the ids, merged into runs) and once per token range (the layout of every run,
kept for a few ranges), so a request costs a few numpy operations per group: 8K tokens of nemotron-h-8b plan in
~0.2 ms (TP 1->1) and ~0.35 ms (1->4, four pairs) on a 2-core VM.

Rules, all decided from the two tables alone:

- Ranks: rank ``r`` of a TP group of size ``T`` holds the share ``[r/T, (r+1)/T)`` of the model; a sender rank
  and a receiver rank *overlap* when their shares intersect (:func:`overlapping_ranks`). A receiver expects a
  result from every overlapping sender rank, including ranks that hold nothing it needs (an empty write).
- Heads: the bytes of a head (kv head, SSM head, conv channel) that several ranks hold (duplicated when the TP
  size exceeds the head count) are written by exactly one sender rank per receiver rank (:func:`elected`).
- Groups: layer groups pair by their global layer ids; paired groups must agree on kind, roles, dtypes and
  whole-model shapes (else :class:`~kvferry.errors.PeerIncompatible`); the page size (``tokens_per_block``) may
  differ: pages are mapped by token ranges. Draft groups (ids from ``DRAFT_LAYER_SHIFT``) that only one side has
  are skipped (the receiver's drafter then starts cold); a target layer only one side has is PeerIncompatible.
- Tokens: target PAGED groups move ``[start, end)``, draft groups ``[draft_start, end)`` (default 0: the whole
  prompt, never trimmed by the receiver's prefix reuse), STATE groups the whole slot when ``state`` is set.
- Order: units come in a canonical order that depends on the two tables, the receiver's ids and the token range
  only (never on the sender's page ids), so the receiver computes the staging layout of a bounced transfer
  itself (:meth:`RankMap.scatter_plan`).

Nothing here touches memory except :meth:`StagingPlan.gather` / :meth:`StagingPlan.scatter`.
"""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import attrs
import numpy as np
import numpy.typing as npt
import torch
from attrs import define, frozen

from kvferry.errors import ConfigError, PeerIncompatible
from kvferry.kernels.copy import gather_fragments, scatter_fragments
from kvferry.pools.layout import GroupKind, LayerGroup, Role
from kvferry.pools.pagetable import PageTable, check_compatible
from kvferry.pools.spec import DRAFT_LAYER_SHIFT, HeadShard, dtype_from_name
from kvferry.transports.base import Fragments
from kvferry.transports.indexed import IndexedRows, IndexedWrite
from kvferry.wire import PackedInts

__all__ = [
    "BouncePolicy",
    "MappingStatistics",
    "PeerMap",
    "RankMap",
    "RequestCache",
    "StagingPlan",
    "StagingSegment",
    "TokenRange",
    "TransferPlan",
    "elected",
    "overlapping_ranks",
]

log = logging.getLogger(__name__)

Int64Array = npt.NDArray[np.int64]

_EMPTY = np.zeros(0, dtype=np.int64)


# --- ranks and heads ---------------------------------------------------------------------------------------


def overlapping_ranks(tp_size: int, rank: int, peer_tp_size: int) -> range:
    """Ranks of a peer of ``peer_tp_size`` whose share of the model intersects the share of ``rank``.

    Symmetric: a sender's receivers are ``overlapping_ranks(src_tp, src_rank, dst_tp)`` and a receiver's expected
    writers ``overlapping_ranks(dst_tp, dst_rank, src_tp)``. TP 1->2: rank 0 -> (0, 1); TP 4->2: receiver 1 <- (2, 3).

    :raises ~kvferry.errors.ConfigError: on a non-positive size or a rank out of range.
    """
    if tp_size <= 0 or peer_tp_size <= 0 or not 0 <= rank < tp_size:
        raise ConfigError(f"bad TP geometry: rank {rank} of {tp_size}, peer size {peer_tp_size}")
    return range(rank * peer_tp_size // tp_size, -(-(rank + 1) * peer_tp_size // tp_size))


def elected(src: HeadShard, src_rank: int, dst: HeadShard, dst_rank: int) -> bool:
    """Whether sender ``src_rank`` writes the heads it shares with receiver ``dst_rank``.

    Ranks holding the same heads are *replicas*; ``rank % replicas`` is a rank's replica index. Receiver replica
    ``j`` of ``R`` reads from sender replica ``j * S // R`` of ``S``: the sender replica whose share of the model
    holds the start of the receiver's, so each receiver byte has exactly one writer, the writer always overlaps
    the receiver (:func:`overlapping_ranks`), equal TP sizes pair rank ``r`` with rank ``r``, and fan-out spreads
    over the sender's replicas. Without duplication on the sender side (``S == 1``) every holder is elected.
    """
    return src_rank % src.replicas == (dst_rank % dst.replicas) * src.replicas // dst.replicas


def _intersect(src: HeadShard, dst: HeadShard) -> tuple[int, int]:
    return max(src.first, dst.first), min(src.first + src.count, dst.first + dst.count)


# --- inputs ------------------------------------------------------------------------------------------------


def _ids_array(value: Any) -> Int64Array:
    if type(value) is PackedInts and sys.byteorder == "little":  # ids off the wire: a view of their bytes
        return np.frombuffer(value.packed, dtype=np.int64)
    if type(value) in (list, tuple) and value and set(map(type, value)) == {int}:  # a block table's ints
        try:
            out = np.fromiter(value, dtype=np.int64, count=len(value))
        except OverflowError as exc:
            raise ConfigError(f"page ids must be integers: {exc}") from None
        out.flags.writeable = False
        return out
    try:
        array = np.asarray(value)
        if array.size == 0:
            return _EMPTY
        if not np.issubdtype(array.dtype, np.integer):
            raise ConfigError(f"page ids must be integers, got {array.dtype}")
        out = np.ascontiguousarray(array.reshape(-1), dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(f"page ids must be integers: {exc}") from None
    out.flags.writeable = False
    return out


def _blocks(value: Mapping[str, Any]) -> Mapping[str, Int64Array]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"blocks must map group names to page ids, got {type(value).__name__}")
    return {str(name): _ids_array(ids) for name, ids in value.items()}


def _optional_slot(_instance: object, _attribute: object, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ConfigError(f"slot must be a non-negative int or None, got {value!r}")


@frozen(eq=False)
class RequestCache:
    """One side's cache of one request.

    ``blocks[group]`` are the page ids of a PAGED group from token 0: page ``blocks[group][i]`` holds tokens
    ``[i * tokens_per_block, (i + 1) * tokens_per_block)`` (the engine's block table). Only pages of the
    transferred token range are read, so earlier entries may be anything (e.g. a reused prefix). ``slot`` is the
    state slot of every STATE group (one id, as the cache manager hands out), None when there is none.
    """

    blocks: Mapping[str, Int64Array] = attrs.field(converter=_blocks)
    slot: int | None = attrs.field(default=None, validator=_optional_slot)
    #: page ids already validated for a (group, page size, pool size, token range, uniqueness): every rank pair
    #: of a request reads the same ids
    _checked: dict[tuple[str, int, int, int, int, bool], Int64Array] = attrs.field(
        factory=dict, init=False, repr=False
    )
    #: groups whose whole id list is known unique, positive and below a bound: group -> bound (the ids of a
    #: receive request off the wire, which its decoding and :func:`~.transfer.check_request` checked)
    _trusted: dict[str, int] = attrs.field(factory=dict, init=False, repr=False)
    #: unit addresses as a sender's side, per (rank map, token range): worked out once per request, ahead of
    #: its receive request when the sender prepares (:meth:`PeerMap.prepare_source`)
    _source: dict[tuple[Any, ...], Int64Array] = attrs.field(factory=dict, init=False, repr=False)


def _non_negative(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{attribute.name} must be a non-negative int, got {value!r}")


@frozen
class TokenRange:
    """What one transfer moves: target pages' tokens ``[start, end)``, draft pages' ``[draft_start, end)``, and
    the state slots when ``state`` (the state after ``end`` tokens: set it on a request's last chunk)."""

    start: int = attrs.field(validator=_non_negative)
    end: int = attrs.field(validator=_non_negative)
    draft_start: int = attrs.field(default=0, validator=_non_negative)
    state: bool = True

    def __attrs_post_init__(self) -> None:
        if self.start > self.end or self.draft_start > self.end:
            raise ConfigError(f"bad token range [{self.start}, {self.end}) (draft from {self.draft_start})")


@frozen
class BouncePolicy:
    """When to stage a transfer: at least ``min_fragments`` fragments after coalescing whose mean length is
    below ``max_mean_bytes``. ``BouncePolicy(min_fragments=0, max_mean_bytes=2**62)`` always bounces (non-empty
    transfers), ``BouncePolicy.never()`` never does."""

    min_fragments: int = attrs.field(default=256, validator=_non_negative)
    max_mean_bytes: int = attrs.field(default=16 << 10, validator=_non_negative)

    @classmethod
    def never(cls) -> BouncePolicy:
        return cls(min_fragments=1 << 62, max_mean_bytes=0)

    @classmethod
    def always(cls) -> BouncePolicy:
        return cls(min_fragments=1, max_mean_bytes=1 << 62)

    def wants(self, fragments: int, nbytes: int) -> bool:
        return fragments > 0 and fragments >= self.min_fragments and nbytes < self.max_mean_bytes * fragments


# --- outputs -----------------------------------------------------------------------------------------------


@frozen
class MappingStatistics:
    """What one transfer (or a sum of them) moves.

    ``units``: pieces before coalescing (one per layer/role/head/token run, conv section run or SSM head run);
    ``fragments``: after merging units contiguous on both sides (what a direct write posts); ``posted``: what is
    actually written (1 per staged transfer); ``gather_fragments`` / ``scatter_fragments``: runs the staging
    kernels copy (0 unless bounced); ``bytes_per_group``: (group name, bytes) pairs.
    """

    nbytes: int = 0
    units: int = 0
    fragments: int = 0
    posted: int = 0
    bounced: int = 0
    gather_fragments: int = 0
    scatter_fragments: int = 0
    bytes_per_group: tuple[tuple[str, int], ...] = ()

    @property
    def bounce(self) -> bool:
        return self.bounced > 0

    def __add__(self, other: MappingStatistics) -> MappingStatistics:
        groups: dict[str, int] = dict(self.bytes_per_group)
        for name, nbytes in other.bytes_per_group:
            groups[name] = groups.get(name, 0) + nbytes
        return MappingStatistics(
            nbytes=self.nbytes + other.nbytes,
            units=self.units + other.units,
            fragments=self.fragments + other.fragments,
            posted=self.posted + other.posted,
            bounced=self.bounced + other.bounced,
            gather_fragments=self.gather_fragments + other.gather_fragments,
            scatter_fragments=self.scatter_fragments + other.scatter_fragments,
            bytes_per_group=tuple(groups.items()),
        )

    @classmethod
    def total(cls, items: Iterable[MappingStatistics]) -> MappingStatistics:
        out = cls()
        for item in items:
            out = out + item
        return out


@frozen(eq=False)
class StagingSegment:
    """``fragments`` (``(n, 2)`` int64 ``(offset in pool, length)``) of pool ``pool``, packed back to back at
    ``offset`` of the staging buffer (``nbytes`` in all)."""

    pool: str
    offset: int
    nbytes: int
    fragments: Int64Array


@frozen(eq=False)
class StagingPlan:
    """One side's staging layout of a bounced transfer: the bytes of its fragments, packed in canonical order.

    The sender's plan (:attr:`TransferPlan.gather`) and the receiver's (:meth:`RankMap.scatter_plan`) list the
    same bytes in the same order, so staging byte ``i`` of the sender lands at staging byte ``i`` of the receiver.
    """

    nbytes: int
    segments: tuple[StagingSegment, ...]

    @property
    def num_fragments(self) -> int:
        return sum(len(s.fragments) for s in self.segments)

    def _check(self, pools: Mapping[str, torch.Tensor], staging: torch.Tensor) -> None:
        missing = sorted({s.pool for s in self.segments} - set(pools))
        if missing:
            raise ConfigError(f"no pool tensors for {missing}")
        if staging.dim() != 1 or staging.dtype != torch.uint8 or staging.numel() < self.nbytes:
            raise ConfigError(f"staging must be a 1-D uint8 tensor of at least {self.nbytes} bytes")

    def gather(self, pools: Mapping[str, torch.Tensor], staging: torch.Tensor) -> torch.Tensor:
        """Pack the fragments' bytes of ``pools`` (``CacheArena.pool_tensors()``) into ``staging``; returns the
        first :attr:`nbytes` bytes of it. Reads only.

        :raises ~kvferry.errors.ConfigError: on a missing pool or a staging buffer too small (nothing written).
        """
        self._check(pools, staging)
        for segment in self.segments:
            out = staging[segment.offset : segment.offset + segment.nbytes]
            gather_fragments(pools[segment.pool], segment.fragments, out)
        return staging[: self.nbytes]

    def scatter(self, pools: Mapping[str, torch.Tensor], staging: torch.Tensor) -> None:
        """Unpack ``staging`` into the fragments of ``pools``: the inverse of :meth:`gather`.

        :raises ~kvferry.errors.ConfigError: on a missing pool or a staging buffer too small; nothing is written
            then. A failure inside a later segment leaves earlier segments written (they only touch the request's
            own pages and slot).
        """
        self._check(pools, staging)
        for segment in self.segments:
            scatter_fragments(
                pools[segment.pool],
                segment.fragments,
                staging[segment.offset : segment.offset + segment.nbytes],
            )


@frozen(eq=False)
class TransferPlan:
    """What sender rank ``src_rank`` writes to receiver rank ``dst_rank`` for one request.

    ``src`` / ``dst``: coalesced fragments (absolute addresses) of a direct write; empty when this sender is
    elected out of every byte (it still reports an empty write). ``gather``: set when the policy finds the
    sender's side fragmented (its runs, :attr:`src_runs`): pack with ``gather.gather(pools, staging)``; then
    write :meth:`staged_fragments` into the receiver's staging area (a bounce: the receiver unpacks with its own
    :meth:`RankMap.scatter_plan`) or the packed bytes into :attr:`dst_runs` (the receiver's side is not
    fragmented). ``src_runs`` / ``dst_runs``: each side's bytes in canonical (staging) order, merged where that
    side alone is contiguous (within one pool); None when the policy can never bounce. Writing ``src_runs`` into
    the receiver's staging area is the other half-bounce (only the receiver's side is fragmented).
    """

    src_rank: int
    dst_rank: int
    src: Fragments
    dst: Fragments
    gather: StagingPlan | None
    statistics: MappingStatistics
    src_runs: Fragments | None = None
    dst_runs: Fragments | None = None

    @property
    def empty(self) -> bool:
        return len(self.src) == 0

    @property
    def nbytes(self) -> int:
        return self.statistics.nbytes

    def staged_fragments(
        self, src_staging: int, dst_staging: int, *, chunk_bytes: int = 0
    ) -> tuple[Fragments, Fragments]:
        """The write of a bounced transfer: ``nbytes`` from address ``src_staging`` to ``dst_staging``, in chunks
        of ``chunk_bytes`` (0: one fragment)."""
        n = self.nbytes
        step = chunk_bytes if chunk_bytes > 0 else max(n, 1)
        offsets = np.arange(0, n, step, dtype=np.uint64)
        lengths = np.minimum(np.uint64(step), np.uint64(n) - offsets)
        src = np.stack([offsets + np.uint64(src_staging), lengths], axis=1)
        dst = np.stack([offsets + np.uint64(dst_staging), lengths], axis=1)
        return np.ascontiguousarray(src), np.ascontiguousarray(dst)


# --- precomputed pieces ------------------------------------------------------------------------------------


@frozen(eq=False)
class _Side:
    """Per piece: address in slot 0, slot stride and pool index on one side."""

    base: Int64Array
    stride: Int64Array
    pool: Int64Array


@frozen(eq=False)
class _GroupMap:
    """The pieces of one (sender layer group, receiver layer group) pair, in canonical order.

    PAGED: one piece per (layer, role, head); ``length`` is bytes per token of one head and ``src.base`` already
    includes the head's offset in the page. STATE: one piece per (role, layer, section or head run); ``length``
    is the piece's bytes.
    """

    src_group: str
    dst_group: str
    kind: GroupKind
    draft: bool
    src_tokens_per_block: int
    dst_tokens_per_block: int
    src_num_slots: int
    dst_num_slots: int
    src: _Side
    dst: _Side
    length: Int64Array
    #: per number of tokens (PAGED) or 1 (STATE): the runs of pieces that merge on both sides, see :meth:`runs`
    _runs: dict[int, tuple[Int64Array, Int64Array]] = attrs.field(factory=dict, init=False, repr=False)

    @property
    def num_pieces(self) -> int:
        return len(self.length)

    def runs(self, tokens: int) -> tuple[Int64Array, Int64Array]:
        """The pieces of one page (PAGED, ``tokens`` tokens of it) or one slot (STATE, ``tokens`` = 1) merged into
        runs that are contiguous on both sides whatever the page or slot ids: ``(first piece of each run, bytes per
        token of each run)``. Consecutive pieces merge when they share pool, stride and ``length`` on each side
        and the next one starts where this one's ``tokens * length`` bytes end, on both sides. Depends on the two
        tables only, so it is computed once per ``tokens`` and kept."""
        cached = self._runs.get(tokens)
        if cached is not None:
            return cached
        n = self.num_pieces
        if n == 0:
            out = (_EMPTY, _EMPTY)
        else:
            src, dst, length = self.src, self.dst, self.length
            span = tokens * length[:-1]
            joins = (
                (src.base[1:] - src.base[:-1] == span)
                & (dst.base[1:] - dst.base[:-1] == span)
                & (src.stride[1:] == src.stride[:-1])
                & (dst.stride[1:] == dst.stride[:-1])
                & (src.pool[1:] == src.pool[:-1])
                & (dst.pool[1:] == dst.pool[:-1])
                & (length[1:] == length[:-1])
            )
            first = np.flatnonzero(np.concatenate(([True], ~joins))).astype(np.int64)
            out = (first, np.add.reduceat(length, first).astype(np.int64))
        for array in out:
            array.flags.writeable = False
        self._runs[tokens] = out
        return out


@define(eq=False)
class _PieceBuilder:
    src_base: list[int] = attrs.Factory(list)
    src_stride: list[int] = attrs.Factory(list)
    src_pool: list[int] = attrs.Factory(list)
    dst_base: list[int] = attrs.Factory(list)
    dst_stride: list[int] = attrs.Factory(list)
    dst_pool: list[int] = attrs.Factory(list)
    length: list[int] = attrs.Factory(list)

    def add(self, src: tuple[int, int, int], dst: tuple[int, int, int], length: int) -> None:
        self.src_base.append(src[0])
        self.src_stride.append(src[1])
        self.src_pool.append(src[2])
        self.dst_base.append(dst[0])
        self.dst_stride.append(dst[1])
        self.dst_pool.append(dst[2])
        self.length.append(length)

    def sides(self) -> tuple[_Side, _Side, Int64Array]:
        def arr(values: list[int]) -> Int64Array:
            return np.asarray(values, dtype=np.int64).reshape(-1)

        return (
            _Side(arr(self.src_base), arr(self.src_stride), arr(self.src_pool)),
            _Side(arr(self.dst_base), arr(self.dst_stride), arr(self.dst_pool)),
            arr(self.length),
        )


def _is_draft(group: LayerGroup) -> bool:
    return group.layer_ids[0] >= DRAFT_LAYER_SHIFT


def _check_geometry(src: LayerGroup, dst: LayerGroup) -> None:
    def shape(g: LayerGroup) -> dict[str, object]:
        return {
            "kind": g.kind,
            "layer_kind": g.layer_kind,
            "roles": g.roles,
            "dtypes": g.dtypes,
            "head_dim": g.head_dim,
            "heads": g.heads.total,
            "state_size": g.state_size,
            "conv_kernel": g.conv_kernel,
            "conv_sections": tuple(s.total for s in g.conv_sections),
        }

    a, b = shape(src), shape(dst)
    diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    if diff:
        raise PeerIncompatible(f"layer groups {src.name} / {dst.name} differ: {diff}")


def _pool_index(table: PageTable) -> dict[str, int]:
    return {pool.name: i for i, pool in enumerate(p for g in table.pool_groups for p in g.pools)}


def _locator(table: PageTable, pools: dict[str, int]) -> Any:
    def locate(layer_id: int, role: Role) -> tuple[int, int, int]:
        pool, entry = table.locate(layer_id, role)
        base = pool.base + pool.layer_ids.index(layer_id) * pool.layer_stride + entry.offset
        return base, pool.slot_stride, pools[pool.name]

    return locate


def _group_map(src_table: PageTable, src: LayerGroup, dst_table: PageTable, dst: LayerGroup) -> _GroupMap:
    _check_geometry(src, dst)
    dst_layers = set(dst.layer_ids)
    layers = [layer for layer in src.layer_ids if layer in dst_layers]
    src_at = _locator(src_table, _pool_index(src_table))
    dst_at = _locator(dst_table, _pool_index(dst_table))
    s_rank, d_rank = src_table.rank, dst_table.rank
    out = _PieceBuilder()
    if src.kind == GroupKind.PAGED:
        lo, hi = _intersect(src.heads, dst.heads)
        if lo < hi and elected(src.heads, s_rank, dst.heads, d_rank):
            for layer in layers:
                for role in src.roles:
                    head_bytes = src.head_dim * dtype_from_name(src.dtype(role)).itemsize
                    s_base, s_stride, s_pool = src_at(layer, role)
                    d_base, d_stride, d_pool = dst_at(layer, role)
                    for head in range(lo, hi):
                        s_off = (head - src.heads.first) * src.tokens_per_block * head_bytes
                        d_off = (head - dst.heads.first) * dst.tokens_per_block * head_bytes
                        out.add(
                            (s_base + s_off, s_stride, s_pool), (d_base + d_off, d_stride, d_pool), head_bytes
                        )
    else:
        # role-major: every layer's conv, then every layer's SSM, so runs stay inside one pool and merge
        channel = src.conv_channel_bytes
        for role in src.roles:
            for layer in layers:
                s_base, s_stride, s_pool = src_at(layer, role)
                d_base, d_stride, d_pool = dst_at(layer, role)
                if role == Role.CONV:
                    s_sec = d_sec = 0
                    for s_shard, d_shard in zip(src.conv_sections, dst.conv_sections, strict=True):
                        lo, hi = _intersect(s_shard, d_shard)
                        if lo < hi and elected(s_shard, s_rank, d_shard, d_rank):
                            s_off = s_sec + (lo - s_shard.first) * channel
                            d_off = d_sec + (lo - d_shard.first) * channel
                            out.add(
                                (s_base + s_off, s_stride, s_pool),
                                (d_base + d_off, d_stride, d_pool),
                                (hi - lo) * channel,
                            )
                        s_sec += s_shard.count * channel
                        d_sec += d_shard.count * channel
                else:
                    per_head = src.ssm_bytes_per_head
                    lo, hi = _intersect(src.heads, dst.heads)
                    if lo < hi and elected(src.heads, s_rank, dst.heads, d_rank):
                        s_off = (lo - src.heads.first) * per_head
                        d_off = (lo - dst.heads.first) * per_head
                        out.add(
                            (s_base + s_off, s_stride, s_pool),
                            (d_base + d_off, d_stride, d_pool),
                            (hi - lo) * per_head,
                        )
    src_side, dst_side, length = out.sides()
    return _GroupMap(
        src_group=src.name,
        dst_group=dst.name,
        kind=src.kind,
        draft=_is_draft(src),
        src_tokens_per_block=src.tokens_per_block,
        dst_tokens_per_block=dst.tokens_per_block,
        src_num_slots=src_table.pool_group(src.name).num_slots,
        dst_num_slots=dst_table.pool_group(dst.name).num_slots,
        src=src_side,
        dst=dst_side,
        length=length,
    )


# --- per request -------------------------------------------------------------------------------------------


def _segments(lo: int, hi: int, a: int, b: int) -> tuple[Int64Array, Int64Array]:
    """Split tokens ``[lo, hi)`` at every multiple of ``a`` and of ``b``: each piece lies in one page per side."""
    cuts = np.arange((lo // a + 1) * a, hi, a, dtype=np.int64)
    if b != a:
        cuts = np.union1d(cuts, np.arange((lo // b + 1) * b, hi, b, dtype=np.int64))
    starts = np.concatenate((np.asarray([lo], dtype=np.int64), cuts))
    ends = np.concatenate((cuts, np.asarray([hi], dtype=np.int64)))
    return starts, ends


def _pages(
    cache: RequestCache, group: str, tokens_per_block: int, num_slots: int, lo: int, hi: int, *, unique: bool
) -> Int64Array:
    """The page ids holding tokens ``[lo, hi)`` (validated once per cache and arguments), indexed by
    ``token // tokens_per_block``."""
    key = (group, tokens_per_block, num_slots, lo, hi, unique)
    checked = cache._checked.get(key)
    if checked is not None:
        return checked
    try:
        blocks = cache.blocks[group]
    except KeyError:
        raise ConfigError(f"no page ids for group {group!r}; have {sorted(cache.blocks)}") from None
    first, last = lo // tokens_per_block, (hi - 1) // tokens_per_block
    if len(blocks) <= last:
        raise ConfigError(f"group {group!r}: {len(blocks)} page ids do not cover {hi} tokens")
    bound = cache._trusted.get(group)
    if bound is not None and bound <= num_slots:
        cache._checked[key] = blocks  # every id unique, positive and below the pool's size: so are those used
        return blocks
    used = blocks[first : last + 1]
    if int(used.min()) < 0 or int(used.max()) >= num_slots:
        raise ConfigError(f"group {group!r}: page ids must lie in [0, {num_slots})")
    if unique:  # ids lie in [0, num_slots): one mark per pool page, no sort
        seen = np.zeros(num_slots, dtype=np.bool_)
        seen[used] = True
        if int(np.count_nonzero(seen)) != len(used):
            raise ConfigError(f"group {group!r}: destination page ids repeat")
    cache._checked[key] = blocks
    return blocks


def _slot(cache: RequestCache, group: str, num_slots: int) -> int:
    if cache.slot is None:
        raise ConfigError(f"group {group!r} needs a state slot")
    if cache.slot >= num_slots:
        raise ConfigError(f"group {group!r}: slot {cache.slot} outside [0, {num_slots})")
    return cache.slot


def _page_runs(g: _GroupMap, seg_tokens: Int64Array) -> tuple[Int64Array, Int64Array, Int64Array]:
    """The runs (:meth:`_GroupMap.runs`) of every segment of a PAGED group in canonical order (segment-major):
    ``(segment index, first piece, bytes)`` per run. Segments of one length share one run table (typically all
    but the first and last segment are whole pages)."""
    count = len(seg_tokens)
    if count and seg_tokens.min() == seg_tokens.max():
        piece, bytes_per_token = g.runs(int(seg_tokens[0]))
        seg = np.repeat(np.arange(count, dtype=np.int64), len(piece))
        return seg, np.tile(piece, count), seg_tokens[seg] * np.tile(bytes_per_token, count)
    values, inverse = np.unique(seg_tokens, return_inverse=True)
    tables = [g.runs(int(v)) for v in values.tolist()]
    runs = np.asarray([len(t[0]) for t in tables], dtype=np.int64)
    first = np.zeros((len(tables), int(runs.max(initial=0))), dtype=np.int64)
    per_token = np.zeros_like(first)
    for i, (p, t) in enumerate(tables):
        first[i, : len(p)] = p
        per_token[i, : len(t)] = t
    per_segment = runs[inverse]
    seg = np.repeat(np.arange(count, dtype=np.int64), per_segment)
    j = np.arange(len(seg), dtype=np.int64) - np.repeat(np.cumsum(per_segment) - per_segment, per_segment)
    table = inverse[seg]
    return seg, first[table, j], seg_tokens[seg] * per_token[table, j]


#: token ranges whose layout a :class:`RankMap` keeps (the oldest is dropped)
_LAYOUTS_KEPT = 16


def _ro(array: Int64Array) -> Int64Array:
    array.flags.writeable = False
    return array


@frozen(eq=False)
class _Part:
    """One group's units in a :class:`_Layout` (rows ``where``). Per unit and side: which entry of the block
    table holds its page (``*_page``; None for a STATE group: the slot), the address in page or slot 0, and the
    stride; the unit's address is ``base + page_or_slot * stride``."""

    group: _GroupMap
    where: slice
    lo: int
    hi: int
    src_page: Int64Array | None
    src_base: Int64Array
    src_stride: Int64Array
    dst_page: Int64Array | None
    dst_base: Int64Array
    dst_stride: Int64Array

    def side(self, *, src: bool) -> _PartSide:
        """One side of the part: its units' page entries, bases and strides, and its group's name, page size and
        pool size on that side."""
        g = self.group
        if src:
            return _PartSide(
                self.src_page,
                self.src_base,
                self.src_stride,
                g.src_group,
                g.src_tokens_per_block,
                g.src_num_slots,
            )
        return _PartSide(
            self.dst_page,
            self.dst_base,
            self.dst_stride,
            g.dst_group,
            g.dst_tokens_per_block,
            g.dst_num_slots,
        )


class _PartSide(NamedTuple):
    page: Int64Array | None
    base: Int64Array
    stride: Int64Array
    group: str
    tokens_per_block: int
    num_slots: int


@frozen(eq=False)
class _Layout:
    """The units of a transfer of one token range in canonical order, without page ids: per group a
    :class:`_Part`, lengths and pool indices per unit, bytes (per group and in all) and the number of units before
    pieces of one page or slot contiguous on both sides were merged (:meth:`_GroupMap.runs`; the merged rows hold
    the same bytes in the same order)."""

    parts: tuple[_Part, ...]
    length: Int64Array
    src_pool: Int64Array
    dst_pool: Int64Array
    nbytes: int
    count: int
    bytes_per_group: tuple[tuple[str, int], ...]
    #: per side (True: the sender's), what its id vector is made of: per part the group, its page size, its
    #: pool size, the token range and whether it is a state group (the vector's key in a RequestCache)
    ids_keys: dict[bool, tuple[Any, ...]] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        keys = {
            src: (
                "ids",
                src,
                *(
                    (side.group, side.tokens_per_block, side.num_slots, part.lo, part.hi, side.page is None)
                    for part in self.parts
                    for side in (part.side(src=src),)
                ),
            )
            for src in (True, False)
        }
        object.__setattr__(self, "ids_keys", keys)


def _coalesced(src: Int64Array, dst: Int64Array, length: Int64Array) -> tuple[Fragments, Fragments]:
    """``(address, length)`` fragments of both sides, consecutive units contiguous on both sides merged (what
    :func:`~kvferry.transports.base.coalesce` does, on the unit arrays)."""
    if len(length) > 1:
        joins = (src[:-1] + length[:-1] == src[1:]) & (dst[:-1] + length[:-1] == dst[1:])
        if joins.any():
            starts = np.flatnonzero(np.concatenate(([True], ~joins)))
            src, dst, length = src[starts], dst[starts], np.add.reduceat(length, starts)
    out_src = np.empty((len(length), 2), dtype=np.uint64)
    out_dst = np.empty((len(length), 2), dtype=np.uint64)
    out_src[:, 0], out_src[:, 1] = src, length
    out_dst[:, 0], out_dst[:, 1] = dst, length
    return out_src, out_dst


def _run_starts(address: Int64Array, length: Int64Array, pool: Int64Array) -> Int64Array:
    """Indices of the units that start a run of units contiguous on this side (and in one pool)."""
    if len(address) == 0:
        return _EMPTY
    joins = (address[:-1] + length[:-1] == address[1:]) & (pool[:-1] == pool[1:])
    return np.flatnonzero(np.concatenate(([True], ~joins)))


def _fragments(address: Int64Array, length: Int64Array, starts: Int64Array) -> Fragments:
    """``(address, length)`` of the runs of units beginning at ``starts``."""
    out = np.empty((len(starts), 2), dtype=np.uint64)
    if len(starts):
        out[:, 0], out[:, 1] = address[starts], np.add.reduceat(length, starts)
    return out


def _runs(
    address: Int64Array, length: Int64Array, pool: Int64Array, names: Sequence[str], bases: Int64Array
) -> StagingPlan:
    """Merge consecutive units contiguous on this side (and in one pool) and pack them into a staging layout."""
    n = len(address)
    if n == 0:
        return StagingPlan(nbytes=0, segments=())
    starts = _run_starts(address, length, pool)
    run_address, run_pool = address[starts], pool[starts]
    run_length = np.add.reduceat(length, starts)
    staging = np.concatenate(([0], np.cumsum(run_length)))
    cuts = np.flatnonzero(np.concatenate(([True], run_pool[1:] != run_pool[:-1], [True])))
    segments: list[StagingSegment] = []
    for a, b in itertools.pairwise(cuts.tolist()):
        p = int(run_pool[a])
        fragments = np.stack([run_address[a:b] - bases[p], run_length[a:b]], axis=1).astype(np.int64)
        segments.append(
            StagingSegment(
                pool=names[p],
                offset=int(staging[a]),
                nbytes=int(staging[b] - staging[a]),
                fragments=np.ascontiguousarray(fragments),
            )
        )
    return StagingPlan(nbytes=int(staging[-1]), segments=tuple(segments))


@define(eq=False)
class RankMap:
    """The mapping from one sender rank's page table to one receiver rank's (build once per peer pair).

    Build with :meth:`build`; per request call :meth:`plan` on the sender and, for a bounced transfer,
    :meth:`scatter_plan` on the receiver. Pure computation: nothing here reads or writes cache memory.
    """

    src_rank: int
    dst_rank: int
    src_tp: int
    dst_tp: int
    overlaps: bool
    groups: tuple[_GroupMap, ...]
    skipped: tuple[str, ...]
    _src_pools: tuple[str, ...]
    _dst_pools: tuple[str, ...]
    _src_bases: Int64Array
    _dst_bases: Int64Array
    _layouts: dict[tuple[int, int, int, bool], _Layout] = attrs.field(factory=dict, init=False, repr=False)
    _indexed: dict[tuple[int, int, int, bool], IndexedRows] = attrs.field(
        factory=dict, init=False, repr=False
    )

    @classmethod
    def build(cls, src: PageTable, dst: PageTable, *, warn: bool = True) -> RankMap:
        """Pair sender table ``src`` with receiver table ``dst``.

        Draft groups only one side has are skipped (listed in :attr:`skipped`; one warning unless ``warn`` is
        False).

        :raises ~kvferry.errors.PeerIncompatible: on another wire version or model (compatibility hash), paired
            groups whose shapes or dtypes differ, a target layer only one side holds, or head shards that do not
            follow the tables' TP sizes (a non-overlapping pair that would exchange bytes).
        """
        check_compatible(src, dst)
        groups: list[_GroupMap] = []
        skipped: list[str] = []
        matched_dst: set[str] = set()
        for s_group in src.layer_groups:
            s_layers = set(s_group.layer_ids)
            matches = [g for g in dst.layer_groups if s_layers & set(g.layer_ids)]
            covered = set().union(*(set(g.layer_ids) for g in matches)) if matches else set()
            if not matches and _is_draft(s_group):
                skipped.append(s_group.name)
                continue
            if covered != s_layers:
                raise PeerIncompatible(
                    f"receiver rank {dst.rank} lacks layers {sorted(s_layers - covered)} of group {s_group.name}"
                )
            for d_group in matches:
                matched_dst.add(d_group.name)
                groups.append(_group_map(src, s_group, dst, d_group))
        for d_group in dst.layer_groups:
            if d_group.name in matched_dst:
                continue
            if not _is_draft(d_group):
                raise PeerIncompatible(f"sender rank {src.rank} lacks the layers of group {d_group.name}")
            skipped.append(d_group.name)
        overlaps = dst.rank in overlapping_ranks(src.tp_size, src.rank, dst.tp_size)
        if not overlaps and any(g.num_pieces for g in groups):
            raise PeerIncompatible(
                f"head shards of ranks {src.rank}/{src.tp_size} and {dst.rank}/{dst.tp_size} share bytes "
                "although their shares of the model do not overlap"
            )
        if skipped and warn:
            _warn_skipped(skipped, src, dst)

        def pools(table: PageTable) -> tuple[tuple[str, ...], Int64Array]:
            flat = [p for g in table.pool_groups for p in g.pools]
            return tuple(p.name for p in flat), np.asarray([p.base for p in flat], dtype=np.int64)

        src_pools, src_bases = pools(src)
        dst_pools, dst_bases = pools(dst)
        return cls(
            src_rank=src.rank,
            dst_rank=dst.rank,
            src_tp=src.tp_size,
            dst_tp=dst.tp_size,
            overlaps=overlaps,
            groups=tuple(groups),
            skipped=tuple(skipped),
            src_pools=src_pools,
            dst_pools=dst_pools,
            src_bases=src_bases,
            dst_bases=dst_bases,
        )

    def __repr__(self) -> str:
        groups = ", ".join(f"{g.src_group}->{g.dst_group}:{g.num_pieces}" for g in self.groups)
        skipped = f" skipped {list(self.skipped)}" if self.skipped else ""
        return (
            f"<RankMap {self.src_rank}/{self.src_tp} -> {self.dst_rank}/{self.dst_tp}"
            f"{'' if self.overlaps else ' (no overlap)'} pieces [{groups}]{skipped}>"
        )

    @property
    def writes(self) -> bool:
        """Whether this sender rank writes any byte to this receiver rank (False: it reports an empty write)."""
        return any(g.num_pieces for g in self.groups)

    @property
    def num_pieces(self) -> int:
        return sum(g.num_pieces for g in self.groups)

    def _layout(self, tokens: TokenRange) -> _Layout:
        """Everything of a transfer of ``tokens`` that does not depend on page ids or slots (computed once per
        token range and kept, a few ranges at most)."""
        key = (tokens.start, tokens.end, tokens.draft_start, tokens.state)
        layout = self._layouts.get(key)
        if layout is not None:
            return layout
        parts: list[_Part] = []
        lengths: list[Int64Array] = []
        src_pools: list[Int64Array] = []
        dst_pools: list[Int64Array] = []
        per_group: dict[str, int] = {}
        count = offset = 0
        for g in self.groups:
            if g.num_pieces == 0:
                continue
            if g.kind == GroupKind.PAGED:
                lo = tokens.draft_start if g.draft else tokens.start
                hi = tokens.end
                if lo >= hi:
                    continue
                a, b = g.src_tokens_per_block, g.dst_tokens_per_block
                starts, ends = _segments(lo, hi, a, b)
                seg, piece, length = _page_runs(g, ends - starts)
                count += len(starts) * g.num_pieces
                at = starts[seg]
                per_token = g.length[piece]
                part = _Part(
                    g,
                    slice(offset, offset + len(piece)),
                    lo,
                    hi,
                    _ro(at // a),
                    _ro(g.src.base[piece] + (at % a) * per_token),
                    _ro(g.src.stride[piece]),
                    _ro(at // b),
                    _ro(g.dst.base[piece] + (at % b) * per_token),
                    _ro(g.dst.stride[piece]),
                )
            else:
                if not tokens.state:
                    continue
                piece, length = g.runs(1)
                count += g.num_pieces
                part = _Part(
                    g,
                    slice(offset, offset + len(piece)),
                    0,
                    0,
                    None,
                    _ro(g.src.base[piece]),
                    _ro(g.src.stride[piece]),
                    None,
                    _ro(g.dst.base[piece]),
                    _ro(g.dst.stride[piece]),
                )
            parts.append(part)
            offset += len(piece)
            src_pools.append(g.src.pool[piece])
            dst_pools.append(g.dst.pool[piece])
            lengths.append(length)
            per_group[g.dst_group] = per_group.get(g.dst_group, 0) + int(length.sum())

        def cat(arrays: list[Int64Array]) -> Int64Array:
            return _ro(np.concatenate(arrays).astype(np.int64, copy=False)) if arrays else _EMPTY

        length = cat(lengths)
        layout = _Layout(
            parts=tuple(parts),
            length=length,
            src_pool=cat(src_pools),
            dst_pool=cat(dst_pools),
            nbytes=int(length.sum()),
            count=count,
            bytes_per_group=tuple(per_group.items()),
        )
        if len(self._layouts) >= _LAYOUTS_KEPT:
            self._layouts.pop(next(iter(self._layouts)))
        self._layouts[key] = layout
        return layout

    def _addresses(self, layout: _Layout, cache: RequestCache, *, src: bool) -> Int64Array:
        """The start address of every unit of ``layout`` on one side, from that side's page ids and slot."""
        out = np.empty(len(layout.length), dtype=np.int64)
        for part in layout.parts:
            side = part.side(src=src)
            view = out[part.where]
            if side.page is None:
                np.multiply(side.stride, _slot(cache, side.group, side.num_slots), out=view)
            else:
                pages = _pages(
                    cache, side.group, side.tokens_per_block, side.num_slots, part.lo, part.hi, unique=not src
                )
                np.multiply(pages[side.page], side.stride, out=view)
            view += side.base
        return out

    def plan(
        self,
        src: RequestCache,
        dst: RequestCache,
        tokens: TokenRange,
        *,
        policy: BouncePolicy | None = None,
    ) -> TransferPlan:
        """The fragments this sender rank writes to this receiver rank for one request.

        :param src: the sender's page ids and slot; ``dst``: the receiver's (from its receive request).
        :param policy: when to bounce (default :class:`BouncePolicy`).
        :raises ~kvferry.errors.ConfigError: on a missing group, page ids that do not cover the range or lie out
            of range, repeated destination page ids, or a missing or out-of-range slot.
        """
        policy = BouncePolicy() if policy is None else policy
        layout = self._layout(tokens)
        src_address = self.source_addresses(src, tokens)
        dst_address = self._addresses(layout, dst, src=False)
        length = layout.length
        src_frags, dst_frags = _coalesced(src_address, dst_address, length)
        nbytes = layout.nbytes
        fragments = len(src_frags)
        gather: StagingPlan | None = None
        src_runs = dst_runs = None
        if len(length) >= policy.min_fragments:  # else no side can look fragmented enough to stage
            src_starts = _run_starts(src_address, length, layout.src_pool)
            dst_starts = _run_starts(dst_address, length, layout.dst_pool)
            src_runs = _fragments(src_address, length, src_starts)
            dst_runs = _fragments(dst_address, length, dst_starts)
            if policy.wants(len(src_starts), nbytes):
                gather = _runs(src_address, length, layout.src_pool, self._src_pools, self._src_bases)
        statistics = MappingStatistics(
            nbytes=nbytes,
            units=layout.count,
            fragments=fragments,
            posted=(1 if nbytes else 0) if gather is not None else fragments,
            bounced=int(gather is not None),
            gather_fragments=0 if gather is None else gather.num_fragments,
            scatter_fragments=0 if gather is None or dst_runs is None else len(dst_runs),
            bytes_per_group=layout.bytes_per_group,
        )
        return TransferPlan(
            src_rank=self.src_rank,
            dst_rank=self.dst_rank,
            src=src_frags,
            dst=dst_frags,
            gather=gather,
            statistics=statistics,
            src_runs=src_runs,
            dst_runs=dst_runs,
        )

    def source_addresses(self, src: RequestCache, tokens: TokenRange) -> Int64Array:
        """The sender's unit addresses of a transfer of ``tokens`` (kept in ``src`` for later plans of the same
        range: a sender may work them out before the receive request comes).

        :raises ~kvferry.errors.ConfigError: as :meth:`plan`, for the sender's ids and slot.
        """
        key = (self, (tokens.start, tokens.end, tokens.draft_start, tokens.state))
        address = src._source.get(key)
        if address is None:
            address = src._source[key] = _ro(self._addresses(self._layout(tokens), src, src=True))
        return address

    def indexed_rows(self, tokens: TokenRange) -> IndexedRows:
        """The template of every request's transfer of ``tokens`` (:class:`~kvferry.transports.indexed.IndexedRows`:
        the units of :meth:`plan`, in the same order, with their addresses left to the page ids and slot of each
        side); computed once per token range and kept, so a transport checks it once
        (:meth:`indexed_write` gives one request's ids)."""
        key = (tokens.start, tokens.end, tokens.draft_start, tokens.state)
        rows = self._indexed.get(key)
        if rows is not None:
            return rows
        layout = self._layout(tokens)
        # per side: each row's position in the id vector, its base and stride; and each position's limit
        columns: dict[bool, tuple[list[Int64Array], ...]] = {True: ([], [], [], []), False: ([], [], [], [])}
        for part in layout.parts:
            rows_of_part = part.where.stop - part.where.start
            for src in (True, False):
                side = part.side(src=src)
                slot, base, stride, limit = columns[src]
                at = sum(len(x) for x in limit)
                if side.page is None:  # a STATE group: one position, the slot
                    slot.append(np.full(rows_of_part, at, dtype=np.int64))
                    count = 1
                else:  # the pages holding [lo, hi): block table entries first..last
                    first = part.lo // side.tokens_per_block
                    slot.append(side.page - first + at)
                    count = (part.hi - 1) // side.tokens_per_block - first + 1
                base.append(side.base)
                stride.append(side.stride)
                limit.append(np.full(count, side.num_slots, dtype=np.int64))

        def cat(arrays: list[Int64Array]) -> Int64Array:
            return np.concatenate(arrays) if arrays else _EMPTY

        (ss, sb, st, sl), (ds, db, dt, dl) = ([cat(c) for c in columns[src]] for src in (True, False))
        rows = IndexedRows(ss, sb, st, ds, db, dt, layout.length, sl, dl)
        if len(self._indexed) >= _LAYOUTS_KEPT:
            self._indexed.pop(next(iter(self._indexed)))
        self._indexed[key] = rows
        return rows

    def _ids(self, layout: _Layout, cache: RequestCache, *, src: bool) -> Int64Array:
        """One side's id vector of :meth:`indexed_rows` for ``cache``: per group of the layout, the page ids of
        its token range (PAGED) or the slot (STATE), validated as :meth:`plan` validates them. Kept in ``cache``
        under what it is made of (groups, page sizes, pool sizes, token ranges): the rank pairs of a request
        that read the same ids (every sender rank's, the same receiver groups of every receiving rank) share
        one vector."""
        key = layout.ids_keys[src]
        ids = cache._source.get(key)
        if ids is not None:
            return ids
        parts: list[Int64Array] = []
        for name, tpb, slots, lo, hi, state in key[2:]:
            if state:
                parts.append(np.full(1, _slot(cache, name, slots), dtype=np.int64))
            else:
                pages = _pages(cache, name, tpb, slots, lo, hi, unique=not src)
                parts.append(pages[lo // tpb : (hi - 1) // tpb + 1])
        ids = cache._source[key] = _ro(np.concatenate(parts)) if parts else _EMPTY
        return ids

    def source_ids(self, src: RequestCache, tokens: TokenRange) -> Int64Array:
        """The sender's id vector of :meth:`indexed_rows` for ``src`` (kept in ``src``, as
        :meth:`source_addresses` keeps its addresses).

        :raises ~kvferry.errors.ConfigError: as :meth:`plan`, for the sender's ids and slot.
        """
        return self._ids(self._layout(tokens), src, src=True)

    def indexed_write(self, src: RequestCache, dst: RequestCache, tokens: TokenRange) -> IndexedWrite | None:
        """This sender rank's write for one request as an indexed write (:meth:`indexed_rows` with both sides'
        ids; its notification left to the caller), or None when it writes nothing. The same bytes in the same
        order as :meth:`plan`'s fragments.

        :raises ~kvferry.errors.ConfigError: as :meth:`plan`.
        """
        rows = self.indexed_rows(tokens)
        if not len(rows):
            return None
        dst_ids = self._ids(self._layout(tokens), dst, src=False)
        return IndexedWrite(rows, self.source_ids(src, tokens), dst_ids)

    def scatter_plan(self, dst: RequestCache, tokens: TokenRange) -> StagingPlan:
        """The receiver's staging layout of a bounced transfer from this sender rank (needs no sender page ids).

        Its :attr:`StagingPlan.nbytes` is what to reserve for this sender; unpack with
        ``plan.scatter(arena.pool_tensors(), staging)`` once the sender reports its staged write.

        :raises ~kvferry.errors.ConfigError: as :meth:`plan`, for the receiver's ids.
        """
        layout = self._layout(tokens)
        address = self._addresses(layout, dst, src=False)
        return _runs(address, layout.length, layout.dst_pool, self._dst_pools, self._dst_bases)

    def destinations(self, dst: RequestCache, tokens: TokenRange) -> Fragments:
        """The receiver's byte ranges this sender rank writes for a request (needs no sender ids): the runs of
        :meth:`indexed_rows`' template that stay contiguous on the receiver's side whatever the ids
        (:meth:`~kvferry.transports.indexed.IndexedRows.destination_runs`), at the request's ids. The same bytes
        as :meth:`plan`'s ``dst`` (and :meth:`indexed_write`'s rows): what the receiver grants the writer for
        the request (:func:`~.transfer.destinations`).

        :raises ~kvferry.errors.ConfigError: as :meth:`plan`, for the receiver's ids.
        """
        rows = self.indexed_rows(tokens)
        if not len(rows):
            return np.zeros((0, 2), dtype=np.uint64)
        return rows.destination_runs(self._ids(self._layout(tokens), dst, src=False))

    def nbytes(self, dst: RequestCache, tokens: TokenRange) -> int:
        """Bytes this sender rank writes for a request (from the receiver's side; no sender ids needed)."""
        layout = self._layout(tokens)
        self._addresses(layout, dst, src=False)  # validates the ids
        return layout.nbytes


def _warn_skipped(skipped: Sequence[str], src: PageTable, dst: PageTable) -> None:
    log.warning(
        "draft KV groups %s exist on one side only (sender tp %d, receiver tp %d): skipped, the receiver's "
        "drafter starts without the prompt's draft KV",
        sorted(set(skipped)),
        src.tp_size,
        dst.tp_size,
    )


# --- whole peers -------------------------------------------------------------------------------------------


def _by_rank(tables: Sequence[PageTable], side: str) -> dict[int, PageTable]:
    if not tables:
        raise ConfigError(f"no {side} page tables")
    sizes = {t.tp_size for t in tables}
    if len(sizes) != 1:
        raise PeerIncompatible(f"{side} page tables disagree on the TP size: {sorted(sizes)}")
    out: dict[int, PageTable] = {}
    for t in tables:
        if t.rank in out:
            raise ConfigError(f"two {side} page tables for rank {t.rank}")
        out[t.rank] = t
    return out


@define(eq=False)
class PeerMap:
    """The mapping between a sender (context) engine's ranks and a receiver (generation) engine's ranks.

    Build with :meth:`build` from the tables this process knows: a sender rank passes its own table and every
    receiver rank's, a receiver rank every sender rank's and its own (any subset works; pairs need both tables).
    Rank overlap needs only the TP sizes.
    """

    src_tp: int
    dst_tp: int
    _pairs: dict[tuple[int, int], RankMap]
    skipped: tuple[str, ...]

    @classmethod
    def build(cls, senders: Sequence[PageTable], receivers: Sequence[PageTable]) -> PeerMap:
        """Pair every overlapping (sender, receiver) rank of the given tables; one warning if draft groups are
        skipped.

        :raises ~kvferry.errors.PeerIncompatible: as :meth:`RankMap.build`, or tables of one side that disagree
            on the TP size. :raises ~kvferry.errors.ConfigError: on no tables or a rank given twice.
        """
        src = _by_rank(senders, "sender")
        dst = _by_rank(receivers, "receiver")
        src_tp = next(iter(src.values())).tp_size
        dst_tp = next(iter(dst.values())).tp_size
        first = next(iter(src.values()))
        for table in (*src.values(), *dst.values()):
            check_compatible(first, table)
        pairs: dict[tuple[int, int], RankMap] = {}
        skipped: list[str] = []
        for s, s_table in sorted(src.items()):
            for d in overlapping_ranks(src_tp, s, dst_tp):
                if d in dst:
                    pair = RankMap.build(s_table, dst[d], warn=False)
                    pairs[s, d] = pair
                    skipped.extend(n for n in pair.skipped if n not in skipped)
        # head shards that break the overlap rule would make a non-overlapping pair exchange bytes
        for s, s_table in sorted(src.items()):
            for d, d_table in sorted(dst.items()):
                if (s, d) not in pairs:
                    RankMap.build(s_table, d_table, warn=False)
        if skipped:
            _warn_skipped(skipped, first, next(iter(dst.values())))
        return cls(src_tp=src_tp, dst_tp=dst_tp, pairs=pairs, skipped=tuple(skipped))

    def __repr__(self) -> str:
        senders = sorted({s for s, _ in self._pairs})
        receivers = sorted({d for _, d in self._pairs})
        skipped = f" skipped {list(self.skipped)}" if self.skipped else ""
        return f"<PeerMap tp {self.src_tp}->{self.dst_tp} senders {senders} receivers {receivers}{skipped}>"

    def targets(self, src_rank: int) -> tuple[int, ...]:
        """Receiver ranks sender ``src_rank`` reports to for every request (empty writes included)."""
        return tuple(overlapping_ranks(self.src_tp, src_rank, self.dst_tp))

    def expected_writers(self, dst_rank: int) -> tuple[int, ...]:
        """Sender ranks receiver ``dst_rank`` waits for (every overlapping rank, elected out or not)."""
        return tuple(overlapping_ranks(self.dst_tp, dst_rank, self.src_tp))

    def prepare_source(self, src_ranks: Sequence[int], src: RequestCache, tokens: TokenRange) -> None:
        """Work out the sender ranks ``src_ranks``' side of a transfer of ``tokens`` ahead of its receive request
        (kept in ``src``; a request for another token range works its own out when planned).

        :raises ~kvferry.errors.ConfigError: as :meth:`RankMap.plan`, for the sender's ids and slot.
        """
        for s in src_ranks:
            for d in self.targets(s):
                pair = self.pair(s, d)
                if pair.writes:
                    pair.source_addresses(src, tokens)
                    pair.source_ids(src, tokens)

    def pair(self, src_rank: int, dst_rank: int) -> RankMap:
        """:raises ~kvferry.errors.ConfigError: unless both tables were given and the ranks overlap."""
        try:
            return self._pairs[src_rank, dst_rank]
        except KeyError:
            raise ConfigError(f"no mapping for sender rank {src_rank} -> receiver rank {dst_rank}") from None

    def pairs(self) -> tuple[RankMap, ...]:
        return tuple(self._pairs.values())

    def writes(self, src_rank: int, dst_rank: int) -> bool:
        """Whether ``src_rank`` writes bytes to ``dst_rank`` (False for non-overlapping or elected-out pairs)."""
        pair = self._pairs.get((src_rank, dst_rank))
        return pair is not None and pair.writes

    def overlap_table(self) -> npt.NDArray[np.bool_]:
        """``[src_tp, dst_tp]`` booleans: which ranks overlap."""
        out = np.zeros((self.src_tp, self.dst_tp), dtype=np.bool_)
        for s in range(self.src_tp):
            out[s, list(self.targets(s))] = True
        return out

    def statistics(self) -> dict[str, Any]:
        return {
            "src_tp": self.src_tp,
            "dst_tp": self.dst_tp,
            "pairs": len(self._pairs),
            "writing_pairs": sum(p.writes for p in self._pairs.values()),
            "pieces": sum(p.num_pieces for p in self._pairs.values()),
            "skipped": list(self.skipped),
        }
